"""Build a multimodal FAISS index from a KB JSONL: streaming, resumable, on one process or many.

    python -m retrieval.build_index --config configs/retrieval/build_index_toy.yaml
    accelerate launch --num_processes 8 retrieval/build_index.py --config configs/retrieval/build_index_evqa.yaml

What every process does (each prints one line saying so):
1. scans the KB (retrieval.kb_scan: byte offsets, rows that cannot be indexed, which rows embed the same text); a
   duplicate entry_id is an error before any model loads;
2. takes its share of the unfinished work, round-robin over processes: text shards (``shard_size`` distinct texts in
   order of first appearance: a section shared by several images is embedded once per build, never with the query
   instruction) and image shards (``shard_size`` KB rows: images decoded and preprocessed by ``workers`` DataLoader
   processes, embedded by the image tower); both encoders sit on this process's device (``cuda:LOCAL_RANK`` or
   ``cpu``, fp16 image tower / bf16 text model on a GPU); every finished shard is written atomically to OUT/build/;
3. waits for the others (one barrier); process 0 then assembles (retrieval.assemble_index): rows in KB order, each
   ``concat[image embedding, its text's embedding]``, added to FAISS shard by shard (rows.parquet streamed alongside),
   the manifest last.

Killed at any point and started again with any number of processes, the build skips finished shards and produces the
same index — same rows in the same order, the same vectors — as a one-process build. A partial build resumes only
under the settings its shards were made with (KB, encoders, text settings, images root), except the FAISS factory
and the query instruction, which no shard depends on: the assembly uses this run's. Rows with a missing or corrupt
image, empty text or no entity id are skipped and listed in ``skipped.jsonl``. The manifest records what query time
must repeat: the text encoder's maximum sequence length (longer texts are truncated by its tokenizer, special tokens
kept) and its query instruction (``auto``: the model's own query prompt), the image processor.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from common.cli import parse, require_file
from common.files import file_fingerprint, read_json, write_json_atomic
from common.placement import (
    Processes,
    configure_threads,
    decode_workers,
    dist_timeout_field,
    job_device,
    process_state,
)
from retrieval.assemble_index import assemble
from retrieval.build_shards import encode_image_shards, encode_text_shard, is_build_folder, shard_paths, work_items
from retrieval.encoder_names import check_image_encoder_name, check_text_encoder_name
from retrieval.encoders import image_encoder, query_instruction_of, resolve_query_prompt, text_encoder
from retrieval.faiss_build import check_factory
from retrieval.index import INDEX_FILE, MANIFEST_FILE, ROWS_FILE
from retrieval.kb import entry_text
from retrieval.kb_scan import scan_kb
from retrieval.ranking import check_k


@dataclass
class BuildArgs:
    kb: str = field(default=None, metadata={"help": "KB JSONL (one entry per ⟨image, section⟩ pair)"})
    out: str = field(default=None, metadata={"help": "index directory to write"})
    images_root: str = field(
        default=None, metadata={"help": "folder image paths resolve against (default: the KB's folder)"}
    )
    image_encoder: str = field(
        default="EVA02-E-14-plus@laion2b_s9b_b144k",
        metadata={
            "help": "open_clip name[@tag], hf:org/repo (transformers, e.g. hf:BAAI/EVA-CLIP-8B), hf-hub:…, "
            "local-dir:…, or tiny"
        },
    )
    image_processor: str = field(
        default=None,
        metadata={
            "help": "hf: encoders only: the transformers image processor to use (default: the model's own; "
            "EVA-CLIP-8B: openai/clip-vit-large-patch14)"
        },
    )
    text_encoder: str = field(
        default="Qwen/Qwen3-Embedding-0.6B", metadata={"help": "sentence-transformers name/path, minilm, or tiny"}
    )
    text_max_seq_length: int = field(
        default=None,
        metadata={
            "help": "tokens per text for the text encoder, KB rows and queries alike (default: the model's own); "
            "longer texts are truncated, special tokens kept"
        },
    )
    query_instruction: str = field(
        default="auto",
        metadata={
            "help": "instruction put before every query at query time, never before KB rows: auto (the text model's "
            "own query prompt, e.g. Qwen3-Embedding's), none, or the text itself"
        },
    )
    factory: str = field(
        default="Flat",
        metadata={
            "help": "FAISS index factory string (inner product): Flat (fp32), SQfp16 (fp16 Flat), HNSW32,Flat, "
            "IVF4096,Flat, IVF4096,SQfp16, …"
        },
    )
    shard_size: int = field(
        default=4096,
        metadata={
            "help": "KB rows per image shard and distinct texts per text shard (the unit of resumption and of work per "
            "process)"
        },
    )
    batch_size: int = field(default=64, metadata={"help": "image encoder batch size"})
    text_batch_size: int = field(default=None, metadata={"help": "text encoder batch size (default: batch_size)"})
    workers: int = field(
        default=None,
        metadata={
            "help": "DataLoader processes decoding images, per build process (default: usable cores ÷ build processes "
            "on this node; 0 decodes in the main process)"
        },
    )
    text_template: str = field(
        default="{title}. {section_title}. {text}", metadata={"help": "text embedded per KB row"}
    )
    device: str = field(
        default=None,
        metadata={
            "help": "cuda / cuda:N / cpu (default: this process's own: cuda:LOCAL_RANK when CUDA is available, else "
            "cpu)"
        },
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "allow remote code in the encoders' repositories (EVA-CLIP-8B needs it)"}
    )
    summaries: str = field(
        default=None,
        metadata={
            "help": "summaries JSONL (retrieval.summarize): long sections "
            "embedded as their summary instead of truncated"
        },
    )
    overwrite: bool = field(default=False, metadata={"help": "discard an existing or partial index in --out"})
    dist_timeout_minutes: int = dist_timeout_field()


def _settings(args: BuildArgs, fingerprint: str, device: str) -> dict:
    """What must match for a partial build to be resumed or a finished one to be reused. ``encode_device``: the device
    type, which sets the encoders' precision (fp16 / bf16 on a GPU, fp32 on the CPU): a partial build resumed on the
    other kind would mix the two in one index."""
    return dict(
        kb_fingerprint=fingerprint,
        encode_device=str(device).split(":")[0],
        image_encoder=args.image_encoder,
        image_processor=args.image_processor,
        text_encoder=args.text_encoder,
        text_max_seq_length=args.text_max_seq_length,
        factory=args.factory,
        shard_size=args.shard_size,
        batch_size=args.batch_size,
        text_batch_size=_text_batch(args),
        text_template=args.text_template,
        trust_remote_code=args.trust_remote_code,
        summaries=file_fingerprint(args.summaries) if args.summaries else None,
        images_root=str(Path(args.images_root or Path(args.kb).parent).resolve()),
    )


# a finished index is reused whatever these were (its images may have moved; it may be used on another device)
IDENTITY_IGNORES = ("shard_size", "batch_size", "text_batch_size", "images_root", "encode_device")
ASSEMBLY_ONLY = ("factory",)  # no shard depends on it: a partial build resumes under another (assembly uses the new)


def _text_batch(args: BuildArgs) -> int:
    return args.text_batch_size or args.batch_size


def validate(args: BuildArgs) -> None:
    """Check every setting before any model loads."""
    require_file(args.kb, "kb")
    if not args.out:
        raise ValueError("--out: an index directory is required")
    check_k(args.shard_size, "shard_size")
    check_k(args.batch_size, "batch_size")
    if args.text_batch_size is not None:
        check_k(args.text_batch_size, "text_batch_size")
    if args.text_max_seq_length is not None:
        check_k(args.text_max_seq_length, "text_max_seq_length")
    if args.workers is not None and (not isinstance(args.workers, int) or args.workers < 0):
        raise ValueError(f"workers must be a non-negative integer, got {args.workers!r}")
    try:  # the fields a KB entry fills (retrieval.kb.entry_text); a typo was a bare KeyError out of the KB scan
        entry_text({}, args.text_template)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"--text_template {args.text_template!r}: it may use {{title}}, {{section_title}} and {{text}} "
            f"({type(e).__name__}: {e})"
        ) from None
    if args.image_processor and not args.image_encoder.startswith("hf:"):
        raise ValueError(f"--image_processor applies to hf: image encoders only, not {args.image_encoder!r}")
    if args.summaries:
        require_file(args.summaries, "summaries")
    check_factory(args.factory)
    check_image_encoder_name(args.image_encoder)
    check_text_encoder_name(args.text_encoder)
    root = Path(args.images_root or Path(args.kb).parent)
    if not root.is_dir():
        raise ValueError(f"--images_root: folder {root} does not exist")
    if args.overwrite:
        check_overwritable(Path(args.out), {"kb": args.kb, "images_root": root, "summaries": args.summaries})


def index_files(out: Path) -> tuple[Path, Path]:
    """An index folder's manifest, and the settings record of a partial build in it."""
    return out / MANIFEST_FILE, out / "build" / "state.json"


