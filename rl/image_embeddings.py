"""Question-image embeddings computed once, stored beside the question file, loaded by the trainer.

    accelerate launch [--num_processes N] -m rl.image_embeddings --queries rl_train.jsonl --index DIR [--images_root R]

The reward's image side is the query image's embedding, which never changes during training. Embedded once here (the
images decoded by DataLoader workers, the job split over processes and resumable, common.job_parts), they are
stored in ``<queries>.image-embeddings/<encoder>/`` and the trainer fills the reward's cache from them: when every
train and eval image has one, it never builds the image encoder (for the paper's EVA-CLIP-8B, ~15 GB of fp16 weights
per training GPU). ``python -m rl.data`` writes the store for the questions it samples.

Store folder (written whole at the end of the job; each write puts new data files beside the old ones, then replaces
``manifest.json``, which names them, so a crash leaves the old store or the new one, never a mix):
    embeddings-<id>.npy   float32 (n, dim), the image encoder's L2-normalised output, row i ↔ images[i]
    images-<id>.json      each image as the question file names it (its ``image`` field, relative to the images root)
    manifest.json         image encoder and image processor (the index's), dim, count, the two files' names, the
                          unreadable images (not tried again unless ``--retry_unreadable``)
The folder is named after the encoder and its image processor, so a file can hold stores for several encoders; a
store is used only for an index built with the same ones.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.cli import parse, require_file
from common.files import atomic_path, read_json, read_jsonl, readable_records, write_json_atomic, write_text_atomic
from common.job_parts import JobParts
from common.placement import decode_workers, dist_timeout_field, job_device, process_state
from retrieval.index import MultimodalIndex, require_index
from rewards.retrieval import image_keys

EMBEDDINGS_FILE = "embeddings.npy"  # the data files' names in a manifest that names none (stores written before)
IMAGES_FILE = "images.json"
MANIFEST_FILE = "manifest.json"
WORK_FILE = "work.jsonl"  # the resumable job's records (base64 float32), removed once the store is written


def image_path_of(rec: dict, root: Path) -> str:
    """The question's image as an absolute path string (the key of the reward's image-embedding cache)."""
    return str((root / str(rec.get("image"))).resolve())


def encoder_identity(manifest: dict) -> dict:
    """What makes two embeddings of one image comparable: the index's image encoder and image processor."""
    return {"image_encoder": manifest["image_encoder"], "image_processor": manifest.get("image_processor")}


def store_dir(queries: str | Path, manifest: dict) -> Path:
    """``<queries>.image-embeddings/<encoder slug>-<8 hex of encoder + processor>``."""
    ident = encoder_identity(manifest)
    digest = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ident["image_encoder"]).strip("_")[:60]
    queries = Path(queries)
    return queries.with_name(f"{queries.name}.image-embeddings") / f"{slug}-{digest}"


def store_manifest(queries: str | Path, manifest: dict) -> dict | None:
    """The store's own manifest for this index's encoder (None when there is no store); refuses another encoder's."""
    folder = store_dir(queries, manifest)
    try:
        meta = read_json(folder / MANIFEST_FILE)
    except FileNotFoundError:
        return None
    if {k: meta.get(k) for k in encoder_identity(manifest)} != encoder_identity(manifest):
        raise ValueError(
            f"{folder}: embeddings of {meta.get('image_encoder')!r} / {meta.get('image_processor')!r}, "
            f"but the index uses {manifest['image_encoder']!r} / {manifest.get('image_processor')!r}"
        )
    return meta


def load_store(queries: str | Path, manifest: dict, meta: dict | None = None) -> dict[str, np.ndarray]:
    """{image (as the question file names it): embedding} from the store for this index's encoder; {} when none.
    ``meta``: the store's manifest, when already read (``store_manifest``)."""
    folder = store_dir(queries, manifest)
    meta = meta or store_manifest(queries, manifest)
    if meta is None:
        return {}
    images = read_json(folder / meta.get("images_file", IMAGES_FILE))
    emb = np.load(folder / meta.get("embeddings_file", EMBEDDINGS_FILE), allow_pickle=False)
    if emb.shape != (len(images), int(manifest["image_dim"])) or meta.get("count", len(images)) != len(images):
        raise ValueError(
            f"{folder}: its embeddings have shape {emb.shape}, expected ({meta.get('count')}, "
            f"{manifest['image_dim']}) for its manifest and the index; delete the folder and re-embed"
        )
    return dict(zip(images, emb))


