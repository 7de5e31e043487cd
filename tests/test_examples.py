"""The example scripts of examples/ run as a reader runs them and write what they say."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script, arguments", [("hf_trainer.py", ["--steps", "3"]), ("lightning_trainer.py", ["--epochs", "1"])])
def test_an_example_trains_and_writes_the_cockpits_log_and_dashboard(tmp_path, script, arguments):
    pytest.importorskip("transformers" if script.startswith("hf") else "lightning")
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--out", str(tmp_path), *arguments],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "NormTest" in run.stdout
    log = json.loads((tmp_path / "cockpit.json").read_text())
    assert log and all("NormTest" in row for row in log.values())
    assert (tmp_path / "cockpit__primary.png").exists()


def test_the_fsdp2_example_runs_under_torchrun_in_two_processes(tmp_path):
    pytest.importorskip("transformers")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # loopback; the ranks share the cores
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run = subprocess.run(
        [*command, str(EXAMPLES / "fsdp_torchrun.py"), "--out", str(tmp_path), "--steps", "2"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("NormTest") == 2  # rank 0 prints each step once
    log = json.loads((tmp_path / "cockpit.json").read_text())
    assert sorted(log) == ["0", "1"] and all("NormTest" in row for row in log.values())
    assert (tmp_path / "cockpit__primary.png").exists()
