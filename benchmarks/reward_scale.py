"""The GRPO reward's ranking step at real width: 2,048-d rows (1,024 image + 1,024 text, the paper's EVA-CLIP +
Qwen3-Embedding), N rows with several rows per entity (1–8, and one entity of 5,000 rows: what breaks a k-capped
loop), one step's 160 queries at depth 200.

Per N: ms per step and achieved GFLOP/s (2·N·d·queries / time) for
  (a) FAISS Flat top-k + growing depth (``rank_method="search"``),
  (b) exact ranks: matmul + segment max over every row (``rank_method="exact"``, rows a zero-copy view of the
      memory-mapped index file),
  (c) IVF (``IVF{nlist},Flat``, nprobe 32) + growing depth, with its agreement with the exact ranks,
beside the machine's sgemm peak; the ranks of (a) and (b) are compared (they must agree). Then the peak memory of one
process ranking on the memory-mapped index, and of two processes sharing it (RSS vs PSS from /proc/<pid>/smaps_rollup:
the index pages are shared through the page cache). Ends with an estimate for 2 M rows on one H100 (not measured).

    .venv/bin/python benchmarks/reward_scale.py [--sizes 100000,500000,1000000] [--repeats 3] [--skip-ivf]

Memory: 1 M × 2,048 float32 = 8.2 GB, built chunk by chunk, written, then only memory-mapped.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from timing import best_time

from common.faiss_lib import faiss
from common.files import read_json
from common.placement import configure_threads, usable_cores
from retrieval.faiss_build import build_faiss_index_from_chunks, read_faiss
from retrieval.index import MultimodalIndex

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--sizes", default="100000,500000,1000000")
parser.add_argument("--dim", type=int, default=2048)
parser.add_argument("--queries", type=int, default=160)
parser.add_argument("--depth", type=int, default=200)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--skip-ivf", action="store_true")
parser.add_argument("--workdir", default=None)
parser.add_argument("--threads", type=int, default=None)
parser.add_argument("--child", nargs=3, metavar=("INDEX", "N", "OUT"), help=argparse.SUPPRESS)
args = parser.parse_args()
D, Q, ALPHA = args.dim, args.queries, 0.63
CHILD_TIMEOUT_S = 1800  # a memory-measuring child ranks one step: minutes at 1 M rows on a slow machine
HALF = D // 2


def entity_ids_for(n, seed=0):
    """Entity id per row: one entity of 5,000 rows (or n/10), then entities of 1–8 rows (mean 4.5)."""
    rng = np.random.default_rng(seed)
    big = min(5000, n // 10)
    sizes = [big]
    while sum(sizes) < n:
        sizes.append(int(rng.integers(1, 9)))
    sizes[-1] -= sum(sizes) - n
    return np.repeat(np.arange(len(sizes)), sizes)


def chunks(n, seed=0, chunk=65536):
    def gen():
        rng = np.random.default_rng(seed)
        for s in range(0, n, chunk):
            x = rng.standard_normal((min(chunk, n - s), D), dtype=np.float32)
            x[:, :HALF] /= np.linalg.norm(x[:, :HALF], axis=1, keepdims=True)  # v̂ and t̂ each unit, as built
            x[:, HALF:] /= np.linalg.norm(x[:, HALF:], axis=1, keepdims=True)
            yield x

    return gen


def load_index(path, n, rank_method, nprobe=32):
    ents = entity_ids_for(n)
    names = [f"e{e}" for e in ents]
    manifest = {"image_dim": HALF, "text_dim": HALF, "image_encoder": "x", "text_encoder": "y"}
    index = read_faiss(path)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.nprobe = nprobe
    return MultimodalIndex(index, names, names, manifest, device="cpu", rank_method=rank_method), names


def step_queries(path, n, seed=1):
    """160 queries built from rows of random gold entities plus noise of several strengths (ranks spread out)."""
    rng = np.random.default_rng(seed)
    index = read_faiss(path)
    ents = entity_ids_for(n)
    rows = rng.integers(0, n, Q)
    x = np.stack([index.reconstruct(int(r)) for r in rows])
    sigma = np.array([0.5, 4, 6, 8, 12])[rng.integers(0, 5, Q)][:, None]
    img = x[:, :HALF] + sigma * rng.standard_normal((Q, HALF), dtype=np.float32) / np.sqrt(HALF)
    txt = x[:, HALF:] + sigma * rng.standard_normal((Q, HALF), dtype=np.float32) / np.sqrt(HALF)
    return img.astype(np.float32), txt.astype(np.float32), [f"e{ents[r]}" for r in rows]


def smaps(pid="self"):
    vals = {}
    for line in open(f"/proc/{pid}/smaps_rollup", encoding="utf-8"):
        parts = line.split()
        if parts[0] in ("Rss:", "Pss:"):
            vals[parts[0][:-1]] = int(parts[1]) * 1024
    return vals


# --------------------------------------------------------------------------- child: one process ranking on the mmap
if args.child:
    path, n, out = args.child[0], int(args.child[1]), Path(args.child[2])
    configure_threads(args.threads or 1)
    idx, _ = load_index(path, n, "exact")
    img, txt, gold = step_queries(path, n)
    idx.entity_ranks(img, txt, gold, alpha=ALPHA, depth=args.depth)
    part = out.with_suffix(".part")  # renamed when whole: the benchmark reads it once it exists
    part.write_text(json.dumps({**smaps(), "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    part.replace(out)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not out.with_suffix(".release").exists():  # hold the index while the sibling measures too
        if time.monotonic() > deadline:
            sys.exit(f"{out.name}: no release from the benchmark in {CHILD_TIMEOUT_S} s")
        time.sleep(0.2)
    sys.exit(0)

threads = configure_threads(args.threads)
work = Path(args.workdir or tempfile.mkdtemp(prefix="reward_scale-"))
work.mkdir(parents=True, exist_ok=True)
a = torch.randn(4096, 4096)
t_peak, _ = best_time(lambda: a @ a, 3)
peak = 2 * 4096**3 / t_peak / 1e9
del a
print(
    f"machine: {usable_cores()} cores, {threads} threads; torch {torch.__version__}, faiss {faiss.__version__}; "
    f"sgemm peak {peak:.0f} GFLOP/s (4096² float32 matmul)"
)
print(f"{Q} queries per step, depth {args.depth}, rows of {D} dims (float32), α = {ALPHA}\n")

speed, memory = [], []
for n in [int(s) for s in args.sizes.split(",")]:
    flat = work / f"flat-{n}.faiss"
    t0 = time.perf_counter()
    faiss.write_index(build_faiss_index_from_chunks(chunks(n), "Flat", D), str(flat))
    build_s = time.perf_counter() - t0
    img, txt, gold = step_queries(flat, n)
    flops = 2 * n * D * Q
    results = {}
    for name, method, path in [
        ("(a) FAISS Flat top-k + depth loop", "search", flat),
        ("(b) exact: matmul + segment max", "exact", flat),
    ]:
        idx, _ = load_index(path, n, method)
        t, ranks = best_time(lambda: idx.entity_ranks(img, txt, gold, alpha=ALPHA, depth=args.depth), args.repeats)
        results[method] = ranks
        speed.append((n, name, t, flops / t / 1e9, ""))
        del idx
    same = sum(x == y for x, y in zip(results["search"], results["exact"]))
    speed[-1] = speed[-1][:4] + (f"ranks equal to (a) for {same}/{Q} queries",)
    if not args.skip_ivf:
        nlist = min(1024, int(4 * np.sqrt(n)))
        ivf_path = work / f"ivf-{n}.faiss"
        t0 = time.perf_counter()
        faiss.write_index(
            build_faiss_index_from_chunks(chunks(n), f"IVF{nlist},Flat", D, max_train_rows=65536), str(ivf_path)
        )
        ivf_build = time.perf_counter() - t0
        idx, _ = load_index(ivf_path, n, "search")
        t, ranks = best_time(lambda: idx.entity_ranks(img, txt, gold, alpha=ALPHA, depth=args.depth), args.repeats)
        agree = sum(x == y for x, y in zip(ranks, results["exact"]))
        hit_exact = sum(r is not None for r in results["exact"])
        hit_ivf = sum(r is not None for r in ranks)
        speed.append(
            (
                n,
                f"(c) IVF{nlist},Flat nprobe 32 + depth loop",
                t,
                float("nan"),
                f"same rank as exact {agree}/{Q}; within depth {hit_ivf} vs {hit_exact}; built in {ivf_build:.0f} s",
            )
        )
        del idx
        ivf_path.unlink()
    # memory: one process, then two sharing the memory-mapped file (page cache)
    for procs in (1, 2):
        outs = [work / f"child-{n}-{procs}-{i}.json" for i in range(procs)]
        children = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    str(flat),
                    str(n),
                    str(o),
                    "--threads",
                    str(max(1, threads // procs)),
                    "--depth",
                    str(args.depth),
                    "--dim",
                    str(D),
                    "--queries",
                    str(Q),
                ]
            )
            for o in outs
        ]
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not all(o.exists() for o in outs):
            ended = [c.returncode for c, o in zip(children, outs) if c.poll() is not None and not o.exists()]
            if ended or time.monotonic() > deadline:
                for c in children:
                    c.kill()
                    c.wait()
                shutil.rmtree(work, ignore_errors=True)
                killed = " (killed: out of memory?)" if ended and ended[0] in (-9, 137) else ""
                why = f"ended with return code {ended[0]}{killed}" if ended else f"wrote nothing in {CHILD_TIMEOUT_S} s"
                sys.exit(f"N = {n:,}, {procs} process(es): a memory-measuring child {why} before writing its figures")
            time.sleep(0.2)
        stats = [read_json(o) for o in outs]
        for o in outs:
            o.with_suffix(".release").touch()
        for c in children:
            c.wait()
        memory.append(
            (
                n,
                procs,
                flat.stat().st_size,
                max(s["maxrss"] for s in stats),
                sum(s["Rss"] for s in stats),
                sum(s["Pss"] for s in stats),
            )
        )
    flat.unlink()
    print(f"N = {n:,}: index {n * D * 4 / 1e9:.1f} GB built and written in {build_s:.0f} s", flush=True)

print("\n| rows | method | ms per step | GFLOP/s | % of sgemm peak | note |")
print("|---|---|---|---|---|---|")
for n, name, t, gf, note in speed:
    share = f"{100 * gf / peak:.0f}" if gf == gf else "—"
    gfs = f"{gf:.0f}" if gf == gf else "—"
    print(f"| {n:,} | {name} | {1000 * t:.0f} | {gfs} | {share} | {note} |")
print("\n| rows | processes | index file GB | peak RSS per process GB | RSS summed GB | PSS summed GB |")
print("|---|---|---|---|---|---|")
for n, procs, size, maxrss, rss, pss in memory:
    print(f"| {n:,} | {procs} | {size / 1e9:.2f} | {maxrss / 1e9:.2f} | {rss / 1e9:.2f} | {pss / 1e9:.2f} |")

# --------------------------------------------------------------------------- the H100 estimate (arithmetic only)
N, per_rank_q, E = 2_000_000, 20, 450_000
rows_bytes = N * D * 2
chunk = 131_072
block = max(1, (256 << 20) // (4 * E))
passes = -(-per_rank_q // block)
upcast = N * D * 4 * 2  # fp32 chunk written once and read once by the matmul, per pass
moved = passes * (rows_bytes + upcast)
flop = 2 * N * D * per_rank_q
hbm, fp32 = 3.35e12, 67e12
print(f"""
ESTIMATE, NOT MEASURED — 2 M rows × {D} dims on one H100 SXM (HBM3 ≈ 3.35 TB/s, FP32 ≈ 67 TFLOP/s), exact ranks for one
rank's {per_rank_q} queries (160 per step over 8 GPUs), ~{E:,} entities:
  replica: fp16 rows {rows_bytes / 1e9:.1f} GB; ExactRanker.entity_scores upcasts each {chunk:,}-row chunk to fp32
  ({chunk * D * 4 / 1e9:.2f} GB) and multiplies it; queries per block = 256 MB / (4 B × {E:,} entities) = {block}
  → {passes} pass(es) over the rows.
  bytes moved ≈ {passes} × ({rows_bytes / 1e9:.1f} GB fp16 read + {upcast / 1e9:.1f} GB fp32 written and read) = {
    moved / 1e9:.1f} GB
  → {1000 * moved / hbm:.0f} ms at HBM bandwidth;
  FLOPs = 2 × {N:,} × {D} × {per_rank_q} = {flop / 1e12:.2f} TFLOP → {1000 * flop / fp32:.1f} ms at FP32 peak;
  plus the segment max (scatter over {per_rank_q} × {N:,} scores, ~{per_rank_q * N * 4 * 3 / 1e9:.2f} GB of traffic).
  Memory-bound: expected ≈ {1000 * moved / hbm:.0f}–{2 * 1000 * moved / hbm:.0f} ms per step per rank (the upcast
  dominates; an fp16
  matmul with fp32 accumulation would read only the {rows_bytes / 1e9:.1f} GB: ≈ {1000 * rows_bytes / hbm:.0f} ms).""")
shutil.rmtree(work, ignore_errors=True)
