"""The example scripts of examples/ run as a reader runs them and write what they say."""

import json
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
