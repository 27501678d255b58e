"""Download a KB's images by URL into a folder of ``<md5(url)>.<ext>`` files (what ``--image_dir`` reads).

    python -m retrieval.upstream.fetch_images --kb encyclopedic_kb_wiki.zip --out data/evqa/kb_images \
        --user_agent "Your Name (you@example.org)" [--workers 16]
    python -m retrieval.upstream.fetch_images --kb Wiki6M_ver_1_0.jsonl.gz --kb_format wiki6m --out
    data/infoseek/kb_images \
        --user_agent "Your Name (you@example.org)"

The KB is streamed as downloaded (plain, gzipped or zipped; the E-VQA format's ``image_urls``, or Wiki6M's
``wikipedia_image_url``). Files already in the folder are not fetched again; each file is written atomically, so a
killed run resumes where it stopped. SVG images (flags, maps, coats of arms), which PIL cannot decode, are fetched as
Wikimedia's PNG rendering (``…/thumb/<x>/<xy>/<name>.svg/<w>px-<name>.svg.png``) and saved as ``<md5(url)>.png``; an SVG
elsewhere is rasterised with cairosvg when it is installed, else listed as failed. A URL with non-ASCII characters or
spaces is requested percent-encoded (the file is named by the URL as listed). URLs that fail (HTTP error, timeout, an
empty body, not an image by its Content-Type or, without one, by its bytes) are appended to ``<out>/failed.jsonl`` with
the reason. A failure that may pass (a timeout, a dropped or refused connection, an HTTP 5xx, 408 or 429: its reason
starts ``transient:``) is tried again by the next run; the others only with ``--retry_failed``. At the end of a run
``failed.jsonl`` keeps one line per URL, its latest, and none for a URL fetched since. As Wikimedia's policy asks,
requests carry a User-Agent naming you with a contact (``--user_agent``, required), and an HTTP 429 / 503 makes every
download thread wait (the ``Retry-After`` the server sends, else 1, 2, 4 … s) before the request is tried again, up to
``--max_retries`` times.
"""

from __future__ import annotations

import email.utils
import http.client
import io
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import quote, urlparse, urlunparse

from PIL import Image
from tqdm.auto import tqdm

from common.cli import parse
from common.files import append_jsonl, atomic_path, repair_jsonl, write_jsonl_atomic
from common.http import read_reply
from retrieval.upstream.kb import SVG_SUFFIXES, iter_evqa_kb, read_upstream_jsonl, svg_problem, url_hash

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".gif", ".webp", ".tif", ".tiff", ".bmp"}
RETRY_STATUSES = (429, 503)
TRANSIENT = "transient: "  # the reason's prefix of a failure that may pass: the next run tries the URL again
MAX_WAIT = 600.0  # seconds: the longest a Retry-After is honoured for at once
_sleep = time.sleep


@dataclass
class FetchArgs:
    kb: str = field(
        default=None,
        metadata={"help": "the upstream KB file (E-VQA JSON / JSONL, or Wiki6M JSONL; plain, .gz or .zip)"},
    )
    out: str = field(default=None, metadata={"help": "folder to write <md5(url)>.<ext> files into"})
    kb_format: str = field(default="evqa-kb", metadata={"help": "evqa-kb or wiki6m"})
    workers: int = field(default=16, metadata={"help": "parallel downloads (network-bound threads)"})
    timeout: float = field(
        default=30.0,
        metadata={"help": "seconds per request (connecting, and the whole body once it begins)"},
    )
    limit: int = field(default=None, metadata={"help": "stop after this many URLs (a trial run)"})
    retry_failed: bool = field(default=False, metadata={"help": "try the URLs listed in failed.jsonl again"})
    user_agent: str = field(
        default=None,
        metadata={
            "help": "HTTP User-Agent naming you with a contact (an e-mail "
            "address or URL), as Wikimedia's policy asks (required)"
        },
    )
    max_retries: int = field(
        default=5, metadata={"help": "tries after an HTTP 429 / 503 before the URL is listed as failed"}
    )
    svg_width: int = field(
        default=960,
        metadata={
            "help": "width of the PNG fetched (or rasterised) for an SVG; "
            "Wikimedia's standard thumbnail widths include 500, 960, "
            "1280"
        },
    )


