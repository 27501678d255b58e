"""The benchmark scripts' own failures (their figures are not asserted: benchmarks/ prints them): a child process that
dies is reported, not waited on forever; arguments no run can use are refused before any work."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *argv: str, env: dict | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_reward_scale_reports_a_child_that_died(tmp_path):
    # every memory-measuring child exits as the OOM killer leaves it, before writing its figures
    (tmp_path / "sitecustomize.py").write_text('import os, sys\nif "--child" in sys.argv:\n    os._exit(137)\n')
    done = run_script(
        "reward_scale.py",
        *("--sizes", "2000", "--repeats", "1", "--skip-ivf", "--dim", "64", "--queries", "8", "--depth", "10"),
        *("--workdir", str(tmp_path / "work")),
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )
    assert done.returncode == 1
    assert "N = 2,000, 1 process(es): a memory-measuring child ended with return code 137" in done.stderr
    assert not (tmp_path / "work").exists()


def test_search_refuses_a_k_past_the_smallest_size():
    done = run_script("search.py", "--sizes", "1000,100", "--dim", "8", "--repeats", "1")
    assert done.returncode == 2  # argparse's refusal, before any index is built
    assert "--k 200: the top-k search needs 1 ≤ k ≤ the smallest of --sizes (100)" in done.stderr
