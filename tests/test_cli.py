"""The command line: ``python -m cockpit_fast {demo,plot,bench,info}``.

The demo runs once, briefly, as a user would start it; its run folder is checked for a complete
log, a dashboard-sized PNG and TensorBoard events. ``plot`` redraws a log written by Cockpit
1.0.2 itself. Option errors are checked in-process: one line on stderr, exit code 2.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cockpit_fast import cli
from cockpit_fast.demo import build_model
from cockpit_fast.utils.training import training_step

pytest.importorskip("backpack")

REPOSITORY = Path(__file__).resolve().parent.parent
DASHBOARD_PIXELS = (1500, 3000)  # height, width of CockpitPlotter's saved primary screen
DEMO_STEPS = 12
# What Cockpit.log records next to the quantities (the demo logs every epoch's end).
LOG_KEYS = {
    "epoch_count",
    "train_loss",
    "valid_loss",
    "test_loss",
    "train_accuracy",
    "valid_accuracy",
    "test_accuracy",
    "learning_rate",
}


def run_module(*args):
    """``python -m cockpit_fast *args`` from the repository root; returns the finished process."""
    env = dict(os.environ, PYTHONPATH=str(REPOSITORY))
    # Tests share 2 cores with other jobs: one thread each keeps OpenMP from spinning against them.
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "cockpit_fast", *args], cwd=REPOSITORY, env=env, capture_output=True, text=True
    )


def read_log(path):
    """A cockpit's JSON log as written (histograms come back as NumPy arrays)."""
    from cockpit_fast.instruments.tracking_log import read_output

    return read_output(str(path))


def image_pixels(path):
    from matplotlib.image import imread

    return imread(str(path)).shape[:2]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The run folder and the finished process of a short demo with the full configuration."""
    out = tmp_path_factory.mktemp("demo") / "run"
    process = run_module(
        *("demo", "--steps", str(DEMO_STEPS), "--batch-size", "32", "--compare-steps", "3"),
        *("--config", "full", "--device", "cpu", "--out", str(out)),
    )
    assert process.returncode == 0, process.stderr
    return out, process


def test_demo_log_holds_every_quantity_of_the_configuration(demo_run):
    from cockpit_fast.utils.configuration import configuration

    out, _ = demo_run
    log = read_log(out / "cockpit.json")
    expected = {type(quantity).__name__ for quantity in configuration("full")}
    assert sorted(int(step) for step in log) == list(range(DEMO_STEPS))
    # Alpha and UpdateSize of a step are known only once the next step has run.
    assert expected <= set(log["0"])
    assert expected - {"Alpha", "UpdateSize"} <= set(log[str(DEMO_STEPS - 1)])
    logged = {name for entry in log.values() for name in entry}
    assert logged - LOG_KEYS == expected
    assert log[str(DEMO_STEPS - 1)]["valid_accuracy"] is not None


def test_demo_saves_the_dashboard(demo_run):
    out, _ = demo_run
    assert image_pixels(out / "cockpit__primary.png") == DASHBOARD_PIXELS


def test_demo_writes_scalars_and_histograms_to_tensorboard(demo_run):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out, _ = demo_run
    everything = {"scalars": 0, "histograms": 0}
    # The events sit in a folder named after the run, which TensorBoard shows as the run's name.
    events = event_accumulator.EventAccumulator(str(out / "tensorboard" / "run"), size_guidance=everything)
    events.Reload()
    tags = events.Tags()
    scalars = ["Loss", "Alpha", "NormTest", "InnerTest", "OrthoTest", "HessMaxEV", "TICDiag", "train_loss"]
    assert {f"cockpit/{name}" for name in scalars} <= set(tags["scalars"])
    assert any(tag.startswith("cockpit/GradNorm/0.") for tag in tags["scalars"])  # the model's names
    histograms = {"GradHist1d", "GradHist1d/log10", "GradHist2d/gradients", "GradHist2d/gradients/log10"}
    assert {f"cockpit/{name}" for name in histograms} <= set(tags["histograms"])
    assert [event.step for event in events.Scalars("cockpit/Loss")] == list(range(DEMO_STEPS))

    # The histogram holds the kernel's counts: one per gradient element of every sample.
    log = read_log(out / "cockpit.json")
    first = events.Histograms("cockpit/GradHist1d")[0].histogram_value
    assert list(first.bucket) == pytest.approx(log["0"]["GradHist1d"]["hist"].tolist())
    parameters = sum(p.numel() for p in build_model().parameters())
    assert first.num == 32 * parameters


# A row of the demo's summary: label, ms / step (quartiles), ratio to plain steps (quartiles).
SUMMARY_ROW = re.compile(
    r"^  (?P<label>\S.*?)\s+(?P<ms>[\d.]+)\s+\((?P<ms_low>[\d.]+)-(?P<ms_high>[\d.]+)\)"
    r"\s+(?P<ratio>[\d.]+)x(?:\s+\((?P<ratio_low>[\d.]+)-(?P<ratio_high>[\d.]+)\))?$"
)


def summary_rows(stdout):
    """``{label: {column: float}}`` of the summary table's rows."""
    rows = {}
    for line in stdout.splitlines():
        match = SUMMARY_ROW.match(line)
        if match:
            values = {key: float(value) for key, value in match.groupdict().items() if key != "label" and value}
            rows[match["label"]] = values
    return rows


