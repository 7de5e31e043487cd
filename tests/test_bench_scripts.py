"""The benchmark scripts run to their end where cockpit_fast refuses a case (``cockpit-fast bench``
runs them)."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_step_says_which_cases_cockpit_fast_refuses_and_goes_on():
    # BackPACK does not know GPT-2's Conv1D (nor its LayerNorm): curvatures are refused (the script ended there).
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_step.py"), "--quick", "--model", "gpt2", "--only", "HessTrace", "Loss",
         "--steps", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split()[1]: line for line in run.stdout.splitlines() if line.startswith("gpt2 ")}
    assert "cockpit_fast refuses: HessTrace needs BackPACK's DiagGGNMC, which does not support" in rows["HessTrace"]
    assert rows["Loss"].split()[2].replace(".", "").isdigit()  # timed
