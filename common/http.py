"""An HTTP reply read whole within a deadline: ``urlopen``'s timeout bounds each read only, so a server (or a failing
link) sending a byte now and then held a request for as long as it went on."""

from __future__ import annotations

import http.client
import time


def read_reply(response, timeout: float) -> bytes:
    """The body of ``response`` (from ``urlopen(…, timeout=timeout)``), or a TimeoutError once ``timeout`` seconds
    have passed since the body began without all of it, or ``http.client.IncompleteRead`` where the server closed
    before its Content-Length (as ``response.read()`` does: ``read1`` takes that close for the end)."""
    deadline = time.monotonic() + timeout
    chunks = []
    while chunk := response.read1(1 << 16):
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no whole reply within {timeout} s")
    body = b"".join(chunks)
    if getattr(response, "length", None):  # bytes the Content-Length promised and the server never sent
        raise http.client.IncompleteRead(body, response.length)
    return body
