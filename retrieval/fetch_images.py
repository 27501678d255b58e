"""Download a KB's images by URL into a folder of ``<md5(url)>.<ext>`` files (what ``--image_dir`` reads).

    python -m retrieval.fetch_images --kb encyclopedic_kb_wiki.json --out data/evqa/kb_images [--workers 16]
    python -m retrieval.fetch_images --kb Wiki6M_ver_1_0.jsonl --kb_format wiki6m --out data/infoseek/kb_images

The KB is streamed (the E-VQA format's ``image_urls``, or Wiki6M's ``wikipedia_image_url``). Files already in the
folder are not fetched again; each file is written atomically, so a killed run resumes where it stopped. URLs that
fail (HTTP error, timeout, not an image) are appended to ``<out>/failed.jsonl`` with the reason and are not retried
unless ``--retry_failed``. Wikimedia asks for a User-Agent that names you: pass ``--user_agent "name (email)"``.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from tqdm.auto import tqdm

from retrieval.files import append_jsonl, atomic_path, read_jsonl
from retrieval.upstream_kb import iter_evqa_kb, url_hash

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".gif", ".webp", ".tif", ".tiff", ".bmp", ".svg"}


@dataclass
class FetchArgs:
    kb: str = field(default=None, metadata={"help": "the upstream KB file (E-VQA JSON / JSONL, or Wiki6M JSONL)"})
    out: str = field(default=None, metadata={"help": "folder to write <md5(url)>.<ext> files into"})
    kb_format: str = field(default="evqa-kb", metadata={"help": "evqa-kb or wiki6m"})
    workers: int = field(default=16, metadata={"help": "parallel downloads (network-bound threads)"})
    timeout: float = field(default=30.0, metadata={"help": "seconds per request"})
    limit: int = field(default=None, metadata={"help": "stop after this many URLs (a trial run)"})
    retry_failed: bool = field(default=False, metadata={"help": "try the URLs listed in failed.jsonl again"})
    user_agent: str = field(default="refine-rl image fetcher (set --user_agent to name yourself)",
                            metadata={"help": "HTTP User-Agent (Wikimedia asks for a contact)"})


def kb_image_urls(path: str, kb_format: str) -> Iterator[str]:
    """Every image URL of the KB, streamed, each once per article (duplicates across articles are skipped by the
    caller's ``done`` set)."""
    if kb_format == "wiki6m":
        for row in read_jsonl(path):
            if row.get("wikipedia_image_url"):
                yield row["wikipedia_image_url"]
    elif kb_format == "evqa-kb":
        for _, art in iter_evqa_kb(path):
            yield from dict.fromkeys(art.get("image_urls") or [])
    else:
        raise ValueError(f"--kb_format must be evqa-kb or wiki6m, got {kb_format!r}")


def file_name(url: str) -> str:
    """``<md5(url)><suffix of the URL's path>`` (``.jpg`` when the path has no image suffix)."""
    suffix = PurePosixPath(urlparse(url).path).suffix.lower()
    return url_hash(url) + (suffix if suffix in IMAGE_SUFFIXES else ".jpg")


def fetch_one(url: str, out: Path, timeout: float, user_agent: str) -> str | None:
    """Download one URL to ``out/file_name(url)``; None on success, else why not."""
    try:
        req = urllib.request.Request(url, headers={"User-Agent": user_agent})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            kind = resp.headers.get("Content-Type", "")
            data = resp.read()
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    if kind and not kind.startswith("image/"):
        return f"not an image (Content-Type {kind})"
    with atomic_path(out / file_name(url)) as tmp:
        tmp.write_bytes(data)
    return None


def fetch_images(args: FetchArgs, log=print) -> dict[str, int]:
    if not args.kb or not Path(args.kb).is_file():
        raise ValueError(f"--kb: {args.kb} is not a file")
    if not args.out:
        raise ValueError("--out: a folder is required")
    if args.workers < 1:
        raise ValueError(f"--workers must be ≥ 1, got {args.workers}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed_log = out / "failed.jsonl"
    done = {p.stem for p in out.iterdir() if not p.name.startswith(".") and p.name != failed_log.name}
    if failed_log.exists() and not args.retry_failed:
        done |= {url_hash(r["url"]) for r in read_jsonl(failed_log)}
    counts = {"fetched": 0, "failed": 0, "already there": 0}

    def todo() -> Iterator[str]:
        n = 0
        for url in kb_image_urls(args.kb, args.kb_format):
            if args.limit is not None and n >= args.limit:
                return
            n += 1
            key = url_hash(url)
            if key in done:
                counts["already there"] += 1
                continue
            done.add(key)
            yield url

    with ThreadPoolExecutor(args.workers) as pool, tqdm(desc="images", unit="img") as bar:
        urls = todo()
        while True:  # bounded look-ahead: memory stays flat however many URLs the KB holds
            chunk = [u for _, u in zip(range(args.workers * 8), urls)]
            if not chunk:
                break
            reasons = list(pool.map(lambda u: fetch_one(u, out, args.timeout, args.user_agent), chunk))
            failures = [{"url": u, "reason": r} for u, r in zip(chunk, reasons) if r is not None]
            if failures:
                append_jsonl(failed_log, failures)
            counts["failed"] += len(failures)
            counts["fetched"] += len(chunk) - len(failures)
            bar.update(len(chunk))
    log(f"images in {out}: {counts['fetched']} fetched, {counts['already there']} already there, "
        f"{counts['failed']} failed" + (f" (listed in {failed_log})" if counts["failed"] else ""))
    return counts


def main(argv=None) -> None:
    from retrieval.cli import parse

    (args,) = parse((FetchArgs,), argv, description=__doc__)
    fetch_images(args)


if __name__ == "__main__":
    from retrieval.cli import run

    run(main)
