"""Peak memory and speed of the E-VQA KB converter against KB size: it must stay flat in the number of articles.

Writes a synthetic KB in the upstream format (one JSON object keyed by URL, ``--sections`` sections of ~600 characters
and ``--images`` image URLs an article, images named md5(url) in an ``--image_map``), then runs
``python -m retrieval.upstream.convert --format evqa-kb`` on it in a fresh process and reads that process's peak
resident
memory (``VmHWM`` of the child). Reported per size: input MB, articles/s, index rows, article-store MB and
peak RSS. A converter that read the file with one ``json.loads`` would grow ~10× the input size.

    .venv/bin/python benchmarks/convert.py [--sizes 10000,50000,200000] [--sections 6] [--images 3]

The url → path map is read into memory (as the ``--image_map`` option does): its cost grows with the number of
images, not with article text; ``--image_dir`` costs the same per file name. The rows counted "with map" below
include it; the last column runs the same KB with an empty map (every image listed as skipped, every article still
in the store), which isolates the articles' own cost.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--sizes", default="10000,50000,200000")
parser.add_argument("--sections", type=int, default=6)
parser.add_argument("--images", type=int, default=3)
args = parser.parse_args()

# runs the converter's CLI in a fresh interpreter and prints that process's peak RSS (KiB) last: VmHWM, which exec
# resets (ru_maxrss would carry over the benchmark's own peak from the fork)
CHILD = """
import json, re, sys
from retrieval.upstream.convert import main
main(json.loads(sys.argv[1]))
print(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
"""
TEXT = (
    "The article's section text, long enough to look like an encyclopedia paragraph with dates such as 1889 "
    "and places such as Paris. "
) * 5


def write_kb(path: Path, n: int) -> dict:
    mapping = {}
    with open(path, "w", encoding="utf-8") as f:
        f.write("{")
        for i in range(n):
            url = f"https://en.wikipedia.org/wiki/Article_{i}"
            images = [f"https://upload.wikimedia.org/{i}/{j}.jpg" for j in range(args.images)]
            for u in images[:-1]:  # the last image of every article has no file (as ~1.25 M upstream images)
                mapping[u] = f"kb_images/{hashlib.md5(u.encode()).hexdigest()}.jpg"
            art = {
                "title": f"Article {i}",
                "url": url,
                "section_titles": [f"Article {i}"] + [f"Section {s}" for s in range(1, args.sections)],
                "section_texts": [TEXT] * args.sections,
                "image_urls": images,
                "image_reference_descriptions": [""] * len(images),
                "image_section_indices": [j % args.sections for j in range(len(images))],
            }
            f.write(("," if i else "") + json.dumps(url) + ":" + json.dumps(art))
        f.write("}")
    return mapping


print(
    f"{'articles':>9} {'input MB':>9} {'map MB':>7} {'seconds':>8} {'articles/s':>11} {'rows':>8} "
    f"{'store MB':>9} {'peak RSS MB':>12} {'peak, empty map':>16}"
)
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    for n in [int(s) for s in args.sizes.split(",")]:
        kb, out = tmp / f"kb{n}.json", tmp / f"out{n}" / "kb.jsonl"
        (tmp / "map.json").write_text(json.dumps(write_kb(kb, n)))
        (tmp / "empty.json").write_text("{}")

        def run(image_map: str, out: Path) -> tuple[float, int]:
            argv = ["--format", "evqa-kb", "--input", str(kb), "--image_map", image_map, "--out", str(out)]
            t = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(argv)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "TQDM_DISABLE": "1"},
            )
            return time.perf_counter() - t, int(done.stdout.strip().splitlines()[-1])  # KiB, that process's peak

        seconds, peak = run(str(tmp / "map.json"), out)
        _, peak_without = run(str(tmp / "empty.json"), tmp / f"empty{n}" / "kb.jsonl")  # every image skipped
        rows = sum(1 for _ in open(out, encoding="utf-8"))
        store = out.with_name("kb.articles.sqlite")
        print(
            f"{n:>9} {kb.stat().st_size / 1e6:>9.1f} {(tmp / 'map.json').stat().st_size / 1e6:>7.1f} {seconds:>8.1f} "
            f"{n / seconds:>11.0f} {rows:>8} {store.stat().st_size / 1e6:>9.1f} "
            f"{peak / 1024:>12.0f} {peak_without / 1024:>16.0f}"
        )
