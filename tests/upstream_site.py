"""A local HTTP server standing in for Wikimedia's upload server in fetch_images tests (no network in tests).

``Site(routes)``: ``routes`` maps a path to a list of responses ``(status, headers, body)`` served in turn (the last
one repeats); a path not routed answers 404. Every request is recorded as ``(path, User-Agent)``.
"""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def png_bytes(size=(8, 6), color=(200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(size=(8, 6), color=(30, 200, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG")
    return buf.getvalue()


def serve_in_background(server):
    """Serve ``server`` from a daemon thread; return it. It checks for ``shutdown()`` every 20 ms: with the default
    half second, every test that stops a server waited up to 0.5 s for nothing."""
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="30" height="20"><rect width="30" height="20" fill="red"/></svg>'


def ok(body: bytes, kind: str = "image/png") -> tuple:
    return 200, {"Content-Type": kind}, body


class Site:
    def __init__(self, routes: dict[str, list[tuple]] | None = None):
        self.routes = {k: list(v) for k, v in (routes or {}).items()}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                with site.lock:
                    site.requests.append((self.path, self.headers.get("User-Agent", "")))
                    queue = site.routes.get(self.path)
                    status, headers, body = (
                        (queue.pop(0) if len(queue) > 1 else queue[0])
                        if queue
                        else (404, {"Content-Type": "text/html"}, b"<html>not found</html>")
                    )
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:  # a route may promise more than it sends (a dropped connection)
                    self.send_header("Content-Length", str(len(body)))
                self.close_connection = "Content-Length" in headers
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = serve_in_background(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
