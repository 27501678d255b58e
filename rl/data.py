"""RL data: question datasets for TRL, and hit-rank stratified sampling of the RL training set.

    [accelerate launch --num_processes N -m] python -m rl.data --queries train.jsonl --index DIR --alpha A \
        --strata "1-5:500,6-10:1000,11-20:1000,21-200:2500,miss:2000" --out rl_train.jsonl [--seed 0]

Runs baseline retrieval with the original question (split over the processes, images decoded by DataLoader workers,
resumable from ``<out>.baseline.jsonl``), buckets questions by the gold entity's rank, samples each bucket (seeded),
writes the sample with ``baseline_rank``, prints and plots the bucket histogram, and stores the sampled questions'
image embeddings beside ``<out>`` for the trainer (rl.image_embeddings). ``--eval_out`` also writes (and embeds)
``--eval_questions`` questions that the sample does not hold, for checkpoint selection. A bucket with too few
questions is filled as far as possible and reported. A question whose gold entity is not in the index (it would
otherwise be rewarded as a permanent miss) or whose image is missing or unreadable is left out and listed in
``<out>.skipped.jsonl``. A question file with duplicate ids is refused.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from common.cli import parse, require_file
from common.files import check_unique_ids, pyplot, read_jsonl, save_figure, write_json_atomic, write_jsonl_atomic
from common.job_parts import JobParts
from common.placement import Processes, decode_workers, dist_timeout_field, job_device, process_state
from retrieval.index import MultimodalIndex, require_index
from retrieval.kb import GOLD_KEYS, downscaled_jpeg, load_image
from retrieval.ranking import check_alpha, check_k
from rl.image_budget import aspect_problem
from rl.image_embeddings import embed_images, image_path_of
from rl.prompts import prompt_messages, prompt_spec
from rl.strata import held_out_sample, parse_strata, stratified_sample

NOT_IN_INDEX = "gold entity not in the index"


def verify_images(rows: list[dict], root: Path, limit: int | None = None) -> tuple[list[dict], list[dict]]:
    """(usable rows with ``image_path`` added, at most ``limit`` of them; bad ones as {id, image, reason})."""
    good, bad = [], []
    for rec in tqdm(rows, desc="verifying images", total=min(limit or len(rows), len(rows))):
        path = image_path_of(rec, root)
        image, reason = load_image(path)
        reason = reason or aspect_problem(image.size)
        if reason:
            bad.append({"id": str(rec.get("id")), "image": rec.get("image"), "reason": reason})
        else:
            good.append({**rec, "image_path": path})
        if limit and len(good) >= limit:
            break
    return good, bad


def question_dataset(
    path: str | Path,
    images_root: str | Path | None = None,
    prompt: str = "wikiseeker",
    limit: int | None = None,
    bad_images_dir: str | Path | None = None,
    log=print,
):
    """Question JSONL → a TRL-ready ``datasets.Dataset``: conversational ``prompt`` plus ``image`` and the columns
    the rewards read (``id``, ``entity_id``, ``question``, ``image_path`` = the absolute image path string).

    Duplicate ids are refused. Every image is decoded once; a question whose image is missing, unreadable or corrupt
    is left out, counted in one printed line and, when ``bad_images_dir`` is given, listed (id, image, reason) in
    ``<bad_images_dir>/<file stem>.bad_images.jsonl``. ``limit`` keeps the first ``limit`` usable questions. An image
    past PIL's pixel limit, which the ``image`` column could not decode from its path, goes in as the downscaled
    picture everything else reads (``retrieval.kb.load_image``).
    """
    from datasets import Dataset
    from datasets import Image as ImageColumn

    path = Path(path)
    root = Path(images_root or path.parent)
    records = list(read_jsonl(path, GOLD_KEYS))
    check_unique_ids(records, path)
    good, bad = verify_images(records, root, limit)
    if bad_images_dir is not None:
        write_jsonl_atomic(Path(bad_images_dir) / f"{path.stem}.bad_images.jsonl", bad)
    if bad:
        where = f", listed in {Path(bad_images_dir) / f'{path.stem}.bad_images.jsonl'}" if bad_images_dir else ""
        log(f"{path}: left out {len(bad)} question(s) whose image is missing or unreadable{where}")
    if not good:
        raise ValueError(f"{path} holds no question with a usable image" + (f" ({len(bad)} bad)" if bad else ""))
    spec = prompt_spec(prompt)  # a prompt file is read once
    rows = [
        {
            "prompt": prompt_messages(rec["question"], spec),
            "image": image_column_value(rec["image_path"]),
            "id": str(rec["id"]),
            "entity_id": str(rec["entity_id"]),
            "question": rec["question"],
            "image_path": rec["image_path"],
        }
        for rec in good
    ]
    return Dataset.from_list(rows).cast_column("image", ImageColumn())


PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "I;16")  # the modes PIL writes as PNG


def image_column_value(path: str) -> dict:
    """A ``datasets`` Image value: the file's path; for an image past PIL's pixel limit (which the column's plain
    ``PIL.Image.open`` refuses, at any step of training), the downscaled picture ``load_image`` gives, as JPEG; for
    one in a mode no PNG holds (a CMYK or YCbCr JPEG, a 32-bit TIFF), ``load_image``'s RGB picture as PNG. TRL's vLLM
    client sends each question image to a vLLM server as a PNG (``pil_to_base64``), which fails for such a mode and
    ends the run; the processor and colocated vLLM convert it to these same RGB pixels themselves."""
    try:
        with Image.open(path) as image:
            if image.mode in PNG_MODES:
                return {"path": path, "bytes": None}
    except Image.DecompressionBombError:
        return {"path": None, "bytes": downscaled_jpeg(path)}
    image, why = load_image(path)
    if image is None:
        raise ValueError(why)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"path": None, "bytes": buffer.getvalue()}


def warn_absent_entities(index, data, name: str) -> None:
    """Questions whose gold entity is not in the index can only miss (constant reward, no gradient): say so."""
    absent = sorted({e for e in data["entity_id"] if not index.has_entity(e)})
    if absent:
        shown = ", ".join(absent[:5]) + (" …" if len(absent) > 5 else "")
        print(
            f"warning: {name}: {len(absent)} gold entities are not in the index (their questions always miss): "
            f"{shown}; python -m rl.data drops such questions"
        )


# --------------------------------------------------------------------------- stratified RL data


@dataclass
class RLDataArgs:
    queries: str = field(default=None, metadata={"help": "question JSONL"})
    index: str = field(default=None, metadata={"help": "index directory"})
    alpha: float = field(default=None, metadata={"help": "image weight α"})
    strata: str = field(
        default="1-5:500,6-10:1000,11-20:1000,21-200:2500,miss:2000",
        metadata={"help": "bucket:count list; buckets are lo-hi rank ranges or 'miss'"},
    )
    out: str = field(default=None, metadata={"help": "RL training JSONL to write"})
    images_root: str = field(default=None, metadata={"help": "default: the queries file's folder"})
    depth: int = field(default=200, metadata={"help": "rank depth (deeper = miss)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    batch_size: int = field(default=256, metadata={"help": "questions per retrieval batch"})
    workers: int = field(
        default=None,
        metadata={"help": "DataLoader processes decoding images (default: usable cores ÷ processes on this node)"},
    )
    embed_images: bool = field(
        default=True,
        metadata={
            "help": "store the sampled questions' image embeddings beside --out (rl.image_embeddings), for the trainer"
        },
    )
    device: str = field(default=None, metadata={"help": "cuda / cuda:N / cpu (default: this process's own)"})
    eval_out: str = field(
        default=None,
        metadata={
            "help": "also write --eval_questions questions that --out does not hold, for the trainer's checkpoint "
            "selection (eval_file): where a benchmark reports on its val split (InfoSeek), checkpoints must not be "
            "chosen on it"
        },
    )
    eval_questions: int = field(default=512, metadata={"help": "questions in --eval_out (seeded)"})
    dist_timeout_minutes: int = dist_timeout_field()


def image_size(path) -> tuple[int, int]:
    """An image file's (width, height) from its header; past PIL's pixel limit, that of the downscaled picture
    ``load_image`` gives, whose aspect ``verify_images`` checks in training ((1, 1) if it does not load)."""
    try:
        with Image.open(path) as image:
            return image.size
    except Image.DecompressionBombError:
        image, _ = load_image(path)
        return image.size if image is not None else (1, 1)


def skip_record(rec: dict, reason: str) -> dict:
    return {"id": str(rec.get("id")), "entity_id": rec.get("entity_id"), "image": rec.get("image"), "reason": reason}


def baseline_ranks(
    index, rows: list[dict], root: Path, args: RLDataArgs, state=None, log=print
) -> tuple[list[dict], list, list[dict]]:
    """Rank each question's gold entity with the original question: (ranked rows, their ranks, skip records for
    questions whose image is missing or unreadable).

    The questions are split over the processes of ``state`` in batches (common.job_parts): each decodes its
    images with DataLoader workers, embeds them and the questions, ranks, and appends ``{id, rank}`` (or ``{id,
    problem}``) to its part of ``<out>.baseline.jsonl``; an interrupted run goes on from that file. Every process
    returns the whole result."""
    parts = JobParts(Path(f"{args.out}.baseline.jsonl"), state)
    settings = {
        "queries": str(Path(args.queries).resolve()),
        "index": str(Path(args.index).resolve()),
        "alpha": args.alpha,
        "depth": args.depth,
    }
    parts.same_settings(settings)  # <out>.baseline.settings.json
    batches = parts.start(rows, args.batch_size)
    log(f"baseline retrieval, {parts.status}")
    workers = decode_workers(args.workers)
    with tqdm(total=parts.mine, desc="baseline retrieval", unit="q", disable=not parts.mine) as bar:
        for batch in batches:
            paths = [root / str(r.get("image")) for r in batch]
            emb, failed = index.encode_image_files(paths, workers)
            encoded = [j for j in range(len(batch)) if j not in failed]  # emb's rows, in order
            # the index's encoder reads an image past 200:1, the refiner's processor does not: training drops it
            thin = {j: why for j in encoded if (why := aspect_problem(image_size(paths[j])))}
            if thin:
                emb, failed = emb[[k for k, j in enumerate(encoded) if j not in thin]], {**failed, **thin}
            ok = [r for j, r in enumerate(batch) if j not in failed]
            ranks = (
                index.entity_ranks(
                    emb,
                    [r["question"] for r in ok],
                    [str(r["entity_id"]) for r in ok],
                    alpha=args.alpha,
                    depth=args.depth,
                )
                if ok
                else []
            )
            found = dict(zip((str(r["id"]) for r in ok), ranks))
            parts.append(
                [
                    {"id": str(r["id"]), "problem": failed[j]}
                    if j in failed
                    else {"id": str(r["id"]), "rank": found[str(r["id"])]}
                    for j, r in enumerate(batch)
                ]
            )
            bar.update(len(batch))
    parts.finish(rows)
    parts.barrier("process 0 merged the baseline ranks")
    done = {str(rec["id"]): rec for rec in read_jsonl(parts.out)} if parts.out.exists() else {}
    kept, ranks, skipped = [], [], []
    for rec in rows:
        res = done[str(rec["id"])]
        if "problem" in res:
            skipped.append(skip_record(rec, res["problem"]))
        else:
            kept.append(rec)
            ranks.append(res["rank"])
    return kept, ranks, skipped


def build_rl_data(args: RLDataArgs, log=print, state=None) -> dict:
    """The RL training file, its skip list, bucket report and plot (process 0), and the sampled questions' image
    embeddings (rl.image_embeddings; every process takes part). With ``state`` of N processes the baseline retrieval
    and the embedding are split over them."""
    require_file(args.queries, "queries")
    require_index(args.index)
    if args.alpha is None:
        raise ValueError("--alpha is required")
    check_alpha(args.alpha)
    if not args.out:
        raise ValueError("--out is required")
    if args.eval_out and (args.eval_questions <= 0 or Path(args.eval_out).resolve() == Path(args.out).resolve()):
        raise ValueError("--eval_out needs --eval_questions > 0 and a file other than --out")
    check_k(args.depth, "--depth")  # before the index loads and the baseline's settings are recorded
    strata = parse_strata(args.strata)
    deepest = max((hi for _, _, hi, _ in strata if hi is not None), default=0)
    if deepest > args.depth:  # ranks past depth come back as misses: that bucket would be filled from misses' place
        raise ValueError(f"--strata: a bucket reaches rank {deepest}, deeper than --depth {args.depth}")
    root = Path(args.images_root or Path(args.queries).parent)
    rows = list(read_jsonl(args.queries, GOLD_KEYS))
    check_unique_ids(rows, args.queries)
    index = MultimodalIndex.load(args.index, device=job_device(args.device, state))
    known, skipped = [], []
    for rec in rows:
        if isinstance(rec.get("entity_id"), list):
            skipped.append(skip_record(rec, "2-hop question (one gold entity per hop; the reward ranks one)"))
        elif index.has_entity(str(rec.get("entity_id"))):
            known.append(rec)
        else:
            skipped.append(skip_record(rec, NOT_IN_INDEX))
    kept, ranks, bad_images = baseline_ranks(index, known, root, args, state, log)
    skipped += bad_images
    main = Processes(state).rank == 0
    skipped_path = f"{args.out}.skipped.jsonl"
    if main:
        write_jsonl_atomic(skipped_path, skipped)
        if skipped:
            log(
                f"left out {len(skipped)} of {len(rows)} question(s) ({len(skipped) - len(bad_images)} with the "
                f"{NOT_IN_INDEX} or 2-hop, {len(bad_images)} with a missing or unreadable image), listed in "
                f"{skipped_path}"
            )
    if not kept:
        raise ValueError(f"{args.queries}: no question is usable (all {len(rows)} listed in {skipped_path})")
    chosen, report = stratified_sample(ranks, strata, args.seed)
    images = [str(r["image"]) for r in kept]
    held_out = held_out_sample(len(kept), chosen, args.eval_questions, args.seed, images) if args.eval_out else []
    summary = {
        "alpha": args.alpha,
        "depth": args.depth,
        "seed": args.seed,
        "buckets": report,
        "questions": len(rows),
        "skipped": len(skipped),
        "sampled": len(chosen),
        "held_out": len(held_out),
    }
    if main:
        write_jsonl_atomic(args.out, ({**kept[i], "baseline_rank": ranks[i]} for i in chosen))
        for name, rep in report.items():
            note = "" if rep["taken"] == rep["wanted"] else f"   (only {rep['available']} available)"
            log(f"{name:>8}: {rep['taken']:6d} of {rep['wanted']:6d}{note}")
        log(f"wrote {len(chosen)} questions to {args.out}")
        if args.eval_out:
            write_jsonl_atomic(args.eval_out, ({**kept[i], "baseline_rank": ranks[i]} for i in held_out))
            short = "" if len(held_out) == args.eval_questions else f" (of {args.eval_questions} asked: no more left)"
            log(
                f"wrote {len(held_out)} held-out questions{short}, none of them in {args.out} nor about an image "
                f"it holds (their gold entities may be trained on), to {args.eval_out}"
            )
        write_json_atomic(f"{args.out}.buckets.json", summary)
        _plot(report, f"{args.out}.buckets.png")
    if args.embed_images:
        for out, picked in ((args.out, chosen), (args.eval_out, held_out)) if args.eval_out else ((args.out, chosen),):
            images = [kept[i]["image"] for i in picked]
            embed_images(out, images, root, index, state, args.batch_size, decode_workers(args.workers), log)
    if main:  # the resumable record of the retrieval, no longer needed
        Path(f"{args.out}.baseline.jsonl").unlink(missing_ok=True)
        Path(f"{args.out}.baseline.settings.json").unlink(missing_ok=True)
    return summary


def _plot(report: dict, path: str) -> None:
    plt = pyplot()

    names = list(report)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [report[n]["available"] for n in names], color="#cccccc", label="available")
    ax.bar(names, [report[n]["taken"] for n in names], color="#3b75af", label="sampled")
    ax.set_xlabel("baseline rank bucket")
    ax.set_ylabel("questions")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv=None) -> None:
    (args,) = parse((RLDataArgs,), argv, description=__doc__)
    state = process_state(args.device, args.dist_timeout_minutes)
    build_rl_data(args, state=state)  # process 0 writes and reports; each process says what it takes


if __name__ == "__main__":
    from common.cli import run

    run(main)
