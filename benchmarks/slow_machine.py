"""The test suite on this machine, made to stand in for the slowest machine of this kind: AVX2 only, no bf16
instructions, and slower (`make demo`'s training took 742 s there, 260 s on the Intel Xeon: 2.85×).

Two handicaps, each optional:
- the instruction set: torch's kernels, oneDNN, MKL, FAISS's own kernels and the OpenBLAS that FAISS and numpy
  bundle held to ``--isa`` (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``,
  ``FAISS_SIMD_LEVEL``, ``OPENBLAS_CORETYPE``; every process the suite launches inherits them). Held to AVX2, a bf16
  matrix product takes torch's fallback, as on a CPU without bf16 instructions;
- the speed: the suite and everything it launches in a cgroup whose CFS quota is this machine's cores ÷
  ``--slowdown`` CPUs, refilled every ``--period-ms`` (short, so each pause is short). Needs a writable cgroup
  (cgroup v1's ``cpu`` hierarchy or v2 with the cpu controller: root on this kind of machine).

A quota is harsher than a slower core where processes wait for each other (a throttled rank stops until the next
period while its peer waits in a collective) and milder where a slower core is slower at some things than others
(large matrix products on AVX2: FAISS Flat took 8–15× longer there, `benchmarks/reward_scale.py`). So the result is a
stand-in, not a measurement of that machine.

    .venv/bin/python benchmarks/slow_machine.py [--slowdown 2.85] [--isa avx2] [--period-ms 10] [-- pytest args]

Prints a table: the run's wall, what passed and failed, how often the quota throttled, and the ten slowest tests.
The whole pytest output goes to ``--log``.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.placement import usable_cores  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ISA_VARIABLES = {  # each library's own switch, as each spells the level
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "FAISS_SIMD_LEVEL": "AVX2",
        "OPENBLAS_CORETYPE": "Haswell",
    },
    "native": {},
}


def cpu_cgroup(name: str, cpus: float, period_us: int) -> Path:
    """A new cgroup limited to ``cpus`` CPUs (its folder)."""
    quota_us = max(1000, round(cpus * period_us))
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        group = v1 / name
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        return group
    v2 = Path("/sys/fs/cgroup")
    if "cpu" in (v2 / "cgroup.controllers").read_text(encoding="utf-8").split():
        (v2 / "cgroup.subtree_control").write_text("+cpu")
        group = v2 / name
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{quota_us} {period_us}")
        return group
    raise RuntimeError("no cgroup with a cpu controller under /sys/fs/cgroup")


def available_cpus() -> float:
    """The CPUs this process may use: the cores it may run on (not the host's count), capped by its own cgroup's
    quota when it has one (a container's: a quota for the suite above it would slow nothing)."""
    cpus = float(usable_cores())
    for line in (
        Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines() if Path("/proc/self/cgroup").exists() else []
    ):
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":  # v2
            limit = Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max"
            quota, _, period = limit.read_text(encoding="utf-8").partition(" ") if limit.exists() else ("max", "", "")
        elif "cpu" in controllers.split(","):  # v1
            folder = Path("/sys/fs/cgroup/cpu") / path.lstrip("/")
            if not (folder / "cpu.cfs_quota_us").exists():
                continue
            quota, period = [
                (folder / name).read_text(encoding="utf-8") for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
            ]
        else:
            continue
        if quota.strip() not in ("max", "-1") and period.strip():
            cpus = min(cpus, int(quota) / int(period))
    return cpus


def throttled(stat: Path) -> str:
    fields = dict(line.split() for line in stat.read_text(encoding="utf-8").splitlines())
    periods, hit = int(fields.get("nr_periods", 0)), int(fields.get("nr_throttled", 0))
    return f"{hit:,} of {periods:,} periods" if periods else "—"


def summary(log: str) -> dict:
    last = log.strip().splitlines()[-1] if log.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", last)}
    slowest = re.findall(r"^(\d+\.\d+)s (setup|call|teardown)\s+(.+)$", log, flags=re.M)
    machine = next((line for line in log.splitlines() if line.startswith("machine: ")), "machine: ?")
    return {"counts": counts, "slowest": slowest, "machine": machine}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slowdown", type=float, default=2.85, help="CPU quota = cores ÷ this; 1 = no quota")
    parser.add_argument("--isa", choices=sorted(ISA_VARIABLES), default="avx2", help="instruction set to hold to")
    parser.add_argument("--period-ms", type=float, default=10.0, help="the quota's refill period")
    parser.add_argument("--log", default="outputs/benchmarks/slow_machine.log", help="pytest's whole output")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed on to pytest (default: the whole suite)")
    args = parser.parse_args()
    if args.slowdown < 1:
        parser.error(f"--slowdown {args.slowdown}: must be ≥ 1 (a quota cannot make the machine faster)")
    cores = available_cpus()  # affinity and this process's own quota, not the host's count
    cpus = cores / args.slowdown
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **ISA_VARIABLES[args.isa]}
    group = None
    if args.slowdown > 1:
        try:
            group = cpu_cgroup(f"refine-rl-slow-{os.getpid()}", cpus, int(args.period_ms * 1000))
        except (OSError, RuntimeError) as e:
            sys.exit(f"--slowdown {args.slowdown} needs a writable cgroup (root): {e}; --slowdown 1 holds the ISA only")
    enter = (lambda: (group / "cgroup.procs").write_text(str(os.getpid()))) if group else None
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10", *args.pytest_args]
    log = ROOT / args.log
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"running {' '.join(command[1:])} on {cores:g} CPUs held to {args.isa}, quota {cpus:.2f} CPUs")
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        rc = subprocess.run(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=enter
        ).returncode
    wall = time.perf_counter() - start
    found = summary(log.read_text(encoding="utf-8"))
    quota = throttled(group / "cpu.stat") if group else "—"
    if group:
        try:
            group.rmdir()  # empty once every process the suite started has exited
        except OSError as e:
            print(f"note: {group} is left behind ({e}): a process the suite started is still running")
    c = found["counts"]
    print(f"\n{found['machine']}\n")
    print(f"| ISA | CPUs (of {cores:g}) | wall s | passed | failed | skipped | throttled | pytest exit |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.isa} | {cpus:.2f} | {wall:.0f} | {c.get('passed', 0)} | "
        f"{c.get('failed', 0) + c.get('error', 0) + c.get('errors', 0)} | {c.get('skipped', 0)} | {quota} | {rc} |"
    )
    print("\n| s | phase | test |\n|---|---|---|")
    for seconds, phase, test in found["slowest"]:
        print(f"| {seconds} | {phase} | {test} |")
    print(f"\npytest's output: {log}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
