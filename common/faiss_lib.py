"""FAISS, imported with its bundled OpenBLAS on kernels that fit the CPU: ``from common.faiss_lib import faiss``.

faiss-cpu's wheels (1.15.1) bundle OpenBLAS 0.3.15, which picks its kernels from the CPU's family and model numbers
and knows no Intel server CPU after Ice Lake: on Sapphire Rapids (the Xeon 8480C of DGX H100 nodes, model 143) and
Emerald Rapids (model 207, the Intel machine of this kind) its table has no entry, and it falls back to its Prescott
(SSE3) kernels (OpenBLAS v0.3.15, driver/others/dynamic.c: ``get_coretype`` returns NULL, then ``gotoblas =
&gotoblas_PRESCOTT``); AMD's Zen 5 gets its Barcelona (SSE) kernels. FAISS computes batched searches (20 queries
or more), k-means and IVF assignment with that library's sgemm: on the Intel machine, Flat search of 160 queries over
100,000 × 896 rows took 467 ms on Prescott's kernels and 124 ms on SkylakeX's, an IVF1265 build 42 s against 10 s
(``benchmarks/search.py``), and the reward's ranking step over 100,000 rows of 2,048 dims 1,083 ms against 293 ms
(``benchmarks/reward_scale.py``).

OpenBLAS 0.3.19 added a fallback by the CPU's features for models it does not know (OpenBLAS pull request 3485);
the copy FAISS bundles predates it. OpenBLAS reads ``OPENBLAS_CORETYPE`` in place of its own detection when the
library is loaded. This module sets it from the CPU's instruction-set flags (``openblas_coretype``) for the moment
``import faiss`` loads that library, and removes it again, so that numpy's OpenBLAS (loaded before) and anything
loaded after keep their own detection. A value the user set is left alone and wins. Import FAISS through this
module everywhere, or the first plain ``import faiss`` of a process decides.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy  # noqa: F401  (its own OpenBLAS is loaded first and detects the CPU itself)

from common.cpu import cpu_flags

# OpenBLAS's SkylakeX kernels need AVX-512 F, CD, BW, DQ and VL (Xeon Phi has F and CD only); Haswell's AVX2 and FMA.
KERNELS = (("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}), ("Haswell", {"avx2", "fma"}))


def openblas_coretype(flags: set[str]) -> str | None:
    """The OpenBLAS kernel family these flags run best: SkylakeX, Haswell, or None (OpenBLAS decides)."""
    return next((name for name, needs in KERNELS if needs <= flags), None)


def _import_faiss():
    cpuinfo = Path("/proc/cpuinfo")
    coretype = openblas_coretype(cpu_flags(cpuinfo.read_text(encoding="utf-8") if cpuinfo.is_file() else ""))
    if coretype is None or "OPENBLAS_CORETYPE" in os.environ:
        import faiss

        return faiss
    os.environ["OPENBLAS_CORETYPE"] = coretype
    try:
        import faiss
    finally:
        del os.environ["OPENBLAS_CORETYPE"]
    return faiss


faiss = _import_faiss()
