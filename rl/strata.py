"""Which questions the RL data holds: buckets of baseline rank sampled to their counts (WikiSeeker's stratified
sample, ``--strata``), and the held-out questions that pick the checkpoint, drawn from the rest. Pure and seeded."""

from __future__ import annotations

import numpy as np


def parse_strata(text: str) -> list[tuple[str, int | None, int | None, int]]:
    """``"1-5:500,miss:2000"`` → [(name, lo, hi, count)] with (None, None) for the miss bucket."""
    out = []
    for part in str(text).split(","):
        try:
            name, count = part.strip().rsplit(":", 1)
            count = int(count)
            if name == "miss":
                lo = hi = None
            else:
                lo, hi = (int(x) for x in name.split("-"))
                if not 1 <= lo <= hi:
                    raise ValueError
        except ValueError:
            raise ValueError(f"--strata: bucket {part.strip()!r} must look like lo-hi:count or miss:count") from None
        if count < 0:
            raise ValueError(f"--strata: bucket {name} has a negative count")
        if any(name == other for other, *_ in out):
            raise ValueError(f"--strata: bucket {name} is named twice (its questions would be sampled twice)")
        out.append((name, lo, hi, count))
    spans = sorted((lo, hi) for _, lo, hi, _ in out if lo is not None)
    for (a_lo, a_hi), (b_lo, b_hi) in zip(spans, spans[1:]):
        if b_lo <= a_hi:
            raise ValueError(f"--strata: buckets {a_lo}-{a_hi} and {b_lo}-{b_hi} overlap")
    return out


def bucket_of(rank: int | None, strata) -> str | None:
    for name, lo, hi, _ in strata:
        if (lo is None and rank is None) or (lo is not None and rank is not None and lo <= rank <= hi):
            return name
    return None


def stratified_sample(ranks: list[int | None], strata, seed: int) -> tuple[list[int], dict]:
    """Indices sampled per bucket (seeded, in file order) and a report {bucket: {available, wanted, taken}}."""
    rng = np.random.default_rng(seed)
    members: dict[str, list[int]] = {name: [] for name, *_ in strata}
    for i, r in enumerate(ranks):
        b = bucket_of(r, strata)
        if b is not None:
            members[b].append(i)
    chosen, report = [], {}
    for name, _, _, count in strata:
        pool = members[name]
        take = min(count, len(pool))
        chosen += [pool[j] for j in rng.choice(len(pool), size=take, replace=False)] if take else []
        report[name] = {"available": len(pool), "wanted": count, "taken": take}
    return sorted(chosen), report


def held_out_sample(n: int, chosen: list[int], count: int, seed: int, images: list | None = None) -> list[int]:
    """``count`` of the indices ``range(n)`` that are not ``chosen`` (seeded, in file order; all of them if fewer).
    With ``images`` (each index's image), none whose image a chosen question has: a question about a training
    image would reward remembering it, in the split that picks the checkpoint."""
    seen = {images[i] for i in chosen} if images is not None else set()
    rest = sorted(i for i in set(range(n)) - set(chosen) if images is None or images[i] not in seen)
    take = min(count, len(rest))
    picked = np.random.default_rng([seed, 1]).choice(len(rest), size=take, replace=False) if take else []
    return sorted(rest[j] for j in picked)