def check_overwritable(out: Path, inputs: dict) -> None:
    """``--overwrite`` deletes ``out`` whole: a ValueError naming it unless it is absent, empty or an index folder
    (a manifest, a partial build's folder of shards, the FAISS index or its rows: what a delete cut short leaves is
    one too), and holds none of the build's ``inputs`` ({flag: path})."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file, not an index folder: --overwrite would delete it")
    for flag, value in inputs.items():
        if value and out.resolve() in (Path(value).resolve(), *Path(value).resolve().parents):
            raise ValueError(f"--out {out} holds --{flag} {value}: --overwrite would delete it; give another --out")
    marks = (*index_files(out), out / INDEX_FILE, out / ROWS_FILE)
    if any(out.iterdir()) and not (any(f.is_file() for f in marks) or is_build_folder(out / "build")):
        raise ValueError(
            f"--out {out} holds files but no index ({MANIFEST_FILE}, build/, {INDEX_FILE} or {ROWS_FILE}): "
            "--overwrite would delete the whole folder; give an index folder, or a new or empty one"
        )


# --------------------------------------------------------------------------- the build


def build_index(args: BuildArgs, log=print, encoders=None, state=None) -> dict | None:
    """Build (or resume, or reuse) the index described by ``args``; returns the manifest (None on processes other
    than the first of a multi-process build, which leave the assembly to it).

    ``encoders``: an already-built (image, text) encoder pair whose names match ``args`` (saves a reload).
    ``state``: an accelerate ``PartialState`` of a multi-process build (None: this process builds alone).
    """
    procs = Processes(state)
    validate(args)
    out, kb = Path(args.out), Path(args.kb)
    if args.overwrite:  # every process has checked the folder (validate) before process 0 deletes it
        procs.barrier(f"each process checked --out {out} before process 0 deletes it")
    if args.overwrite and out.exists() and procs.rank == 0:
        shutil.rmtree(out)
    procs.barrier(f"process 0 deleted --out {out}" if args.overwrite else f"each process started the build of {out}")
    root = Path(args.images_root or kb.parent)
    scan = scan_kb(kb, args.text_template)
    if scan.rows == 0:
        raise ValueError(f"--kb: {kb} has no rows")
    device = job_device(args.device, state)
    settings = _settings(args, file_fingerprint(kb), device)
    build_dir = out / "build"
    manifest_path, state_path = index_files(out)
    if manifest_path.exists():
        manifest = read_json(manifest_path)
        built = manifest.get("build", manifest)
        if all(built.get(k) == v for k, v in settings.items() if k not in IDENTITY_IGNORES):
            log(f"index in {out} is already built from this KB with these settings; nothing to do")
            if manifest.get("query_instruction_setting", "auto") != args.query_instruction and procs.rank == 0:
                manifest = _change_query_instruction(manifest_path, manifest, args, log)
            return manifest
        raise ValueError(
            f"{out} holds an index built with other settings or another KB; "
            "pass --overwrite to replace it or choose another --out"
        )
    if state_path.exists():
        previous = read_json(state_path)
        # a setting the partial build did not record (an older version) is not held against it
        diff = sorted(k for k in settings if k in previous and previous[k] != settings[k] and k not in ASSEMBLY_ONLY)
        if diff:
            raise ValueError(
                f"{build_dir} holds a partial build with different {', '.join(diff) or 'settings'}; "
                "pass --overwrite to start again"
            )
    if (
        procs.rank == 0
    ):  # before any shard exists: shards are only ever read back under the settings they were made with
        build_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(state_path, settings)
    items = work_items(scan, args.shard_size)
    pending = [(kind, i) for kind, i in items if not shard_paths(build_dir, kind, i)[1].exists()]
    procs.barrier(f"each process listed the shards to do in {build_dir}")  # the same list, before any is written
    if len(pending) < len(items) and procs.rank == 0:
        log(f"resuming the partial build in {build_dir}: {len(items) - len(pending)} of {len(items)} shards done")
    mine = pending[procs.rank :: procs.count]

    threads = configure_threads()
    workers = decode_workers(args.workers)
    my_text = [i for kind, i in mine if kind == "text"]
    my_images = [i for kind, i in mine if kind == "image"]
    log(
        f"process {procs.rank}/{procs.count} on {device}: {scan.rows:,} KB rows, {scan.texts:,} distinct texts "
        f"({len(scan.problems):,} rows without text or entity); {len(pending)} of {len(items)} shards to do, "
        f"mine: {len(my_text)} text + {len(my_images)} image shards; {workers} decoding workers, {threads} threads"
    )
    t0 = time.time()
    img_enc = txt_enc = None
    if encoders is not None:
        img_enc, txt_enc = encoders
        if (img_enc.name, txt_enc.name) != (args.image_encoder, args.text_encoder):
            raise ValueError(
                f"encoders {img_enc.name!r}/{txt_enc.name!r} given for a build that names "
                f"{args.image_encoder!r}/{args.text_encoder!r}"
            )

        if txt_enc.query_prompt != resolve_query_prompt(args.query_instruction, txt_enc.model.prompts):
            raise ValueError(
                f"the text encoder given has query instruction {txt_enc.query_prompt!r}; the build "
                f"asks for {args.query_instruction!r}"
            )
    if my_text:
        if txt_enc is None:
            txt_enc = text_encoder(
                args.text_encoder,
                device=device,
                batch_size=_text_batch(args),
                query_prompt=args.query_instruction,
                trust_remote_code=args.trust_remote_code,
                max_seq_length=args.text_max_seq_length,
            )
        for j in tqdm(my_text, desc="encoding texts", unit="shard"):
            encode_text_shard(j, scan, txt_enc, args, build_dir)
    if my_images:
        if img_enc is None:
            img_enc = image_encoder(
                args.image_encoder,
                device=device,
                batch_size=args.batch_size,
                image_processor=args.image_processor,
                trust_remote_code=args.trust_remote_code,
            )
        waits = encode_image_shards(my_images, scan, root, img_enc, args, build_dir, workers)
        log(
            f"process {procs.rank}: images encoded in {waits.total:.1f}s, the encoder waited for decoded "
            f"images {100 * waits.share:.0f}% of it "
            f"({workers} decoding workers)"
        )
    procs.barrier(f"each process encoded its shards into {build_dir}")
    if procs.rank != 0:
        log(f"process {procs.rank}: my shards are done; process 0 assembles the index")
        return None
    missing = [f"{kind}-{i:06d}" for kind, i in items if not shard_paths(build_dir, kind, i)[1].exists()]
    if missing:
        raise ValueError(
            f"{len(missing)} shard(s) are missing after every process finished ({', '.join(missing[:5])}"
            f"…); start the build again to encode them"
        )
    manifest = assemble(out, build_dir, scan, items, settings, args, log)
    shutil.rmtree(build_dir, ignore_errors=True)
    log(
        f"built {out}: {manifest['rows']} rows, {manifest['entities']} entities, {manifest['skipped']} skipped, "
        f"{manifest['texts_encoded']:,} texts encoded for {manifest['text_rows']:,} rows, {time.time() - t0:.1f}s"
    )
    return manifest


def _change_query_instruction(manifest_path: Path, manifest: dict, args: BuildArgs, log) -> dict:
    """A query-time setting: KB rows never carry the instruction, so changing it rewrites the manifest only."""
    resolved = query_instruction_of(args.text_encoder, args.query_instruction, args.trust_remote_code)
    log(
        f"query instruction: {manifest.get('query_instruction')!r} → {resolved!r} (no vector changes: KB rows "
        "never carry it)"
    )
    manifest = {**manifest, "query_instruction": resolved, "query_instruction_setting": args.query_instruction}
    write_json_atomic(manifest_path, manifest)
    return manifest


def main(argv=None) -> None:
    (args,) = parse((BuildArgs,), argv, description=__doc__)
    validate(args)
    build_index(args, state=process_state(args.device, args.dist_timeout_minutes))


if __name__ == "__main__":
    from common.cli import run

    run(main)
