"""common.faiss_lib: FAISS's bundled OpenBLAS loads on kernels chosen from the CPU's flags, not on its fallback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.cpu import cpu_flags
from common.faiss_lib import openblas_coretype

AVX512 = "avx512f avx512cd avx512bw avx512dq avx512vl"


@pytest.mark.parametrize(
    "flags,coretype",
    [
        (f"fpu sse3 avx avx2 fma {AVX512} avx512_bf16 amx_bf16", "SkylakeX"),  # Sapphire / Emerald Rapids
        (f"sse3 avx avx2 fma {AVX512} avx512_bf16", "SkylakeX"),  # AMD Zen 4 (newer OpenBLAS: SkylakeX too)
        ("sse3 avx avx2 fma", "Haswell"),  # AMD Zen 2/3, AVX2 only
        ("sse3 avx avx2 fma avx512f avx512cd avx512er avx512pf", "Haswell"),  # Xeon Phi: no BW/DQ/VL
        ("sse3 avx avx2", None),  # AVX2 without FMA: OpenBLAS decides
        ("sse3 avx", None),
        ("", None),
    ],
)
def test_the_kernel_family_follows_the_instruction_sets(flags, coretype):
    assert openblas_coretype(set(flags.split())) == coretype


@pytest.mark.parametrize(
    "cpuinfo,flags",
    [
        ("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n", {"fpu", "avx2"}),
        ("processor\t: 0\nmodel name\t: X\n", set()),
        ("", set()),
    ],
)
def test_cpu_flags_are_the_first_processors(cpuinfo, flags):
    assert cpu_flags(cpuinfo) == flags


PROBE = """
import json, os
from common.faiss_lib import faiss
from threadpoolctl import threadpool_info
cores = [i.get("architecture") for i in threadpool_info() if "openblaso" in i["filepath"]]
print(json.dumps({"cores": cores, "env": os.environ.get("OPENBLAS_CORETYPE")}))
"""


def probe(**env):
    """faiss's OpenBLAS kernels as threadpoolctl reads them, in a fresh process (this one may have loaded FAISS)."""
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def this_cpu():
    cpuinfo = Path("/proc/cpuinfo")
    coretype = openblas_coretype(cpu_flags(cpuinfo.read_text(encoding="utf-8") if cpuinfo.is_file() else ""))
    if coretype is None:
        pytest.skip("this CPU has neither AVX2 with FMA nor AVX-512: OpenBLAS keeps its own choice")
    return coretype


def test_faiss_loads_its_openblas_on_the_cpus_kernels_and_leaves_the_environment_as_it_was(this_cpu):
    assert probe() == {"cores": [this_cpu], "env": None}


def test_a_coretype_the_user_set_wins():
    assert probe(OPENBLAS_CORETYPE="Prescott") == {"cores": ["Prescott"], "env": "Prescott"}