def kb_image_urls(path: str, kb_format: str) -> Iterator[str]:
    """Every image URL of the KB, streamed, each once per article (duplicates across articles are skipped by the
    caller's ``done`` set)."""
    if kb_format == "wiki6m":
        for row in read_upstream_jsonl(path):
            if row.get("wikipedia_image_url"):
                yield row["wikipedia_image_url"]
    elif kb_format == "evqa-kb":
        for _, art in iter_evqa_kb(path):
            yield from dict.fromkeys(art.get("image_urls") or [])
    else:
        raise ValueError(f"--kb_format must be evqa-kb or wiki6m, got {kb_format!r}")


def is_svg(url: str) -> bool:
    return PurePosixPath(urlparse(url).path).suffix.lower() in SVG_SUFFIXES


def file_name(url: str) -> str:
    """``<md5(url)><suffix of the URL's path>`` (``.jpg`` when the path has no image suffix; ``.png`` for an SVG,
    which is saved as its PNG rendering)."""
    if is_svg(url):
        return url_hash(url) + ".png"
    suffix = PurePosixPath(urlparse(url).path).suffix.lower()
    return url_hash(url) + (suffix if suffix in IMAGE_SUFFIXES else ".jpg")


def wikimedia_png(url: str, width: int) -> str | None:
    """The PNG rendering Wikimedia serves for an SVG in its upload layout (``/wikipedia/<project>/<x>/<xy>/<name>``
    → ``/wikipedia/<project>/thumb/<x>/<xy>/<name>/<width>px-<name>.png``), or None for any other URL."""
    parts = urlparse(url)
    segments = parts.path.split("/")
    if not is_svg(url) or len(segments) != 6 or segments[1] != "wikipedia" or segments[3] == "thumb":
        return None
    _, _, project, x, xy, name = segments
    if len(x) != 1 or len(xy) != 2 or not xy.startswith(x):
        return None
    return urlunparse(parts._replace(path=f"/wikipedia/{project}/thumb/{x}/{xy}/{name}/{width}px-{name}.png", query=""))


def svg_rasteriser() -> Callable[[bytes, int], bytes] | None:
    """SVG bytes → PNG bytes of the given width with cairosvg, when it is installed (it is not a dependency)."""
    try:
        import cairosvg
    except (ImportError, OSError):  # OSError: the package is there but the cairo library is not
        return None
    return lambda data, width: cairosvg.svg2png(bytestring=data, output_width=width)


def retry_after(value: str | None, attempt: int) -> float:
    """Seconds to wait after a 429 / 503: the ``Retry-After`` header (seconds or an HTTP date), else 1, 2, 4 … s."""
    if value:
        value = value.strip()
        if value.isdigit():
            return min(float(value), MAX_WAIT)
        try:
            when = email.utils.parsedate_to_datetime(value)
            return min(max(0.0, when.timestamp() - time.time()), MAX_WAIT)
        except (TypeError, ValueError):
            pass
    return min(2.0**attempt, MAX_WAIT)


class Throttle:
    """Shared by the download threads: after a 429 / 503 none sends a request before the wait has passed."""

    def __init__(self):
        self.lock, self.until = threading.Lock(), 0.0

    def hold(self, seconds: float) -> None:
        with self.lock:
            self.until = max(self.until, time.monotonic() + seconds)

    def wait(self) -> None:
        delay = self.until - time.monotonic()
        if delay > 0:
            _sleep(delay)


def request_url(url: str) -> str:
    """The URL as HTTP sends it: non-ASCII characters and spaces percent-encoded (UTF-8), what is already escaped
    kept (``Café_Paris.jpg`` → ``Caf%C3%A9_Paris.jpg``); files are still named by the URL as the dataset lists it."""
    return quote(url, safe=":/?#[]@!$&'()*+,;=%~")


