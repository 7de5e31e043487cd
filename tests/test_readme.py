"""The README's Python examples run as a reader would run them.

Every ```python block of README.md runs, in order, in one fresh namespace (a later block may use
names an earlier one introduced), in a fresh interpreter inside a temporary folder, with a
timeout. A block whose first line is ``# not run: <reason>`` is skipped: those need several
processes (``torchrun``) or a GPU, which the test suite cannot provide on every machine.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
NOT_RUN = "# not run:"
SKIP_REASONS = ("torchrun", "GPU")  # the only reasons a block may give for not running
TIMEOUT_S = 300

# Runs the blocks of argv[1] (one JSON list) in one namespace, naming the block that fails.
RUNNER = textwrap.dedent(
    """
    import json, sys
    blocks = json.load(open(sys.argv[1]))
    namespace = {"__name__": "__main__"}
    for index, (line, source) in enumerate(blocks):
        print(f"== block {index} (README.md line {line})", flush=True)
        exec(compile(source, f"README.md block {index} (line {line})", "exec"), namespace)
    print("== all blocks ran", flush=True)
    """
)


def python_blocks():
    """``[(first line number, source)]`` of every ```python block of the README."""
    text = README.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, match.start(1)) + 1, match.group(1))
        for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    ]


def runnable_blocks():
    return [(line, source) for line, source in python_blocks() if not source.startswith(NOT_RUN)]


def run_blocks(blocks, tmp_path):
    """Runs ``blocks`` in a fresh interpreter in ``tmp_path``; returns the finished process."""
    import json

    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, "runner.py", "blocks.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_the_readme_has_python_blocks_and_each_skipped_one_says_why():
    blocks = python_blocks()
    assert len(runnable_blocks()) >= 4, "the quick start and its companions should be runnable blocks"
    for line, source in blocks:
        if source.startswith(NOT_RUN):
            reason = source.splitlines()[0]
            assert any(word in reason for word in SKIP_REASONS), f"README.md line {line}: {reason!r}"


def test_the_two_commands_are_in_the_readme_as_ci_reads_them():
    text = README.read_text(encoding="utf-8")
    assert "\nbash scripts/demo.sh" in text
    assert "\nbash scripts/test.sh" in text


def test_every_runnable_block_runs_in_order(tmp_path):
    result = run_blocks(runnable_blocks(), tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "== all blocks ran" in result.stdout
    # The quick start writes the log and its dashboard where it says it does.
    assert (tmp_path / "logs" / "run.json").is_file()
    assert (tmp_path / "logs" / "run" / "cockpit__primary.png").is_file()


def test_the_quick_start_runs_on_its_own(tmp_path):
    """The first block defines its own model and data: a reader can paste it alone."""
    quick_start = runnable_blocks()[0]
    assert "Cockpit(" in quick_start[1]
    result = run_blocks([quick_start], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


@pytest.mark.parametrize("line_and_source", [b for b in python_blocks() if b[1].startswith(NOT_RUN)])
def test_blocks_that_need_torchrun_or_a_gpu_at_least_compile(line_and_source):
    line, source = line_and_source
    compile(source, f"README.md line {line}", "exec")