def test_demo_prints_plain_cockpit_fast_and_cockpit_side_by_side(demo_run):
    out, process = demo_run
    stdout = process.stdout
    lines = stdout.splitlines()
    rows = summary_rows(stdout)
    labels = ["plain (no cockpit)", "cockpit_fast ('full')", "Cockpit 1.0.2 ('full', 3 steps)"]
    assert list(rows) == labels, stdout
    assert "on cpu with 1 thread," in stdout
    assert "Timing 3 steps with Cockpit 1.0.2 too, in turn with the others." in stdout
    plain = rows[labels[0]]
    assert plain["ratio"] == 1.0 and "ratio_low" not in plain  # each plain step against itself
    # Rounding to a fixed number of decimals keeps order: printed quartiles bound the printed median.
    for row in rows.values():
        assert row["ms_low"] <= row["ms"] <= row["ms_high"]
        assert row.get("ratio_low", 1.0) <= row["ratio"] <= row.get("ratio_high", 1.0)
    assert f"  (medians and quartiles of {DEMO_STEPS - 1} steps, run in turn, the first left out)" in lines
    note = re.search(r"Cockpit 1\.0\.2 takes ([\d.]+)x \(([\d.]+)-([\d.]+)\) the time of cockpit_fast per step", stdout)
    assert note is not None, stdout
    # The quotient of the two ratios to plain steps (quartiles: the widest quotients), from the
    # printed ratios, each within half a unit of its last printed decimal, as the note is.
    fast, original = rows[labels[1]], rows[labels[2]]
    median, low, high = (float(value) for value in note.groups())
    for printed, numerator, denominator in zip(
        (low, median, high),
        (original["ratio_low"], original["ratio"], original["ratio_high"]),
        (fast["ratio_high"], fast["ratio"], fast["ratio_low"]),
    ):
        half = 0.05
        lowest, highest = (numerator - half) / (denominator + half), (numerator + half) / (denominator - half)
        assert lowest - half - 1e-9 <= printed <= highest + half + 1e-9
    busy = [line for line in lines if "warning" in line]
    for line in busy:  # whether the machine is busy is not up to the test; the line says why
        assert line.startswith("  warning: the machine was busy while timing (")
        assert "load average" in line or "quartiles" in line
    assert len(busy) <= 1
    assert ["log:", str(out / "cockpit.json")] in [line.split() for line in lines]
    assert f"tensorboard --logdir {out / 'tensorboard'}  (the run 'run')" in stdout
    assert "Traceback" not in process.stderr


