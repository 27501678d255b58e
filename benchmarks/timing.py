"""The timing the benchmark scripts share (imported as ``timing``: a script's own folder is first on its path)."""

import time


def best_time(fn, repeats):
    """Best wall time of ``repeats`` calls after one warm-up call; also returns the last result."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out
