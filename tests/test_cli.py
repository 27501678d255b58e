"""common.cli.run's exit: the objects alive at the end are frozen out of the garbage collector (the interpreter's last
collections cost over a second a process), except when a nanobind extension is loaded, whose exit check reports what
the freeze keeps as leaks (triton 3.9, which torch._dynamo imports: dozens of lines after every job)."""

import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_process_without_nanobind_freezes_its_objects_at_exit():
    proc = python(
        "import gc\nfrom common.cli import freeze_for_exit\nprint(freeze_for_exit(), gc.get_freeze_count() > 0)"
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True"], proc.stderr


def test_a_loaded_nanobind_class_is_found_and_nothing_is_frozen(monkeypatch):
    import gc

    from common import cli

    meta = type("nb_meta", (type,), {"__module__": "nanobind"})  # what nanobind's classes are instances of
    module = types.ModuleType("fake_nanobind_extension")
    module.Context = meta("Context", (), {})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    frozen = gc.get_freeze_count()
    assert cli.nanobind_extension_loaded() and cli.freeze_for_exit() is False
    assert gc.get_freeze_count() == frozen


def test_an_entry_point_with_triton_loaded_exits_without_leak_reports():
    pytest.importorskip("triton")
    proc = python("import triton\nfrom common.cli import run\nrun(lambda: print('done'))")
    assert proc.returncode == 0 and proc.stdout.strip() == "done"
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]


AMD_AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"
INTEL_AVX512 = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: avx2 avx512f avx512bw avx512_bf16 avx512_fp16\n"
AMD_AVX512 = "model name\t: AMD EPYC 9B14\nflags\t\t: avx2 avx512f avx512_bf16\n"


@pytest.mark.parametrize(
    "cpuinfo,cores,capability,line",
    [
        (AMD_AVX2, 2, "AVX2", "AMD EPYC 7B12, 2 cores: AVX2 only, no bf16 instructions; torch kernels AVX2"),
        (INTEL_AVX512, 2, "AVX512", "Intel(R) Xeon(R) Processor, 2 cores: AVX-512 with bf16; torch kernels AVX512"),
        (AMD_AVX512, 2, "AVX2", "AMD EPYC 9B14, 2 cores: AVX-512 with bf16; torch kernels AVX2"),  # held to AVX2
        (
            "model name : Old\nflags : sse2 sse4_2\n",
            4,
            "DEFAULT",
            "Old, 4 cores: no AVX2, no bf16 instructions; torch kernels DEFAULT",
        ),
        ("", None, None, "unknown CPU, ? cores: instruction sets unknown"),
    ],
)
def test_the_run_names_its_machine(cpuinfo, cores, capability, line):
    from tests.machine import describe

    assert describe(cpuinfo, cores, capability) == line
