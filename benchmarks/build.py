"""Index build: rows/s, peak memory and the encoder's wait for decoded images, against DataLoader decoding workers
and build processes; peak memory against KB size; text encodings saved by section dedup.

Synthetic KBs in the canonical format, written to a temp dir: each article's section is paired with ``--per-section``
images (as E-VQA pairs every image of an article with one of its sections), texts are toy-world sections made longer,
images are distinct JPEG photos of ``--photo`` pixels (noise over gradients, so decoding costs what a real photo
costs). Every build runs in fresh processes (``python -m retrieval.build_index``, or ``torchrun --nproc_per_node 2
retrieval/build_index.py`` — `accelerate launch --cpu` starts one process only); each build process reports its own
peak RSS (``ru_maxrss``) and the peak of its decoding workers (``RUSAGE_CHILDREN``).

    .venv/bin/python benchmarks/build.py [--rows 1200] [--sizes 10000,50000,200000] [--image-models tiny,ViT-S-32]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
from common.files import read_json
from toy.world import make_entities, sections

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--rows", type=int, default=1200, help="KB rows for the workers × processes table")
parser.add_argument("--sizes", default="10000,50000,200000", help="KB rows for the memory table (tiny encoders)")
parser.add_argument("--image-models", default="tiny,ViT-S-32", help="open_clip image models for the first table")
parser.add_argument("--photo", default="800x600", help="size of the synthetic JPEG photos")
parser.add_argument("--pool", type=int, default=300, help="distinct photos")
parser.add_argument("--per-section", type=int, default=3, help="images paired with each section")
parser.add_argument("--shard-size", type=int, default=256)
parser.add_argument("--tables", default="1,2,3", help="which tables to measure")
parser.add_argument("--batch-size", type=int, default=32)
args = parser.parse_args()

tmp = Path(tempfile.mkdtemp(prefix="bench-build-"))
env = dict(
    os.environ,
    REFINE_RL_CACHE=os.environ.get("REFINE_RL_CACHE") or str(tmp / "cache"),
    PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    OMP_NUM_THREADS="1",
    TOKENIZERS_PARALLELISM="false",
)
CHILD = tmp / "child.py"
CHILD.write_text("""
import json, resource, sys
from retrieval.build_index import main
main(sys.argv[1:])
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print("RESULT " + json.dumps({"peak": me.ru_maxrss * 1024, "workers_peak": kids.ru_maxrss * 1024}), flush=True)
""")


def build(
    kb: Path,
    out: Path,
    image_model: str,
    text_model: str,
    workers: int,
    processes: int,
    images_root: Path,
):
    argv = [
        "--kb",
        str(kb),
        "--images_root",
        str(images_root),
        "--out",
        str(out),
        "--image_encoder",
        image_model,
        "--text_encoder",
        text_model,
        "--shard_size",
        str(args.shard_size),
        "--batch_size",
        str(args.batch_size),
        "--workers",
        str(workers),
        "--device",
        "cpu",
        "--overwrite",
        "true",
    ]
    if processes == 1:
        cmd = [sys.executable, str(CHILD), *argv]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_port",
            str(29500 + os.getpid() % 1000),
            str(CHILD),
            *argv,
        ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = p.stdout + p.stderr
    if p.returncode != 0:
        sys.exit(f"build failed ({p.returncode}):\n{log[-5000:]}")
    results = [json.loads(x[len("RESULT ") :]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    manifest = read_json(out / "manifest.json")
    waits = [int(w) for w in re.findall(r"encoder waited for decoded images (\d+)%", log)]
    encode_s = [float(s) for s in re.findall(r"images encoded in ([0-9.]+)s", log)]
    built_s = float(re.search(r"texts encoded for [0-9,]+ rows, ([0-9.]+)s", log).group(1))
    return dict(
        wall=wall,
        built_s=built_s,
        manifest=manifest,
        peak=max(r["peak"] for r in results),
        workers_peak=max(r["workers_peak"] for r in results),
        wait=max(waits) if waits else 0,
        image_s=max(encode_s) if encode_s else 0.0,
    )


# ------------------------------------------------------------------ synthetic KB
entities = make_entities(192, seed=0)
rng = np.random.default_rng(1)
w, h = (int(x) for x in args.photo.split("x"))
(tmp / "photos").mkdir()
from PIL import Image

yy, xx = np.mgrid[0:h, 0:w]
for i in range(args.pool):
    base = np.stack([(xx * (i % 7 + 1) + yy) % 256, (yy * (i % 5 + 1)) % 256, (xx + yy * (i % 3 + 1)) % 256], -1)
    img = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(img).save(tmp / "photos" / f"p{i:04d}.jpg", quality=90)
(tmp / "small").mkdir()
for i in range(args.pool):
    Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(tmp / "small" / f"s{i:04d}.png")


def write_kb(n: int, folder: str, ext: str) -> Path:
    """n rows; each (article, section) pair has ``per_section`` images; ~1,000-character sections."""
    kb = tmp / f"kb-{n}-{folder}.jsonl"
    with open(kb, "w", encoding="utf-8") as f:
        for j in range(n):
            s = j // args.per_section  # the section this row's image belongs to
            e = entities[s % len(entities)]
            title, text = sections(e)[s % 2]
            text = f"{text} " + " ".join(f"Article {s // 2}, paragraph {p}: {text}" for p in range(6))
            f.write(
                json.dumps(
                    dict(
                        entry_id=f"R{j:08d}",
                        entity_id=f"K{s // 2:07d}",
                        title=f"{e['name']} {s // 2}",
                        section_title=title,
                        text=text,
                        image=f"{folder}/{'p' if ext == 'jpg' else 's'}{j % args.pool:04d}.{ext}",
                    )
                )
                + "\n"
            )
    return kb


print("load average at start: %.2f %.2f %.2f (other work on the machine skews the timings)" % os.getloadavg())
print(
    f"temp dir {tmp}; {os.cpu_count()} CPUs; photos {args.photo} JPEG; {args.per_section} images per section",
    flush=True,
)

# ------------------------------------------------------------------ table 1: workers × processes
tables = {int(t) for t in args.tables.split(",")}
kb = write_kb(args.rows, "photos", "jpg")
table1 = []
build(kb, tmp / "warm", "tiny", "minilm", 0, 1, tmp)  # warm-up: tiny text model cache, page cache
for model in args.image_models.split(",") if 1 in tables else []:
    for processes in (1, 2):
        for workers in (0, 1, 2):
            r = build(kb, tmp / "idx", model, "minilm", workers, processes, tmp)
            table1.append(dict(model=model, processes=processes, workers=workers, **r))
            print(f"  {model}, {processes} process(es), {workers} workers: {r['built_s']:.1f}s", flush=True)

# ------------------------------------------------------------------ table 2: memory against KB size
table2 = []
for n in [int(x) for x in args.sizes.split(",")] if 2 in tables else []:
    kb_n = write_kb(n, "small", "png")
    r = build(kb_n, tmp / "idx-size", "tiny", "tiny", 1, 1, tmp)
    table2.append(dict(n=n, kb_mb=kb_n.stat().st_size / 2**20, **r))
    print(f"  {n:,} rows: {r['built_s']:.1f}s", flush=True)
    kb_n.unlink()

# ------------------------------------------------------------------ table 3: decoding cost per image, one core
import open_clip
import torch

from retrieval.image_data import pixels

torch.set_num_threads(1)
_, _, preprocess = open_clip.create_model_and_transforms("ViT-S-32", pretrained=None)  # 224 px, as EVA-CLIP-8B's
table3 = []
for size in (args.photo, "2048x1536") if 3 in tables else []:
    pw, ph = (int(x) for x in size.split("x"))
    folder = tmp / f"decode-{size}"
    folder.mkdir()
    yy2, xx2 = np.mgrid[0:ph, 0:pw]
    paths = []
    for i in range(20):
        base = np.stack([(xx2 * (i + 1) + yy2) % 256, (yy2 * (i + 2)) % 256, (xx2 + yy2) % 256], -1)
        img = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(folder / f"{i}.jpg", quality=90)
        paths.append(folder / f"{i}.jpg")
    pixels(paths[0], preprocess)
    t0 = time.perf_counter()
    for _ in range(3):
        for path in paths:
            pixels(path, preprocess)
    per = (time.perf_counter() - t0) / (3 * len(paths))
    table3.append((size, sum(f.stat().st_size for f in paths) / len(paths) / 1e3, per))

print("load average at end:   %.2f %.2f %.2f" % os.getloadavg())
if table1:
    m = table1[0]["manifest"]
    print(
        f"\nTable 1: {args.rows:,} KB rows ({m['texts_encoded']:,} distinct sections), {args.photo} JPEGs, text: "
        f"the real all-MiniLM-L6-v2; batch {args.batch_size}, shard {args.shard_size}; time = the build's own timer "
        "(models load, encode, assemble); encoder wait = share of the image loop spent waiting for decoded batches "
        "(the largest over processes); peak RSS = the largest build process / the largest decoding worker"
    )
    print(
        "\n| image model | processes | decoding workers each | build s | rows/s | image loop s | encoder waits "
        "| peak RSS MB (process / worker) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in table1:
        print(
            f"| {r['model']} | {r['processes']} | {r['workers']} | {r['built_s']:.1f} | {args.rows / r['built_s']:.0f} "
            f"| {r['image_s']:.1f} | {r['wait']}% | {r['peak'] / 2**20:.0f} / {r['workers_peak'] / 2**20:.0f} |"
        )
    print(
        f"\nSection dedup: {m['text_rows']:,} rows share {m['texts_encoded']:,} distinct section texts "
        f"({m['text_rows'] / max(m['texts_encoded'], 1):.1f} rows per text): {m['text_rows'] - m['texts_encoded']:,} "
        f"text encodings saved ({100 * (1 - m['texts_encoded'] / m['text_rows']):.0f} %)"
    )
if table2:
    print(
        "\nTable 2: peak memory against KB size (tiny encoders, 56 px PNGs, 1 process, 1 decoding worker); index MB "
        "= rows × dim × 4 bytes (what the assembled Flat index holds)"
    )
    print(
        "\n| KB rows | KB file MB | distinct texts | build s | rows/s | peak RSS MB (process) | peak RSS MB (worker) "
        "| index MB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in table2:
        mm = r["manifest"]
        print(
            f"| {r['n']:,} | {r['kb_mb']:.0f} | {mm['texts_encoded']:,} | {r['built_s']:.1f} | "
            f"{r['n'] / r['built_s']:.0f} | {r['peak'] / 2**20:.0f} | {r['workers_peak'] / 2**20:.0f} | "
            f"{mm['rows'] * mm['dim'] * 4 / 2**20:.1f} |"
        )
if table3:
    print(
        "\nTable 3: decoding + preprocessing one image on one core (PIL decode, open_clip 224 px transform: resize, "
        "centre crop, normalise), the work each DataLoader worker does per row"
    )
    print("\n| photo | JPEG KB | ms per image | images/s per core |")
    print("|---|---:|---:|---:|")
    for size, kb_size, per in table3:
        print(f"| {size} | {kb_size:.0f} | {1000 * per:.1f} | {1 / per:.0f} |")
shutil.rmtree(tmp, ignore_errors=True)