def write_store(folder: Path, vectors: dict[str, np.ndarray], unreadable: dict[str, str], manifest: dict) -> None:
    """The new data files beside the old ones, then the manifest that names them (atomically), then the old files
    removed: a crash at any point leaves a whole store, the old or the new."""
    folder.mkdir(parents=True, exist_ok=True)
    images = sorted(vectors)
    tag = uuid.uuid4().hex[:12]
    files = {"embeddings_file": f"embeddings-{tag}.npy", "images_file": f"images-{tag}.json"}
    with atomic_path(folder / files["embeddings_file"]) as tmp, open(tmp, "wb") as f:
        np.save(
            f,
            np.stack([vectors[i] for i in images]).astype(np.float32)
            if images
            else np.zeros((0, int(manifest["image_dim"])), np.float32),
            allow_pickle=False,
        )
    write_text_atomic(folder / files["images_file"], json.dumps(images))
    meta = {**encoder_identity(manifest), "dim": int(manifest["image_dim"]), "count": len(images), **files}
    write_json_atomic(folder / MANIFEST_FILE, {**meta, "unreadable": unreadable})
    for old in [*folder.glob("embeddings*.npy"), *folder.glob("images*.json")]:
        if old.name not in files.values():
            old.unlink(missing_ok=True)


def encoded(vector: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()


def decoded(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").copy()


def embed_images(
    queries: str | Path,
    images: list[str],
    root: Path,
    index,
    state=None,
    batch_size: int = 256,
    workers: int = 0,
    log=print,
    retry_unreadable: bool = False,
) -> Path:
    """Embed ``images`` (paths relative to ``root``) into the store beside ``queries`` for ``index``'s image encoder:
    what the store already holds is kept, the rest is split over the processes of ``state`` in batches (resumable:
    an interrupted job goes on from its work file, trying its failures again), and process 0 writes the store whole.
    Images the store lists as unreadable are not tried again unless ``retry_unreadable``. Returns the folder."""
    folder = store_dir(queries, index.manifest)
    meta = store_manifest(queries, index.manifest) or {}
    have = load_store(queries, index.manifest, meta) if meta else {}
    listed = dict(meta.get("unreadable", {}))  # an earlier run's unreadable images
    wanted = list(dict.fromkeys(str(i) for i in images))
    todo = [{"id": i} for i in wanted if i not in have and (retry_unreadable or i not in listed)]
    if not todo:
        work = [p for p in (folder / WORK_FILE, *folder.glob(f"{WORK_FILE}.part*")) if p.is_file()]
        stored = all(r.get("id") in have or r.get("id") in listed for p in work for r in readable_records(p))
        if work and stored and (state is None or state.is_main_process):  # a run killed after writing the store
            for leftover in work:  # left them; one that wanted other images too is resumed from them instead
                leftover.unlink(missing_ok=True)
        skipped = sum(i in listed for i in wanted)
        log(
            f"question-image embeddings: all {len(wanted) - skipped} readable images already in {folder}"
            + (f"; {skipped} listed unreadable there, not tried again (--retry_unreadable)" if skipped else "")
        )
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    parts = JobParts(folder / WORK_FILE, state)
    batches = parts.start(todo, batch_size, redo=lambda rec: "problem" in rec)  # an interrupted run's failures: again
    log(f"question-image embeddings ({index.manifest['image_encoder']}), {parts.status}")
    with tqdm(total=parts.mine, desc="embedding question images", unit="img", disable=not parts.mine) as bar:
        for batch in batches:
            emb, failed = index.encode_image_files([root / r["id"] for r in batch], workers)
            vectors = iter(emb)
            parts.append(
                [
                    {"id": r["id"], "problem": failed[j]}
                    if j in failed
                    else {"id": r["id"], "embedding": encoded(next(vectors))}
                    for j, r in enumerate(batch)
                ]
            )
            bar.update(len(batch))
    if parts.finish(todo):
        vectors, unreadable = dict(have), {k: v for k, v in listed.items() if k not in have}
        for rec in read_jsonl(parts.out):
            if "embedding" in rec:
                vectors[rec["id"]] = decoded(rec["embedding"])
                unreadable.pop(rec["id"], None)
            else:
                unreadable[rec["id"]] = rec["problem"]
        write_store(folder, vectors, unreadable, index.manifest)
        parts.out.unlink()
        log(
            f"question-image embeddings: {len(vectors)} images in {folder}"
            + (f"; {len(unreadable)} unreadable (listed in its {MANIFEST_FILE})" if unreadable else "")
        )
    parts.barrier("process 0 wrote the question-image embeddings")
    return folder


def preload_reward_cache(cache: dict, queries: str | Path, image_paths: list[str], root: Path, manifest: dict) -> int:
    """Put the stored embeddings of these questions' images into the reward's cache, under the keys the reward looks
    them up by (``rewards.retrieval.image_keys`` of the ``image_path`` column, which ``image_path_of``
    writes); returns how many of ``image_paths`` (absolute) now have one."""
    stored = load_store(queries, manifest)
    keys = image_keys([image_path_of({"image": image}, root) for image in stored], [])
    for key, vector in zip(keys, stored.values()):
        cache.setdefault(key, vector)
    return sum(key in cache for key in image_keys(list(image_paths), []))


def stored_image_embeddings(reward, index, args, train_data, eval_data) -> tuple[int, int]:
    """The reward's image cache filled from the train and eval files' embedding stores (rl.image_embeddings):
    (questions whose image has a stored embedding, questions)."""
    covered = total = 0
    for path, data in ((args.train_file, train_data), (args.eval_file, eval_data)):
        if data is not None:
            root = Path(args.images_root or Path(path).parent)
            covered += preload_reward_cache(reward.image_cache, path, data["image_path"], root, index.manifest)
            total += len(data)
    return covered, total


@dataclass
class EmbedArgs:
    queries: str = field(default=None, metadata={"help": "question JSONL whose images to embed"})
    index: str = field(default=None, metadata={"help": "index directory (its image encoder is used)"})
    images_root: str = field(default=None, metadata={"help": "default: the queries file's folder"})
    batch_size: int = field(default=256, metadata={"help": "images per batch (and per unit of resumed work)"})
    workers: int = field(
        default=None,
        metadata={"help": "DataLoader processes decoding images (default: usable cores ÷ processes on this node)"},
    )
    device: str = field(default=None, metadata={"help": "cuda / cuda:N / cpu (default: this process's own)"})
    retry_unreadable: bool = field(
        default=False, metadata={"help": "try again the images an earlier run listed as unreadable in the manifest"}
    )
    dist_timeout_minutes: int = dist_timeout_field()


def main(argv=None) -> None:
    (args,) = parse((EmbedArgs,), argv, description=__doc__)
    require_file(args.queries, "queries")
    require_index(args.index)
    rows = list(read_jsonl(args.queries, ("image",)))
    state = process_state(args.device, args.dist_timeout_minutes)
    # the image encoder on this process's device; the FAISS index itself is never searched here: memory-mapped
    index = MultimodalIndex.load(args.index, device=job_device(args.device, state), search_device="cpu")
    embed_images(
        args.queries,
        [r["image"] for r in rows],
        Path(args.images_root or Path(args.queries).parent),
        index,
        state,
        args.batch_size,
        decode_workers(args.workers),
        retry_unreadable=args.retry_unreadable,
    )


if __name__ == "__main__":
    from common.cli import run

    run(main)