@pytest.mark.parametrize("track_every", [1, 3])
def test_demo_summary_is_the_medians_and_quartiles_of_steps_and_ratios(capsys, tmp_path, track_every):
    """Against NumPy's percentiles of the same seconds, to the rounding of the print: the times
    to 0.005 ms, the ratios to 0.05. With --track-every 3 a block of 3 steps holds one tracked step."""
    from cockpit_fast.demo import print_summary, timing_table

    rng = np.random.default_rng(track_every)
    plain = rng.lognormal(np.log(2e-3), 0.2, size=40)
    fast = plain * rng.lognormal(np.log(4.0), 0.1, size=40)
    original = fast[:10] * rng.lognormal(np.log(3.0), 0.1, size=10)
    runs = [("plain", plain.tolist()), ("fast", fast.tolist()), ("original", original.tolist())]
    print_summary(timing_table(runs, track_every), 40 // track_every, track_every, "a note", None, 0.5, str(tmp_path))
    printed = summary_rows(capsys.readouterr().out)

    def blocks(seconds):  # mean of each whole block of track_every steps
        whole = len(seconds) - len(seconds) % track_every
        return seconds[:whole].reshape(-1, track_every).mean(axis=1)

    for label, seconds in (("plain", plain), ("fast", fast), ("original", original)):
        times = blocks(seconds)
        ratios = times / blocks(plain)[: len(times)]
        low, median, high = np.percentile(1000 * times[1:], [25, 50, 75])  # the warm-up left out
        assert printed[label]["ms"] == pytest.approx(median, abs=0.005 + 1e-9)
        assert (printed[label]["ms_low"], printed[label]["ms_high"]) == pytest.approx((low, high), abs=0.005 + 1e-9)
        low, median, high = np.percentile(ratios[1:], [25, 50, 75])
        assert printed[label]["ratio"] == pytest.approx(median, abs=0.05 + 1e-9)
        if label != "plain":
            ratio_spread = (printed[label]["ratio_low"], printed[label]["ratio_high"])
            assert ratio_spread == pytest.approx((low, high), abs=0.05 + 1e-9)


def test_demo_warns_when_the_machine_was_busy_and_says_why():
    from cockpit_fast.demo import BUSY_SPREAD, busy_warning

    steady_ratio = (3.9, 4.0, 4.1)
    assert busy_warning([0.5, 1.9], 2, steady_ratio) is None
    assert busy_warning([None, None], 2, steady_ratio) is None  # no load average on this system
    loaded = busy_warning([0.5, 3.25], 2, steady_ratio)
    assert "load average 3.2 after, on 2 cores" in loaded and "quartiles" not in loaded
    spread = 1.01 * BUSY_SPREAD * 4.0
    wide = busy_warning([0.5, 1.0], 2, (4.0 - spread / 2, 4.0, 4.0 + spread / 2))
    assert f"quartiles {1.01 * BUSY_SPREAD:.0%} of the median apart, above {BUSY_SPREAD:.0%}" in wide
    assert "load average" not in wide
    assert wide.startswith("warning: the machine was busy while timing (") and wide.endswith("another run may differ")


def test_demo_fixes_the_thread_count_while_it_runs(monkeypatch):
    from cockpit_fast import demo

    seen = []
    monkeypatch.setattr(demo, "_run", lambda *args: seen.append(torch.get_num_threads()))
    options = dict(steps=1, epochs=1, batch_size=2, device="cpu", config="economy", seed=0, out="x", track_every=1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        demo.run(**options, compare_steps=0)
        demo.run(**options, compare_steps=0, threads=3)
        assert seen == [1, 3] and torch.get_num_threads() == 2  # 1 by default, and given back after
    finally:
        torch.set_num_threads(before)
    with pytest.raises(demo.UsageError, match="--threads must be at least 1, got 0"):
        demo.run(**options, compare_steps=0, threads=0)


def test_demo_says_when_cockpit_is_not_installed_without_announcing_its_timing(monkeypatch, capsys, tmp_path):
    from importlib import metadata

    from cockpit_fast import demo

    installed_version = metadata.version

    def cockpit_not_installed(name):
        if name == "cockpit-for-pytorch":
            raise metadata.PackageNotFoundError(name)
        return installed_version(name)

    monkeypatch.setattr(demo.metadata, "version", cockpit_not_installed)
    options = dict(steps=2, epochs=1, batch_size=32, device="cpu", config="economy", seed=0, track_every=1)
    demo.run(**options, out=str(tmp_path), compare_steps=2)
    out = capsys.readouterr().out
    assert "Cockpit 1.0.2: Cockpit is not installed (pip install cockpit-for-pytorch==1.0.2 to compare)" in out
    assert "Timing" not in out


def test_demo_defaults_economy_and_every_step_of_its_epochs():
    from cockpit_fast.demo import step_count

    args = cli.build_parser().parse_args(["demo"])
    assert args.config == "economy" and args.steps is None and args.compare_steps == 10
    assert step_count(1438, 64, args.epochs, args.steps) == args.epochs * (1438 // 64)
    assert step_count(1438, 64, args.epochs, 5) == 5


def test_demo_help_says_what_it_does_and_where_outputs_go(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("digits", "Cockpit 1.0.2", "cockpit.json", "cockpit__primary.png", "tensorboard/", "--out"):
        assert phrase in text


def test_version(capsys):
    import cockpit_fast

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"cockpit_fast {cockpit_fast.__version__}"


def test_console_script_and_module_name_themselves_in_errors():
    process = run_module("demo", "--steps", "0")
    assert process.returncode == 2
    assert process.stderr.startswith("python -m cockpit_fast: error: argument --steps")


def write_cockpit_log(logpath):
    """A few steps of a tiny MLP under Cockpit 1.0.2's own ``full`` configuration, written to ``logpath``."""
    cockpit = pytest.importorskip("cockpit")
    from backpack import extend
    from cockpit.utils.configuration import configuration

    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = cockpit.Cockpit(model.parameters(), quantities=configuration("full"))
    batch = torch.randn(16, 10), torch.randint(0, 3, (16,))
    for step in range(4):
        training_step(
            model, optimizer, batch, individual_loss_fn, loss_fn=loss_fn, cockpit=tracker, step=step, quiet=True
        )
    tracker.write(str(logpath))


def test_plot_redraws_a_log_written_by_cockpit(tmp_path):
    write_cockpit_log(tmp_path / "cockpit_run")
    output = tmp_path / "figures" / "dashboard.png"
    process = run_module("plot", str(tmp_path / "cockpit_run.json"), "-o", str(output))
    assert process.returncode == 0, process.stderr
    assert image_pixels(output) == DASHBOARD_PIXELS
    assert process.stdout == f"Dashboard saved in {output}\n"  # and no scratch path that is gone


def test_plot_of_an_empty_log_warns(tmp_path, capsys):
    log = tmp_path / "empty.json"
    log.write_text("{}")
    assert cli.main(["plot", str(log)]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"cockpit-fast: warning: the log {log} holds no steps: the dashboard is empty\n"
    assert (tmp_path / "empty.png").is_file()


def test_plot_of_a_log_without_the_json_suffix(tmp_path):
    write_cockpit_log(tmp_path / "cockpit_run")
    os.rename(tmp_path / "cockpit_run.json", tmp_path / "run.log")
    output = tmp_path / "dashboard.png"
    process = run_module("plot", str(tmp_path / "run.log"), "-o", str(output))
    assert process.returncode == 0, process.stderr
    assert image_pixels(output) == DASHBOARD_PIXELS


def test_plot_of_the_logpath_the_cockpit_was_given(tmp_path, capsys):
    # (Cockpit(..., logpath="logs/run") writes logs/run.json; the plotter takes "logs/run". Before:
    # "no such log file".)
    log = tmp_path / "run.json"
    log.write_text('{"0": {"Loss": 1.0}, "1": {"Loss": 0.5}}')
    assert cli.main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run.png").is_file()


@pytest.mark.parametrize("what, said", [("a folder", "is a directory"), ("an empty file", "is empty")])
def test_plot_of_a_folder_or_an_empty_file_says_which(tmp_path, capsys, what, said):
    log = tmp_path / "run.json"
    log.mkdir() if what == "a folder" else log.write_text("")
    with pytest.raises(SystemExit):
        cli.main(["plot", str(log)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err


@pytest.mark.parametrize(
    "content",
    ["{bad", "[1, 2]", '{"a": 1}', '{"x": {"Loss": 1.0}}', '{"0": {"GradHist1d": {"hist": 3, "edges": 2}}}'],
    ids=["not json", "a list", "not per step", "no step number", "a histogram of numbers"],
)
def test_plot_of_a_bad_log_is_a_one_line_error(tmp_path, capsys, content):
    log = tmp_path / "bad.json"
    log.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plot", str(log)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read the log" in err[0]


@pytest.mark.parametrize("where", ["a folder of that name", "under a file"])
def test_plot_to_a_path_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys, where):
    log = tmp_path / "run.json"
    log.write_text('{"0": {"Loss": 1.0}, "1": {"Loss": 0.5}}')
    if where == "a folder of that name":
        output = tmp_path / "x.png"  # as /proc/x.png: the folder is there, the file cannot be made
        output.mkdir()
    else:
        (tmp_path / "file").write_text("")
        output = tmp_path / "file" / "x.png"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plot", str(log), "-o", str(output)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"cockpit-fast: error: cannot write {output}: "), err
    if where == "under a file":  # (before: "File exists")
        assert err[0].endswith(f"{tmp_path / 'file'} is a file, not a folder"), err


def test_a_file_system_error_is_one_line(tmp_path, capsys):
    """A file where the demo's TensorBoard folder goes: the file system refuses, the CLI says so."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--steps", "2", "--compare-steps", "0", "--device", "cpu", "--out", str(out)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cockpit-fast: error: Not a directory: {out / 'tensorboard' / 'run'}"]


def test_a_demo_run_folder_where_a_file_is_is_one_line_without_errno(tmp_path, capsys):
    (tmp_path / "run").write_text("")  # (before: "[Errno 17] File exists: '...'")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--steps", "2", "--compare-steps", "0", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cockpit-fast: error: cannot write the run folder {tmp_path / 'run'}: a file is there, or on the way to it"]


@pytest.mark.parametrize("command", [[], ["demo"], ["plot"], ["bench"], ["info"]], ids=lambda c: " ".join(c) or "top")
def test_help_is_plain_text(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cockpit-fast") and "``" not in out, out


def test_plot_to_an_unknown_format_fails_before_drawing(tmp_path, capsys, monkeypatch):
    write_cockpit_log(tmp_path / "cockpit_run")
    from cockpit_fast import plotter

    monkeypatch.setattr(plotter.CockpitPlotter, "plot", lambda *a, **k: pytest.fail("drew the dashboard"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plot", str(tmp_path / "cockpit_run.json"), "-o", str(tmp_path / "x.xyz")])
    assert exit_info.value.code == 2
    assert "cannot save a dashboard as .xyz" in capsys.readouterr().err


def test_info_names_versions_extension_and_device(capsys):
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    labels = [line.split(":")[0] for line in lines]
    assert labels == [
        "cockpit_fast",
        "torch",
        "extension built",
        "CUDA kernels",
        "device",
        "backpack-for-pytorch",
        "cockpit-for-pytorch",
    ]
    assert lines[1].split()[-1] == torch.__version__
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert lines[4].split()[-1] == expected_device


def test_bench_runs_the_scripts_present_with_quick(tmp_path, monkeypatch, capfd):
    (tmp_path / "bench_ops.py").write_text("import sys\nprint('ops table', sys.argv[1:])\n")
    monkeypatch.setattr(cli, "BENCHMARKS_DIR", tmp_path)
    assert cli.main(["bench", "--quick"]) == 0
    out = capfd.readouterr().out
    assert "== bench_ops.py ==" in out
    assert "ops table ['--quick']" in out
    assert "bench_step.py" not in out


def test_bench_without_the_repository_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "BENCHMARKS_DIR", tmp_path / "benchmarks")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("cockpit-fast: error: the benchmarks live in the source repository")


BAD_ARGUMENTS = [
    [],
    ["fly"],
    ["demo", "--steps", "0"],
    ["demo", "--steps", "many"],
    ["demo", "--batch-size", "-4"],
    ["demo", "--epochs", "1.5"],
    ["demo", "--batch-size", "100000"],
    ["demo", "--batch-size", "1"],
    ["demo", "--out", "/dev/null/run"],
    ["demo", "--track-every", "0"],
    ["demo", "--config", "first-class"],
    ["demo", "--device", "tpu"],
    ["plot", "no/such/log.json"],
]


@pytest.mark.parametrize("argv", BAD_ARGUMENTS, ids=lambda argv: " ".join(argv) or "no command")
def test_bad_arguments_end_with_one_line_and_exit_code_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("cockpit-fast: error: ")  # one prefix, subcommands too


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for machines without a GPU")
def test_demo_on_cuda_without_a_gpu_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
