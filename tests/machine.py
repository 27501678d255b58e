"""The machine a test run ran on, in one line at the end of its summary (conftest.py): machines of this kind differ in
their CPUs, and the suite's wall time with them (docs/testing.md), so a CI log names its machine itself.

``describe`` is pure: what /proc/cpuinfo says (model name, instruction-set flags), the core count and torch's own CPU
dispatch level (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or DEFAULT). ``gpu_asked``: whether a run
asks for the ``gpu`` tests, which then require the GPU and the gpu extra instead of skipping without them."""

from __future__ import annotations

import os
import re
from pathlib import Path

from common.cpu import cpu_flags


def describe(cpuinfo: str, cores: int | None, capability: str | None) -> str:
    """``Intel(R) Xeon(R) Processor, 2 cores: AVX-512 with bf16; torch kernels AVX512``."""
    model, flags = "unknown CPU", cpu_flags(cpuinfo)
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
            break
    if "avx512f" in flags:
        isa = "AVX-512"
    elif "avx2" in flags:
        isa = "AVX2 only"
    else:
        isa = "no AVX2" if flags else "instruction sets unknown"
    if flags:
        isa += " with bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else ", no bf16 instructions"
    kernels = f"; torch kernels {capability}" if capability else ""
    return f"{model}, {cores or '?'} cores: {isa}{kernels}"


def this_machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text(encoding="utf-8") if cpuinfo.is_file() else ""
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        capability = None
    return describe(text, os.cpu_count(), capability)


def gpu_asked(markexpr: str | None) -> bool:
    """Whether pytest's ``-m`` expression selects the gpu tests by name (``gpu``, ``gpu or slow``; not ``not gpu``)."""
    return re.search(r"(?<!not )\bgpu\b", markexpr or "") is not None
