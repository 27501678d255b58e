"""Build a multimodal FAISS index from a KB JSONL, streaming and resumable.

    python -m retrieval.build_index --kb kb.jsonl --images-root DIR --out INDEX_DIR \
        [--image-encoder …] [--text-encoder …] [--factory Flat|HNSW32,Flat|IVF…] [--shard-size N]

The KB is read line by line and encoded shard by shard; each finished shard is written atomically to
``INDEX_DIR/build/``. Killed and started again with the same arguments, the build skips finished shards and
produces the same index. Rows with a missing/unreadable image, empty text or no entity id are skipped and listed
in ``skipped.jsonl``; a duplicate ``entry_id`` is an error before any encoding starts.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrieval.cli import require_file
from retrieval.encoders import check_image_encoder_name, check_text_encoder_name, image_encoder, text_encoder
from retrieval.files import atomic_path, file_fingerprint, read_jsonl, write_json_atomic, write_jsonl_atomic
from retrieval.index import (
    INDEX_FILE,
    MANIFEST_FILE,
    ROWS_FILE,
    SKIPPED_FILE,
    build_faiss_index_from_chunks,
    check_factory,
    check_k,
)
from retrieval.kb import entry_text


@dataclass
class BuildArgs:
    kb: str = field(default=None, metadata={"help": "KB JSONL (one entry per ⟨image, section⟩ pair)"})
    out: str = field(default=None, metadata={"help": "index directory to write"})
    images_root: str = field(default=None, metadata={"help": "folder image paths resolve against (default: the KB's folder)"})
    image_encoder: str = field(default="EVA02-E-14-plus@laion2b_s9b_b144k", metadata={"help": "open_clip name[@tag], hf-hub:…, local-dir:…, or tiny"})
    text_encoder: str = field(default="Qwen/Qwen3-Embedding-0.6B", metadata={"help": "sentence-transformers name/path, minilm, or tiny"})
    factory: str = field(default="Flat", metadata={"help": "FAISS index factory string (inner product)"})
    shard_size: int = field(default=4096, metadata={"help": "KB rows per resumable shard"})
    batch_size: int = field(default=64, metadata={"help": "encoder batch size"})
    text_template: str = field(default="{title}. {section_title}. {text}", metadata={"help": "text embedded per KB row"})
    device: str = field(default=None, metadata={"help": "cuda / cpu (default: cuda when available)"})
    trust_remote_code: bool = field(default=False, metadata={"help": "allow remote code for the text encoder"})
    overwrite: bool = field(default=False, metadata={"help": "discard an existing or partial index in --out"})


def _settings(args: BuildArgs, fingerprint: str) -> dict:
    """What must match for a partial build to be resumed or a finished one to be reused."""
    return dict(kb_fingerprint=fingerprint, image_encoder=args.image_encoder, text_encoder=args.text_encoder,
                factory=args.factory, shard_size=args.shard_size, batch_size=args.batch_size,
                text_template=args.text_template)


def validate(args: BuildArgs) -> None:
    """Check every setting before any model loads."""
    require_file(args.kb, "kb")
    if not args.out:
        raise ValueError("--out: an index directory is required")
    check_k(args.shard_size, "shard_size")
    check_k(args.batch_size, "batch_size")
    check_factory(args.factory)
    check_image_encoder_name(args.image_encoder)
    check_text_encoder_name(args.text_encoder)
    root = Path(args.images_root or Path(args.kb).parent)
    if not root.is_dir():
        raise ValueError(f"--images_root: folder {root} does not exist")


def scan_kb(path: str | Path) -> int:
    """Count KB rows; a duplicate entry_id (or a row without one) is an error naming it."""
    seen: dict[str, int] = {}
    n = 0
    for n, rec in enumerate(read_jsonl(path), 1):
        eid = rec.get("entry_id")
        if eid is None:
            raise ValueError(f"{path}: row {n} has no entry_id")
        eid = str(eid)
        if eid in seen:
            raise ValueError(f"{path}: duplicate entry_id {eid!r} (rows {seen[eid]} and {n})")
        seen[eid] = n
    return n


def _load_image(root: Path, rel) -> tuple[object, str | None]:
    from PIL import Image

    if not rel:
        return None, "no image path"
    path = root / rel
    if not path.is_file():
        return None, f"missing image {path}"
    try:
        with Image.open(path) as im:
            return im.convert("RGB"), None
    except Exception as e:  # PIL raises many types for corrupt files
        return None, f"unreadable image {path}: {type(e).__name__}"


def _encode_shard(records: list[dict], root: Path, img_enc, txt_enc, args: BuildArgs):
    """Encode one shard's rows in batches; returns (embeddings, entry_ids, entity_ids, titles, skipped)."""
    embs, entry_ids, entity_ids, titles, skipped = [], [], [], [], []
    for start in range(0, len(records), args.batch_size):
        images, texts = [], []
        for rec in records[start:start + args.batch_size]:
            text = entry_text(rec, args.text_template) if str(rec.get("text") or "").strip() else ""
            reason = None
            if rec.get("entity_id") in (None, ""):
                reason = "no entity_id"
            elif not text:
                reason = "empty text"
            img = None
            if reason is None:
                img, reason = _load_image(root, rec.get("image"))
            if reason is not None:
                skipped.append({"entry_id": str(rec["entry_id"]), "reason": reason})
                continue
            images.append(img)
            texts.append(text)
            entry_ids.append(str(rec["entry_id"]))
            entity_ids.append(str(rec["entity_id"]))
            titles.append(str(rec.get("title") or ""))
        if images:
            embs.append(np.concatenate([img_enc.encode(images), txt_enc.encode(texts)], axis=1))
    dim = img_enc.dim + txt_enc.dim
    emb = np.concatenate(embs) if embs else np.zeros((0, dim), np.float32)
    return emb.astype(np.float32), entry_ids, entity_ids, titles, skipped


