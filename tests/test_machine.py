"""tests/machine.py: the line naming the machine at the end of every test run (conftest.py), from /proc/cpuinfo."""

import pytest

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


@pytest.mark.parametrize(
    "markexpr,asked",
    [
        ("gpu", True),
        ("gpu or slow", True),
        ("slow and gpu", True),
        ("not gpu", False),
        ("slow", False),
        ("", False),
        (None, False),
        ("gpus", False),
    ],
)
def test_a_run_asks_for_the_gpu_tests_by_naming_their_marker(markexpr, asked):
    """``pytest -m gpu`` requires a GPU (a usage error without one); ``make test`` skips the gpu tests."""
    from tests.machine import gpu_asked

    assert gpu_asked(markexpr) is asked
