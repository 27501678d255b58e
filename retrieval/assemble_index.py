"""The last step of an index build (retrieval.build_index), on process 0 once every shard is written: rows in KB
order, each ``concat[image embedding, its text's embedding]`` read from the shards (retrieval.build_shards), added to
FAISS shard by shard with rows.parquet streamed alongside, then skipped.jsonl and the manifest, written last: its
presence means the index is complete.
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from common.files import atomic_path, read_json, write_json_atomic, write_jsonl_atomic
from retrieval.build_shards import shard_paths
from retrieval.encoders import query_instruction_of
from retrieval.faiss_build import build_faiss_index_from_chunks
from retrieval.index import INDEX_FILE, MANIFEST_FILE, ROWS_FILE, SKIPPED_FILE
from retrieval.kb_scan import KBScan


def assemble(out: Path, build_dir: Path, scan: KBScan, items, settings: dict, args, log) -> dict:
    """Process 0: the FAISS index from the shards (rows in KB order), rows.parquet, skipped.jsonl, the manifest.
    ``args``: the build's ``BuildArgs``; ``settings``: what the manifest records as the build's identity."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.faiss_lib import faiss

    text_metas = [read_json(shard_paths(build_dir, k, i)[1]) for k, i in items if k == "text"]
    image_shards = [i for k, i in items if k == "image"]
    S = args.shard_size

    @lru_cache(maxsize=8)  # rows of one image shard draw their texts from one or two text shards
    def text_shard(j: int) -> np.ndarray:
        return np.load(shard_paths(build_dir, "text", j)[0], allow_pickle=False)

    def vectors(i: int) -> np.ndarray:
        img = np.load(shard_paths(build_dir, "image", i)[0], allow_pickle=False)
        tid = scan.text_id[shard_rows[i]]
        txt = np.empty((len(tid), text_dim), np.float32)
        for j in np.unique(tid // S):
            sel = tid // S == j
            txt[sel] = text_shard(int(j))[tid[sel] % S]
        return np.concatenate([img, txt], axis=1)

    text_dim = int(np.load(shard_paths(build_dir, "text", 0)[0], mmap_mode="r").shape[1]) if text_metas else 0
    image_dim = int(np.load(shard_paths(build_dir, "image", 0)[0], mmap_mode="r").shape[1])
    entities, skipped, used_texts, n_rows, image_devices = set(), [], set(), 0, set()
    shard_rows: dict[int, np.ndarray] = {}  # KB rows kept per image shard (8 bytes a row), read from its meta once
    schema = pa.schema([("entry_id", pa.string()), ("entity_id", pa.string()), ("title", pa.string())])
    with atomic_path(out / ROWS_FILE) as tmp, pq.ParquetWriter(tmp, schema) as writer:
        for i in image_shards:
            meta = read_json(shard_paths(build_dir, "image", i)[1])
            writer.write_table(
                pa.table(
                    {"entry_id": meta["entry_ids"], "entity_id": meta["entity_ids"], "title": meta["titles"]},
                    schema=schema,
                )
            )
            entities.update(meta["entity_ids"])
            skipped += meta["skipped"]
            shard_rows[i] = np.asarray(meta["rows"], dtype=np.int64)
            used_texts.update(scan.text_id[shard_rows[i]].tolist())
            n_rows += len(shard_rows[i])
            image_devices.add(meta["encoded_on"])
        if n_rows == 0:
            write_jsonl_atomic(out / SKIPPED_FILE, skipped)
            raise ValueError(f"every row of {args.kb} was skipped; see the reasons in {out / SKIPPED_FILE}")
        try:
            index = build_faiss_index_from_chunks(
                lambda: (vectors(i) for i in image_shards), args.factory, image_dim + text_dim, total_rows=n_rows
            )
        except ValueError as e:
            raise ValueError(
                f"{e}; the encoded shards are kept in {build_dir}: run again with another --factory"
            ) from None
    with atomic_path(out / INDEX_FILE) as tmp:
        faiss.write_index(index, str(tmp))
    write_jsonl_atomic(out / SKIPPED_FILE, skipped)
    first_text = text_metas[0]
    if any(m["max_seq_length"] != first_text["max_seq_length"] for m in text_metas):
        raise ValueError("text shards were encoded with different max_seq_length; start again with --overwrite")
    # KB rows never carry the query instruction: a resumed build takes this run's setting, whatever its shards had
    if all(m.get("query_instruction_setting") == args.query_instruction for m in text_metas):
        instruction = first_text["query_instruction"]
    else:
        instruction = query_instruction_of(args.text_encoder, args.query_instruction, args.trust_remote_code)
    manifest = {
        **settings,
        "build": settings,
        "text_max_seq_length": first_text["max_seq_length"],
        "query_instruction": instruction,
        "query_instruction_setting": args.query_instruction,
        "image_processor": (args.image_processor or args.image_encoder[len("hf:") :])
        if args.image_encoder.startswith("hf:")
        else None,
        "image_dim": image_dim,
        "text_dim": text_dim,
        "dim": image_dim + text_dim,
        "rows": int(index.ntotal),
        "entities": len(entities),
        "skipped": len(skipped),
        "text_rows": n_rows,
        "texts_encoded": sum(m["texts"] for m in text_metas),
        "texts_used": len(used_texts),
        "texts_truncated": sum(m["truncated"] for m in text_metas),
        "text_summaries": {
            "file": str(Path(args.summaries).resolve()),
            "texts_summarized": sum(m.get("summarized", 0) for m in text_metas),
        }
        if args.summaries
        else None,
        "encoded_on": {"image": sorted(image_devices), "text": sorted({m["encoded_on"] for m in text_metas})},
        "kb_path": str(Path(args.kb).resolve()),
        "images_root": str(Path(args.images_root or Path(args.kb).parent).resolve()),
        "versions": versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json_atomic(out / MANIFEST_FILE, manifest)  # written last: its presence means the index is complete
    log(
        f"assembled {manifest['rows']:,} rows × {manifest['dim']} dims ({args.factory}); text encoder max "
        f"{manifest['text_max_seq_length']} tokens ({manifest['texts_truncated']:,} texts truncated), query "
        f"instruction {manifest['query_instruction']!r}"
    )
    return manifest


def versions() -> dict:
    import open_clip
    import sentence_transformers
    import torch
    import transformers

    from common.faiss_lib import faiss

    return {
        "faiss": faiss.__version__,
        "open_clip": open_clip.__version__,
        "torch": torch.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "transformers": transformers.__version__,
    }