def download(url: str, timeout: float, user_agent: str, throttle: Throttle, max_retries: int):
    """(Content-Type, bytes) of one URL, or (None, why not); 429 / 503 are waited out and tried again. Why not starts
    with ``TRANSIENT`` for a failure that may pass (a server error, a timeout, a connection refused or dropped)."""
    for attempt in range(max_retries + 1):
        throttle.wait()
        try:
            req = urllib.request.Request(request_url(url), headers={"User-Agent": user_agent})
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # the whole body within the timeout too
                return resp.headers.get("Content-Type", ""), read_reply(resp, timeout)
        except urllib.error.HTTPError as e:
            if e.code in RETRY_STATUSES and attempt < max_retries:
                throttle.hold(retry_after(e.headers.get("Retry-After"), attempt))
                continue
            tries = f" after {attempt + 1} tries" if e.code in RETRY_STATUSES else ""
            passing = e.code >= 500 or e.code in (408, 429)
            return None, f"{TRANSIENT if passing else ''}HTTPError: {e}{tries}"
        # OSError: URLError, timeouts, refused connections; HTTPException: a connection dropped mid-body
        # (IncompleteRead): each may pass. ValueError: a URL urllib cannot request, which will not
        except (OSError, http.client.HTTPException) as e:
            return None, f"{TRANSIENT}{type(e).__name__}: {e}"
        except ValueError as e:
            return None, f"{type(e).__name__}: {e}"
    raise AssertionError("unreachable")


