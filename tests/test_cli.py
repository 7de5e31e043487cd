"""The command line: ``python -m cockpit_fast {demo,plot,bench,info}``.

The demo runs once, briefly, as a user would start it; its run folder is checked for a complete
log, a dashboard-sized PNG and TensorBoard events. ``plot`` redraws a log written by Cockpit
1.0.2 itself. Option errors are checked in-process: one line on stderr, exit code 2.
"""

import os
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
    assert set(scalars) <= set(tags["scalars"])
    assert any(tag.startswith("GradNorm/0.") for tag in tags["scalars"])
    histograms = {"GradHist1d", "GradHist1d/log10", "GradHist2d/gradients", "GradHist2d/gradients/log10"}
    assert histograms <= set(tags["histograms"])
    assert [event.step for event in events.Scalars("Loss")] == list(range(DEMO_STEPS))

    # The histogram holds the kernel's counts: one per gradient element of every sample.
    log = read_log(out / "cockpit.json")
    first = events.Histograms("GradHist1d")[0].histogram_value
    assert list(first.bucket) == pytest.approx(log["0"]["GradHist1d"]["hist"].tolist())
    parameters = sum(p.numel() for p in build_model().parameters())
    assert first.num == 32 * parameters
    # The log view: the central spike no longer flattens the other bins.
    logged = events.Histograms("GradHist1d/log10")[0].histogram_value
    assert list(logged.bucket) == pytest.approx(np.log10(1 + log["0"]["GradHist1d"]["hist"]).tolist())
    # GradNorm/all: the norm of the whole gradient, from the per-parameter norms.
    total = events.Scalars("GradNorm/all")[0].value
    assert total == pytest.approx(float(np.linalg.norm(log["0"]["GradNorm"])), rel=1e-6)


def test_demo_prints_plain_cockpit_fast_and_cockpit_side_by_side(demo_run):
    out, process = demo_run
    rows = [line.split() for line in process.stdout.splitlines()]
    labels = {"plain": "plain (no cockpit)", "fast": "cockpit_fast ('full')", "original": "Cockpit 1.0.2 ('full', 3 steps)"}
    table = {key: line for key, label in labels.items() for line in process.stdout.splitlines() if label in line}
    assert table.keys() == labels.keys(), process.stdout
    milliseconds = {key: float(line.split()[-2]) for key, line in table.items()}
    ratios = {key: float(line.split()[-1].rstrip("x")) for key, line in table.items()}
    assert ratios["plain"] == 1.0
    # The ratio is printed to one decimal and the times to two: both round.
    rounding = 0.05 + ratios["fast"] * 0.005 * (1 / milliseconds["plain"] + 1 / milliseconds["fast"]) + 1e-9
    assert ratios["fast"] == pytest.approx(milliseconds["fast"] / milliseconds["plain"], abs=rounding)
    assert f"Cockpit 1.0.2 takes {milliseconds['original'] / milliseconds['fast']:.1f}x" in process.stdout
    assert ["log:", str(out / "cockpit.json")] in rows
    assert f"tensorboard --logdir {out / 'tensorboard'}  (the run 'run')" in process.stdout
    assert "Traceback" not in process.stderr


def test_demo_says_when_cockpit_is_not_installed(monkeypatch, capsys):
    from importlib import metadata

    from cockpit_fast import demo

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(demo.metadata, "version", not_installed)
    timed, why_not = demo.time_original_cockpit(build_model(), [], "economy", 1, torch.device("cpu"))
    assert timed is None
    assert why_not == "Cockpit is not installed (pip install cockpit-for-pytorch==1.0.2 to compare)"


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


@pytest.mark.parametrize("content", ["{bad", "[1, 2]", '{"a": 1}'], ids=["not json", "a list", "not per step"])
def test_plot_of_a_bad_log_is_a_one_line_error(tmp_path, capsys, content):
    log = tmp_path / "bad.json"
    log.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plot", str(log)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read the log" in err[0]


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
