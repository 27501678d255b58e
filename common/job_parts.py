"""A resumable JSONL job (one output record per input record, keyed by ``id``) split across processes.

    accelerate launch --num_processes 8 -m gate.pipeline --config …      (likewise rl.refine)

The input's records still to do are cut into batches exactly as one process would cut them; batch b goes to process
b mod N, which appends its results to its own part file ``<out>.part<rank>``. Process 0 merges the parts into
``<out>`` in input order — at the start (what an earlier, interrupted run left behind, with any process count) and at
the end, after one barrier — so the output equals a one-process run's, and the job resumes from whatever was done.
With one process (or none: ``state`` None) nothing changes but the file names in between. Every process must see the
same output folder (a shared file system across nodes): process 0 checks at the end that every input record has its
output record. ``same_settings`` records the settings that make a job's results (``<out stem>.settings.json``) and
refuses to resume results made with others, or records no settings file vouches for (another file at that path).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from common.files import (
    append_jsonl,
    check_unique_ids,
    jsonl_lines,
    read_json,
    repair_jsonl,
    write_json_atomic,
    write_jsonl_atomic,
)
from common.placement import Processes


def changed_keys(before: dict, now: dict) -> list[str]:
    """The keys, sorted, whose value differs between two sets of settings (a key in only one differs)."""
    return sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))


class JobParts(Processes):
    def __init__(self, out: str | Path, state=None):
        super().__init__(state)
        self.out = Path(out)

    @property
    def part(self) -> Path:
        return self.out.with_name(f"{self.out.name}.part{self.rank}")

    def _parts(self) -> list[Path]:
        return sorted(self.out.parent.glob(f"{glob.escape(self.out.name)}.part*"))

    def started(self) -> bool:
        """Whether an earlier run of this job left results behind (its output or part files)."""
        return self.out.exists() or bool(self._parts())

    @property
    def settings_file(self) -> Path:
        """``<out without .jsonl>.settings.json``: only ``.jsonl`` is taken off (``refined_v1.5`` and ``refined_v1.6``
        are two outputs, with two records)."""
        return self.out.with_name(self.out.name.removesuffix(".jsonl") + ".settings.json")

    def holds_records(self) -> bool:
        """Whether ``out`` holds a line, or a part file is there."""
        return bool(self._parts()) or (self.out.is_file() and any(line.strip() for line in jsonl_lines(self.out)))

    def same_settings(self, settings: dict) -> None:
        """Refuse to go on from results an earlier run made with other ``settings`` (a ValueError naming each one
        that changed), or from records with no settings recorded beside them (no run of this job wrote them: its ids
        would count as done); else record these (process 0). Call before ``start``."""
        recorded = self.settings_file
        if not recorded.exists() and self.holds_records():
            raise ValueError(
                f"{self.out} holds records but no {recorded.name}: another tool's file, or one written before this "
                "job recorded its settings (it does before its first record); use another output, or move that file "
                "away"
            )
        if self.started() and recorded.exists():
            before = read_json(recorded)
            changed = changed_keys(before, settings)
            if changed:
                said = "; ".join(f"{k}: {before.get(k)!r} then, {settings.get(k)!r} now" for k in changed)
                raise ValueError(
                    f"{self.out} holds results made with other settings ({said}): run with those to go on, use "
                    "another output, or delete it"
                )
        if self.rank == 0:
            write_json_atomic(recorded, settings)

    def merge(self, order: Sequence[str]) -> None:
        """Process 0: ``out`` ∪ every part file → ``out`` in the order of ``order`` (ids not in it last, each id once);
        the parts are removed. A last line cut short by a crash is dropped first."""
        if self.rank != 0:
            return
        parts = self._parts()
        if not parts:
            return
        by_id: dict[str, dict] = {}
        for path in [self.out, *parts]:
            for rec in repair_jsonl(path, key="id"):  # a cut last line dropped, atomically
                by_id.setdefault(str(rec["id"]), rec)
        ranked = {i: n for n, i in enumerate(order)}
        write_jsonl_atomic(self.out, (by_id[i] for i in sorted(by_id, key=lambda i: (ranked.get(i, len(ranked)), i))))
        for path in parts:
            path.unlink()

    def start(
        self, rows: Sequence[dict], batch_size: int, redo: Callable[[dict], bool] | None = None
    ) -> list[list[dict]]:
        """This process's batches of the rows not done yet (after merging leftovers); ``mine`` counts their rows and
        ``status`` says, in one line, how many are done and how many are to go here. ``redo``: the output records that
        are not done after all (a request that failed, an input that was missing), dropped to be made again."""
        if batch_size < 1:
            raise ValueError(f"{self.out}: the batch size must be positive, got {batch_size}")
        check_unique_ids(rows, f"the input of {self.out}")  # one output record per id: a repeat would be dropped
        order = [str(r["id"]) for r in rows]
        self.redone, error = 0, None
        if self.rank == 0:
            try:
                self.merge(order)
                records = repair_jsonl(self.out, key="id")  # a cut last line is dropped before anyone reads the file
                if redo is not None:
                    kept = [r for r in records if not redo(r)]
                    self.redone = len(records) - len(kept)
                    if self.redone:
                        write_jsonl_atomic(self.out, kept)
            except Exception as e:  # raised on every process below, not left for the others to wait on
                error = e
        self.barrier(f"process 0 merged what an earlier run left in {self.out}")  # no part is written before
        self.raise_everywhere(error)
        done = _ids(self.out)
        todo = [r for r in rows if str(r["id"]) not in done]
        batches = [todo[s : s + batch_size] for s in range(0, len(todo), batch_size)][self.rank :: self.count]
        self.mine = sum(len(b) for b in batches)
        self.status = (
            f"process {self.rank}/{self.count}: {len(done)} of {len(rows)} done in {self.out}, {self.mine} to go here"
            + (f" ({self.redone} left unfinished by the last run, done again)" if self.redone else "")
        )
        return batches

    def append(self, records: list[dict]) -> None:
        append_jsonl(self.part, records)

    def finish(self, rows: Sequence[dict]) -> bool:
        """Barrier, then process 0 merges every part into ``out`` and checks that every row has its record; True on
        the process holding the whole output."""
        self.barrier(f"each process finished its batches of {self.out}")
        order = [str(r["id"]) for r in rows]
        error = None
        if self.rank == 0:
            try:
                self.merge(order)
                if not self.out.exists():
                    write_jsonl_atomic(self.out, [])  # an empty job's output: empty, not absent
                done = _ids(self.out)
                missing = [i for i in order if i not in done]
                if missing:
                    raise RuntimeError(
                        f"{self.out}: {len(missing)} of {len(order)} records are missing after the merge (first: "
                        f"{', '.join(missing[:3])}): every process must write to one folder they all see (a shared "
                        "file system across nodes); run the job again to do the missing ones"
                    )
            except Exception as e:  # raised on every process, not only on process 0 (the others would wait on it)
                error = e
        self.raise_everywhere(error)
        return self.rank == 0


def _ids(path: Path) -> set[str]:
    """Ids in a file process 0 has just rewritten whole (no cut line to fix, so no write here)."""
    if not path.exists():
        return set()
    return {str(json.loads(line)["id"]) for line in jsonl_lines(path) if line.strip()}