def decodable(data: bytes) -> bool:
    """Whether PIL reads ``data`` as an image (its header and structure: ``verify``, no full decode)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
        return True
    except Exception:  # PIL raises many kinds for bytes that are not an image
        return False


def fetch_one(
    url: str,
    out: Path,
    timeout: float,
    user_agent: str,
    throttle: Throttle | None = None,
    max_retries: int = 5,
    svg_width: int = 960,
) -> str | None:
    """Download one URL to ``out/file_name(url)``; None on success, else why not. An SVG comes as Wikimedia's PNG
    rendering, or is rasterised locally (cairosvg), or fails saying so."""
    throttle = throttle or Throttle()
    png = wikimedia_png(url, svg_width)
    kind, data = download(png or url, timeout, user_agent, throttle, max_retries)
    if kind is None:
        return data + (f" (Wikimedia's PNG rendering {png} of this SVG)" if png else "")
    kind = kind.split(";")[0].strip().lower()
    if not data:
        return f"empty body (0 bytes{f', Content-Type {kind}' if kind else ''})"
    if kind and not kind.startswith("image/"):
        return f"not an image (Content-Type {kind})"
    if not kind and not is_svg(url) and not decodable(data):  # no Content-Type to go by: the bytes must be one
        return "not an image (no Content-Type, and PIL cannot read the body as one)"
    if kind == "image/svg+xml" or (not kind and is_svg(url)):
        rasterise = svg_rasteriser()
        if rasterise is None:
            return (
                f"SVG image ({kind or 'by its name'}) that PIL cannot decode and that is not in Wikimedia's upload "
                "layout (no PNG rendering to fetch): pip install cairosvg to rasterise it, then --retry_failed"
            )
        try:
            data = rasterise(data, svg_width)
        except Exception as e:  # a malformed SVG
            return f"SVG image not rasterised: {type(e).__name__}: {e}"
        name = url_hash(url) + ".png"
    else:
        name = file_name(url)
    with atomic_path(out / name) as tmp:
        tmp.write_bytes(data)
    return None


CONTACT = re.compile(r"[^\s@()<>]+@[^\s@()<>]+\.[A-Za-z]{2,}|https?://[^\s/]+\.[^\s/]+")  # an address or a site


def check_user_agent(value: str | None) -> None:
    if not value or not CONTACT.search(value):
        raise ValueError(
            f'--user_agent must name you with a contact, e.g. "Jane Doe (jane@example.org)" or a URL, '
            f"as Wikimedia's User-Agent policy asks (clients without one get blocked); got {value!r}"
        )


def fetch_images(args: FetchArgs, log=print) -> dict[str, int]:
    if not args.kb or not Path(args.kb).is_file():
        raise ValueError(f"--kb: {args.kb} is not a file")
    if not args.out:
        raise ValueError("--out: a folder is required")
    if args.workers < 1:
        raise ValueError(f"--workers must be ≥ 1, got {args.workers}")
    if args.max_retries < 0 or args.svg_width < 1:
        raise ValueError(f"--max_retries must be ≥ 0 and --svg_width ≥ 1, got {args.max_retries}, {args.svg_width}")
    check_user_agent(args.user_agent)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed_log = out / "failed.jsonl"
    done = fetched_stems(out)
    failed_before = set()  # failures for good that an earlier run listed: not tried again without --retry_failed
    if failed_log.exists() and not args.retry_failed:  # a cut last line dropped
        failed_before = {url_hash(r["url"]) for r in repair_jsonl(failed_log, key="url") if not transient(r["reason"])}
    counts = {"fetched": 0, "failed": 0, "already there": 0, "failed before": 0}
    transients = 0

    def todo() -> Iterator[str]:
        n = 0
        for url in kb_image_urls(args.kb, args.kb_format):
            if args.limit is not None and n >= args.limit:
                return
            n += 1
            key = url_hash(url)
            if key in done or key in failed_before:
                counts["already there" if key in done else "failed before"] += 1
                continue
            done.add(key)
            yield url

    throttle = Throttle()

    def one(url: str) -> str | None:
        return fetch_one(url, out, args.timeout, args.user_agent, throttle, args.max_retries, args.svg_width)

    with ThreadPoolExecutor(args.workers) as pool, tqdm(desc="images", unit="img") as bar:
        urls = todo()
        while True:  # bounded look-ahead: memory stays flat however many URLs the KB holds
            chunk = [u for _, u in zip(range(args.workers * 8), urls)]
            if not chunk:
                break
            reasons = list(pool.map(one, chunk))
            failures = [{"url": u, "reason": r} for u, r in zip(chunk, reasons) if r is not None]
            if failures:
                append_jsonl(failed_log, failures)
            counts["failed"] += len(failures)
            transients += sum(transient(f["reason"]) for f in failures)
            counts["fetched"] += len(chunk) - len(failures)
            bar.update(len(chunk))
    compact_failures(failed_log, fetched_stems(out))
    log(
        f"images in {out}: {counts['fetched']} fetched, {counts['already there']} already there, "
        f"{counts['failed']} failed"
        + (
            f", {counts['failed before']} failed for good in an earlier run (--retry_failed tries them again)"
            if counts["failed before"]
            else ""
        )
        + (
            f" (listed in {failed_log}; {transients} transient, tried again by the next run)"
            if counts["failed"]
            else ""
        )
    )
    return counts


def transient(reason: str) -> bool:
    """Whether a listed failure may pass (``TRANSIENT``): the next run tries its URL again."""
    return reason.startswith(TRANSIENT)


def fetched_stems(out: Path) -> set[str]:
    """The url hashes of the images in ``out`` (an .svg left by an older version is not one: its PNG is fetched)."""
    return {
        p.stem
        for p in out.iterdir()
        if not p.name.startswith(".") and p.name != "failed.jsonl" and svg_problem(p.name) is None
    }


def compact_failures(failed_log: Path, fetched: set[str]) -> None:
    """``failed.jsonl`` with one line per URL, its latest failure, and none for a URL fetched since (a retried URL
    was appended again; written atomically)."""
    if not failed_log.exists():
        return
    latest = {r["url"]: r for r in repair_jsonl(failed_log, key="url")}
    write_jsonl_atomic(failed_log, [r for url, r in latest.items() if url_hash(url) not in fetched])


def main(argv=None) -> None:
    (args,) = parse((FetchArgs,), argv, description=__doc__)
    fetch_images(args)


if __name__ == "__main__":
    from common.cli import run

    run(main)
