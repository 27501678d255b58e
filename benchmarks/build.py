"""Index build throughput (KB rows/s) and peak memory of ``retrieval.build_index`` with the tiny encoders.

For each KB size a synthetic KB in the canonical format ({entry_id, entity_id, title, section_title, text, image})
is written to a temp dir: texts are the toy world's sections, images point round-robin into a pool of distinct
56×56 toy-world PNGs (so writing image files does not dominate). The build then runs in a fresh subprocess
(``retrieval.build_index.main([... --image_encoder tiny --text_encoder tiny --device cpu ...])``) that reports its
own peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``). A baseline subprocess that only imports the same
libraries and builds the two tiny encoders is measured the same way; its wall time is subtracted for rows/s and
its peak RSS for "RSS above baseline". The build streams the KB shard by shard, so memory above the baseline
should be about the index itself (rows × dim × 4 bytes, held a few times over while the shards are concatenated
and added to FAISS), not the KB.

    .venv/bin/python benchmarks/build.py [--sizes 1000,10000] [--pool 200] [--shard-size 1024] [--batch-size 64]
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
sys.path.insert(0, str(REPO))
from retrieval.toyworld import make_entities, render, sections  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--sizes", default="1000,10000", help="comma-separated KB row counts")
parser.add_argument("--pool", type=int, default=200, help="distinct PNG images the KB rows point at")
parser.add_argument("--shard-size", type=int, default=1024, help="KB rows per build shard")
parser.add_argument("--batch-size", type=int, default=64, help="encoder batch size")
args = parser.parse_args()
sizes = [int(s) for s in args.sizes.split(",")]

tmp = Path(tempfile.mkdtemp(prefix="bench-build-"))
env = dict(os.environ, REFINE_RL_CACHE=os.environ.get("REFINE_RL_CACHE") or str(tmp / "cache"),
           PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))

# Run in a fresh interpreter; prints one JSON line with its own peak RSS (ru_maxrss is in KiB on Linux).
CHILD = """
import json, resource, sys
argv = json.loads(sys.argv[1])
if argv:
    from retrieval.build_index import main
    main(argv)
else:  # baseline: the build's imports and the two tiny encoders, no KB
    import faiss, open_clip, pyarrow.parquet, sentence_transformers, torch, tqdm, trl
    from retrieval.encoders import image_encoder, text_encoder
    image_encoder("tiny", device="cpu"), text_encoder("tiny", device="cpu")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps({"peak_rss": peak}))
"""


def run_child(argv):
    """Run CHILD in a subprocess; returns (wall s incl. interpreter start, its RESULT dict, its stdout)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], env=env, cwd=REPO,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"child failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return wall, json.loads(line[len("RESULT "):]), p.stdout


# ------------------------------------------------------------------ synthetic KB: an image pool and rows
entities = make_entities(min(args.pool, 192), seed=0)
rng = np.random.default_rng(1)
(tmp / "images").mkdir()
pool = []  # (image path, entity)
for i in range(args.pool):
    e = entities[i % len(entities)]
    path = f"images/pool{i:04d}.png"
    render(e, rng).save(tmp / path)
    pool.append((path, e))


def write_kb(n):
    """n rows: each KB entity has one image and the toy world's two sections (like the toy world's KB)."""
    kb = tmp / f"kb-{n}.jsonl"
    with open(kb, "w") as f:
        for j in range(n):
            image, e = pool[(j // 2) % len(pool)]
            section_title, text = sections(e)[j % 2]
            f.write(json.dumps(dict(entry_id=f"R{j:08d}", entity_id=f"K{j // 2:07d}", title=e["name"],
                                    section_title=section_title, text=text, image=image)) + "\n")
    return kb


# ------------------------------------------------------------------ baseline and builds
print("load average at start: %.2f %.2f %.2f (other work on the machine skews the timings)" % os.getloadavg())
print(f"temp dir {tmp}; REFINE_RL_CACHE={env['REFINE_RL_CACHE']}; {os.cpu_count()} CPUs", flush=True)
run_child([])  # warm-up: builds the tiny text model into the cache, warms the page cache
base_wall, base, _ = run_child([])
print(f"baseline (imports + two tiny encoders): {base_wall:.1f} s, peak RSS {base['peak_rss'] / 2**20:.0f} MB",
      flush=True)

results = []
for n in sizes:
    kb = write_kb(n)
    out = tmp / f"index-{n}"
    wall, res, log = run_child(["--kb", str(kb), "--out", str(out), "--image_encoder", "tiny",
                                "--text_encoder", "tiny", "--shard_size", str(args.shard_size),
                                "--batch_size", str(args.batch_size), "--device", "cpu"])
    manifest = json.loads((out / "manifest.json").read_text())
    inner = float(re.search(r"skipped, ([0-9.]+)s", log).group(1))  # build_index's timer: encode + FAISS + write
    results.append(dict(n=n, wall=wall, inner=inner, rows_s=n / max(wall - base_wall, 1e-9),
                        peak=res["peak_rss"], above=res["peak_rss"] - base["peak_rss"],
                        index=manifest["rows"] * manifest["dim"] * 4,
                        dim=manifest["dim"]))
    print(f"  done: {n:,} rows in {wall:.1f} s ({manifest['rows']:,} indexed, {manifest['skipped']} skipped)",
          flush=True)

print("load average at end:   %.2f %.2f %.2f" % os.getloadavg())
print()
print(f"dim = {results[0]['dim']} (tiny image + tiny text), shard size {args.shard_size}, batch size "
      f"{args.batch_size}; MB = 2^20 bytes")
print(f"rows/s (excl. baseline) = rows / (wall − baseline wall {base_wall:.1f} s); build_index timer = the build's "
      "own log (after the encoders load: encode + FAISS + write)")
print()
print("| KB rows | wall s | rows/s (excl. baseline) | build_index timer s | rows/s (timer) | peak RSS MB "
      "| RSS above baseline MB | index MB |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
print(f"| 0 (baseline) | {base_wall:.1f} | – | – | – | {base['peak_rss'] / 2**20:.0f} | 0 | 0 |")
for r in results:
    print(f"| {r['n']:,} | {r['wall']:.1f} | {r['rows_s']:,.0f} | {r['inner']:.1f} | {r['n'] / r['inner']:,.0f} | "
          f"{r['peak'] / 2**20:.0f} | {r['above'] / 2**20:.0f} | {r['index'] / 2**20:.1f} |")
shutil.rmtree(tmp, ignore_errors=True)