def _shard_paths(build_dir: Path, i: int) -> tuple[Path, Path]:
    return build_dir / f"shard-{i:06d}.npy", build_dir / f"shard-{i:06d}.json"


def build_index(args: BuildArgs, log=print, encoders=None) -> dict:
    """Build (or resume, or reuse) the index described by ``args``; returns the manifest.

    ``encoders``: an already-built (image, text) encoder pair whose names match ``args`` (saves a reload).
    """
    from tqdm import tqdm

    validate(args)
    out, kb = Path(args.out), Path(args.kb)
    root = Path(args.images_root or kb.parent)
    n_rows = scan_kb(kb)
    if n_rows == 0:
        raise ValueError(f"--kb: {kb} has no rows")
    settings = _settings(args, file_fingerprint(kb))
    build_dir = out / "build"
    manifest_path, state_path = out / MANIFEST_FILE, build_dir / "state.json"

    if args.overwrite and out.exists():
        shutil.rmtree(out)
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if all(manifest.get(k) == v for k, v in settings.items() if k != "shard_size" and k != "batch_size"):
            log(f"index in {out} is already built from this KB with these settings; nothing to do")
            return manifest
        raise ValueError(f"{out} holds an index built with other settings or another KB; "
                         "pass --overwrite to replace it or choose another --out")
    if state_path.exists():
        previous = json.loads(state_path.read_text())
        if previous != settings:
            diff = sorted(k for k in settings if previous.get(k) != settings[k])
            raise ValueError(f"{build_dir} holds a partial build with different {', '.join(diff)}; "
                             "pass --overwrite to start again")
        log(f"resuming the partial build in {build_dir}")
    build_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(state_path, settings)

    if encoders is not None:
        img_enc, txt_enc = encoders
        if (img_enc.name, txt_enc.name) != (args.image_encoder, args.text_encoder):
            raise ValueError(f"encoders {img_enc.name!r}/{txt_enc.name!r} given for a build that names "
                             f"{args.image_encoder!r}/{args.text_encoder!r}")
    else:
        img_enc = image_encoder(args.image_encoder, device=args.device, batch_size=args.batch_size)
        txt_enc = text_encoder(args.text_encoder, device=args.device, batch_size=args.batch_size,
                               trust_remote_code=args.trust_remote_code)
    check_factory(args.factory, img_enc.dim + txt_enc.dim)

    n_shards = (n_rows + args.shard_size - 1) // args.shard_size
    t0 = time.time()
    with tqdm(total=n_rows, unit="row", desc="encoding KB", smoothing=0.1) as bar:
        shard: list[dict] = []
        i = 0
        for rec in read_jsonl(kb):
            shard.append(rec)
            if len(shard) == args.shard_size:
                _finish_shard(build_dir, i, shard, root, img_enc, txt_enc, args)
                bar.update(len(shard))
                shard, i = [], i + 1
        if shard:
            _finish_shard(build_dir, i, shard, root, img_enc, txt_enc, args)
            bar.update(len(shard))

    entry_ids, entity_ids, titles, skipped = [], [], [], []
    for i in range(n_shards):
        meta = json.loads(_shard_paths(build_dir, i)[1].read_text())
        entry_ids += meta["entry_ids"]
        entity_ids += meta["entity_ids"]
        titles += meta["titles"]
        skipped += meta["skipped"]
    if not entry_ids:
        write_jsonl_atomic(out / SKIPPED_FILE, skipped)
        raise ValueError(f"every row of {kb} was skipped; see the reasons in {out / SKIPPED_FILE}")

    def shards():  # one shard in memory at a time: the index is the only thing that grows with the KB
        return (np.load(_shard_paths(build_dir, i)[0], allow_pickle=False) for i in range(n_shards))

    index = build_faiss_index_from_chunks(shards, args.factory, img_enc.dim + txt_enc.dim)
    rows_table = {"entry_id": entry_ids, "entity_id": entity_ids, "title": titles}
    manifest = _write_index(out, index, rows_table, skipped, settings, args, img_enc, txt_enc, kb)
    shutil.rmtree(build_dir, ignore_errors=True)
    log(f"built {out}: {manifest['rows']} rows, {manifest['entities']} entities, {len(skipped)} skipped, "
        f"{time.time() - t0:.1f}s")
    return manifest


