"""The shards of an index build (retrieval.build_index): text shards (distinct texts, each embedded once) and image
shards (KB rows, images decoded by DataLoader workers), each written atomically to the build folder: its ``.npy``
first, then its ``.json``, whose presence means the shard is complete."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.files import atomic_path, write_json_atomic
from common.placement import dtype_name
from retrieval.image_data import KBImageRows, Waits, batches_of, loader, timed
from retrieval.kb import entry_text
from retrieval.kb_scan import KBScan
from retrieval.summarize import load_summaries, summarized


def shard_paths(build_dir: Path, kind: str, i: int) -> tuple[Path, Path]:
    return build_dir / f"{kind}-{i:06d}.npy", build_dir / f"{kind}-{i:06d}.json"


SHARD_NAME = re.compile(r"(text|image)-\d{6}\.(npy|json)")


def is_build_folder(build_dir: Path) -> bool:
    """Whether ``build_dir`` holds a partial build and nothing else: its state, shards (``shard_paths``) and dot-named
    temporaries (a project's own ``build/`` folder is not one)."""
    names = [p.name for p in build_dir.iterdir()] if build_dir.is_dir() else []
    return bool(names) and all(n == "state.json" or SHARD_NAME.fullmatch(n) or n.startswith(".") for n in names)


def work_items(scan: KBScan, shard_size: int) -> list[tuple[str, int]]:
    """Every shard of the build: text shards first, then image shards."""
    n_text = -(-scan.texts // shard_size)
    n_image = -(-scan.rows // shard_size)
    return [("text", j) for j in range(n_text)] + [("image", i) for i in range(n_image)]


def save_shard(build_dir: Path, kind: str, i: int, emb: np.ndarray, meta: dict) -> None:
    npy, meta_path = shard_paths(build_dir, kind, i)
    with atomic_path(npy, suffix=".npy") as tmp:
        np.save(tmp, np.ascontiguousarray(emb, dtype=np.float32), allow_pickle=False)
    write_json_atomic(meta_path, meta)  # written last: its presence means the shard is complete


def summaries_of(path: str | None) -> dict[str, str]:
    """The summaries file's {text_sha: summary}, read once per process and version of the file (its size and
    modification time: a file rewritten between two builds of one process is read again, as its fingerprint in the
    build's settings is taken again)."""
    if not path:
        return {}
    stat = Path(path).stat()
    return _summaries(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=2)
def _summaries(path: str, size: int, mtime_ns: int) -> dict[str, str]:
    return load_summaries(path)


def encode_text_shard(j: int, scan: KBScan, txt_enc, args, build_dir: Path) -> None:
    """Embed text shard ``j``; a section with a summary (``args.summaries``, retrieval.summarize) is embedded as its
    summary."""
    summaries = summaries_of(args.summaries)
    rows = scan.text_rows[j * args.shard_size : (j + 1) * args.shard_size]
    recs = list(scan.read(rows))
    shown = [summarized(rec, summaries) for rec in recs]
    texts = [entry_text(rec, args.text_template) for rec in shown]
    lengths = [len(ids) for ids in txt_enc.model.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]]
    emb = txt_enc.encode(texts, is_query=False)
    save_shard(
        build_dir,
        "text",
        j,
        emb,
        {
            "texts": len(texts),
            "truncated": sum(n > (txt_enc.max_seq_length or n) for n in lengths),
            "summarized": sum(a is not b for a, b in zip(shown, recs)),
            "max_seq_length": txt_enc.max_seq_length,
            "query_instruction": txt_enc.query_prompt,
            "query_instruction_setting": args.query_instruction,
            "encoded_on": f"{txt_enc.device} {dtype_name(txt_enc.dtype)}",
        },
    )


def encode_image_shards(shards: list[int], scan: KBScan, root: Path, img_enc, args, build_dir: Path, workers: int):
    """Encode these image shards, their images decoded by ``workers`` DataLoader processes; returns the image loop's
    ``Waits`` (seconds in all, and waiting for decoded batches)."""
    S = args.shard_size
    batches, owner, pending = [], [], {}
    for i in shards:
        rows = np.arange(i * S, min((i + 1) * S, scan.rows))
        valid = rows[scan.text_id[rows] >= 0]
        shard_batches = batches_of(valid, args.batch_size)
        pending[i] = {
            "left": len(shard_batches),
            "emb": [],
            "rows": [],
            "entry_ids": [],
            "entity_ids": [],
            "titles": [],
            "failed": [],
            "range": rows,
        }
        batches += shard_batches
        owner += [i] * len(shard_batches)
    for i in [i for i, p in pending.items() if p["left"] == 0]:
        finish_image_shard(i, pending.pop(i), scan, img_enc, build_dir)
    waits = Waits()
    if not batches:
        return waits
    data = loader(
        KBImageRows(scan.path, scan.offsets, root, img_enc.preprocess),
        batches,
        workers,
        pin_memory=img_enc.device.startswith("cuda"),
    )
    with tqdm(total=sum(len(b) for b in batches), unit="row", desc="encoding images", smoothing=0.1) as bar:
        for i, batch in zip(owner, timed(data, waits)):
            p = pending[i]
            if batch["pixels"] is not None:
                p["emb"].append(img_enc.encode_pixels(batch["pixels"]))
                for key, name in (
                    ("rows", "i"),
                    ("entry_ids", "entry_id"),
                    ("entity_ids", "entity_id"),
                    ("titles", "title"),
                ):
                    p[key] += batch[name]
            p["failed"] += batch["failed"]
            bar.update(len(batch["i"]) + len(batch["failed"]))
            p["left"] -= 1
            if p["left"] == 0:
                finish_image_shard(i, pending.pop(i), scan, img_enc, build_dir)
    return waits


def finish_image_shard(i: int, p: dict, scan: KBScan, img_enc, build_dir: Path) -> None:
    problem_rows = [int(r) for r in p["range"] if int(r) in scan.problems]
    skipped = {
        r: {"entry_id": str(rec["entry_id"]), "reason": scan.problems[r]}
        for r, rec in zip(problem_rows, scan.read(problem_rows))
    }
    skipped.update({it["i"]: {"entry_id": it["entry_id"], "reason": it["problem"]} for it in p["failed"]})
    emb = np.concatenate(p["emb"]) if p["emb"] else np.zeros((0, img_enc.dim), np.float32)
    save_shard(
        build_dir,
        "image",
        i,
        emb,
        {
            "rows": p["rows"],
            "entry_ids": p["entry_ids"],
            "entity_ids": p["entity_ids"],
            "titles": p["titles"],
            "skipped": [skipped[r] for r in sorted(skipped)],
            "encoded_on": f"{img_enc.device} {dtype_name(img_enc.dtype)}",
        },
    )
