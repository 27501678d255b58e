"""Search latency and throughput of the FAISS index types the retrieval index can be built with.

Measures, on synthetic L2-normalised float32 vectors (d = 896, the tiny/real encoders' concat size is similar):
FAISS Flat (IndexFlatIP, exact), HNSW ("HNSW32,Flat", efSearch 256) and IVF ("IVF{nlist},Flat", nlist ≈ 4·√N,
nprobe 32), all built with ``retrieval.faiss_build.build_faiss_index``, against a numpy baseline
(``Q @ X.T`` → ``np.argpartition`` top-k → sort). One batch of 160 queries at depth k = 200, best of 5 after a
warm-up. Recall@k is measured against Flat's result ids. For the exhaustive methods (Flat, numpy) the achieved
GFLOP/s (2·N·d·queries / time) is compared with the machine's sgemm peak (a large numpy float32 matmul).

    .venv/bin/python benchmarks/search.py [--sizes 10000,100000,1000000] [--max-ann 100000] [--dim 896]
        [--queries 160] [--k 200] [--repeats 5]

Random uniform-on-the-sphere vectors have no cluster structure, which is the worst case for HNSW/IVF recall;
real embeddings are far easier. Memory: 1M × 896 float32 = 3.6 GB (plus 0.6 GB of numpy scores).
"""

import argparse
import gc
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
from threadpoolctl import threadpool_info
from timing import best_time

from common.faiss_lib import faiss
from retrieval.faiss_build import build_faiss_index

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated database sizes N")
parser.add_argument("--max-ann", type=int, default=100000, help="build HNSW and IVF only for N ≤ this")
parser.add_argument("--dim", type=int, default=896)
parser.add_argument("--queries", type=int, default=160)
parser.add_argument("--k", type=int, default=200)
parser.add_argument("--repeats", type=int, default=5, help="timed repeats after one warm-up (best is reported)")
parser.add_argument("--ef-search", type=int, default=256)
parser.add_argument("--nprobe", type=int, default=32)
args = parser.parse_args()
sizes = [int(s) for s in args.sizes.split(",")]
d, nq, k = args.dim, args.queries, args.k
if not 1 <= k <= min(sizes):
    parser.error(f"--k {k}: the top-k search needs 1 ≤ k ≤ the smallest of --sizes ({min(sizes):,})")


def random_unit(n, seed, chunk=65536):
    """n × d L2-normalised float32 rows, generated chunk by chunk (no float64 temporaries)."""
    rng = np.random.default_rng(seed)
    x = np.empty((n, d), np.float32)
    for s in range(0, n, chunk):
        block = x[s : s + chunk]
        rng.standard_normal(out=block, dtype=np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
    return x


def numpy_search(X, Q):
    scores = Q @ X.T
    top = np.argpartition(scores, -k, axis=1)[:, -k:]  # top-k unordered, no negated copy of scores
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
    return np.take_along_axis(top, order, axis=1)


def recall(ids, exact):
    return float(np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(ids, exact)]))


# ------------------------------------------------------------------ machine sgemm peak
A = np.random.default_rng(1).standard_normal((4096, 4096), dtype=np.float32)
sgemm_s, _ = best_time(lambda: A @ A, 3)
sgemm = 2 * 4096**3 / sgemm_s / 1e9
del A
print(
    f"faiss {faiss.__version__}, faiss.omp_get_max_threads() = {faiss.omp_get_max_threads()}, "
    f"os.cpu_count() = {os.cpu_count()}"
)
print(f"numpy sgemm peak (4096×4096 @ 4096×4096 float32, best of 3): {sgemm:.1f} GFLOP/s")
blas = [(Path(i["filepath"]).name, i.get("architecture")) for i in threadpool_info() if i["internal_api"] == "openblas"]
print("OpenBLAS kernels: " + ", ".join(f"{arch} in {name}" for name, arch in blas) + " (FAISS's: common.faiss_lib)")
print("load average at start: %.2f %.2f %.2f (other work on the machine skews the timings)" % os.getloadavg())
print(f"d = {d}, {nq} queries per batch, k = {k}, best of {args.repeats} after a warm-up")
if any(n > args.max_ann for n in sizes):
    print(
        f"note: HNSW and IVF are built only for N ≤ {args.max_ann} (--max-ann): building them at larger N "
        f"takes too long on {os.cpu_count()} cores"
    )
print()

# ------------------------------------------------------------------ benchmark
Q = random_unit(nq, seed=12345)
rows = []
for n in sizes:
    X = random_unit(n, seed=0)
    flops = 2 * n * d * nq
    methods = [("numpy Q@X.T + argpartition", None), ("faiss Flat", "Flat")]
    if n <= args.max_ann:
        nlist = int(round(4 * math.sqrt(n)))
        methods += [("faiss HNSW32,Flat", "HNSW32,Flat"), (f"faiss IVF{nlist},Flat", f"IVF{nlist},Flat")]
    exact = None
    for name, factory in methods:
        if factory is None:
            build_s, search = 0.0, lambda: numpy_search(X, Q)
        else:
            t0 = time.perf_counter()
            index = build_faiss_index(X, factory)
            build_s = time.perf_counter() - t0
            if factory.startswith("HNSW"):
                index.hnsw.efSearch = args.ef_search
            ivf = faiss.try_extract_index_ivf(index)
            if ivf is not None:
                ivf.nprobe = min(args.nprobe, ivf.nlist)
            search = lambda: index.search(Q, k)[1]
        secs, ids = best_time(search, args.repeats)
        if factory == "Flat":
            exact = ids
        exhaustive = factory in (None, "Flat")
        rows.append(
            dict(
                method=name,
                n=n,
                build=build_s if factory else None,
                ms=secs * 1e3,
                qps=nq / secs,
                ids=ids,
                gflops=flops / secs / 1e9 if exhaustive else None,
            )
        )
        print(f"  done: {name:28s} N={n:>9,}  {secs * 1e3:9.1f} ms", flush=True)
        index = search = None
        gc.collect()
    for r in rows:  # recall vs Flat, filled in once Flat has run at this N
        if r["n"] == n:
            r["recall"] = recall(r.pop("ids"), exact)
    del X, exact
    gc.collect()

print("load average at end:   %.2f %.2f %.2f" % os.getloadavg())
print()
print(f"| method | N | build s | ms / {nq} queries | queries/s | recall@{k} vs Flat | GFLOP/s | % of sgemm |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    g = f"{r['gflops']:.1f} | {100 * r['gflops'] / sgemm:.0f}%" if r["gflops"] is not None else "– | –"
    build = "–" if r["build"] is None else f"{r['build']:.2f}"
    print(f"| {r['method']} | {r['n']:,} | {build} | {r['ms']:.1f} | {r['qps']:,.0f} | {r['recall']:.3f} | {g} |")