def _finish_shard(build_dir, i, records, root, img_enc, txt_enc, args) -> None:
    npy, meta_path = _shard_paths(build_dir, i)
    if meta_path.exists():  # finished before an interruption
        return
    emb, entry_ids, entity_ids, titles, skipped = _encode_shard(records, root, img_enc, txt_enc, args)
    with atomic_path(npy, suffix=".npy") as tmp:
        np.save(tmp, emb, allow_pickle=False)
    write_json_atomic(meta_path, {"entry_ids": entry_ids, "entity_ids": entity_ids, "titles": titles,
                                  "skipped": skipped})


def _write_index(out: Path, index, rows_table: dict, skipped, settings, args, img_enc, txt_enc, kb) -> dict:
    import faiss
    import open_clip
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentence_transformers

    with atomic_path(out / INDEX_FILE) as tmp:
        faiss.write_index(index, str(tmp))
    with atomic_path(out / ROWS_FILE) as tmp:
        pq.write_table(pa.table(rows_table), tmp)
    write_jsonl_atomic(out / SKIPPED_FILE, skipped)
    manifest = {
        **settings,
        "image_dim": img_enc.dim, "text_dim": txt_enc.dim, "dim": img_enc.dim + txt_enc.dim,
        "rows": int(index.ntotal), "entities": len(set(rows_table["entity_id"])), "skipped": len(skipped),
        "kb_path": str(kb.resolve()), "images_root": str(Path(args.images_root or kb.parent).resolve()),
        "trust_remote_code": args.trust_remote_code,
        "versions": {"faiss": faiss.__version__, "open_clip": open_clip.__version__,
                     "sentence_transformers": sentence_transformers.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json_atomic(out / MANIFEST_FILE, manifest)  # written last: its presence means the index is complete
    return manifest


def main(argv=None) -> None:
    from retrieval.cli import parse

    (args,) = parse((BuildArgs,), argv, description=__doc__)
    build_index(args)


if __name__ == "__main__":
    from retrieval.cli import run

    run(main)
