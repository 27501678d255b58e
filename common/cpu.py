"""What this machine's CPU offers, read from /proc/cpuinfo: the FAISS import (common.faiss_lib) picks BLAS kernels by
it, and the test suite names its machine with it (tests/machine.py)."""

from __future__ import annotations


def cpu_flags(cpuinfo: str) -> set[str]:
    """The instruction-set flags of the first processor in a /proc/cpuinfo text (empty when it has none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()
