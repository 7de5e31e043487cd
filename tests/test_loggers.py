"""The loggers for plain loops: what TensorBoard reads back from the event files, and W&B's calls.

A tiny MLP with named layers trains a few steps under the ``full`` configuration plus
GradNoiseScale (dict output) and Parameters (tensors, left out), logged after every step as a
plain loop would; the event files are read back with TensorBoard's EventAccumulator and compared
with ``cockpit.get_output()``. TensorBoard stores scalars as float32: they agree to its rounding.
"""

import math
import sys
import types
from collections import OrderedDict

import numpy as np
import pytest
import torch

from cockpit_fast import Cockpit, quantities
from cockpit_fast.loggers import TensorBoardLogger, WandbLogger
from cockpit_fast.quantities import GradNoiseScale, Parameters
from cockpit_fast.utils import schedules
from cockpit_fast.utils.configuration import configuration
from cockpit_fast.utils.training import training_step

backpack = pytest.importorskip("backpack")

STEPS = 4
BATCH_SIZE = 16
FLOAT32_ROUNDING = torch.finfo(torch.float32).eps  # a float64 stored as float32: relative error <= eps / 2


def tiny_model():
    return torch.nn.Sequential(
        OrderedDict(hidden=torch.nn.Linear(6, 5), act=torch.nn.ReLU(), out=torch.nn.Linear(5, 3))
    )


def train(steps, after_step=None):
    """``steps`` SGD steps of the tiny model under a cockpit; ``after_step(cockpit, step)`` after each."""
    torch.manual_seed(0)
    model = backpack.extend(tiny_model())
    every_step = schedules.linear(interval=1)
    quantities = configuration("full") + [GradNoiseScale(every_step), Parameters(every_step)]
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = backpack.extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    for step in range(steps):
        batch = torch.randn(BATCH_SIZE, 6), torch.randint(0, 3, (BATCH_SIZE,))
        training_step(
            model, optimizer, batch, individual_loss_fn, loss_fn=loss_fn, cockpit=cockpit, step=step, quiet=True
        )
        if after_step is not None:
            after_step(cockpit, step)
    return model, cockpit


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """The model, the cockpit and the events of a run logged after every step, then once more."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    log_dir = tmp_path_factory.mktemp("tensorboard") / "run"
    logger = TensorBoardLogger(log_dir)
    model, cockpit = train(STEPS, after_step=logger.log)
    logger.log(cockpit)  # Alpha and UpdateSize of the last step are still unknown: nothing new
    logger.close()
    events = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return model, cockpit, events


def scalar_series(events, tag):
    """``{step: value}`` of a scalar tag, asserting each step was written once."""
    steps = [event.step for event in events.Scalars(tag)]
    assert len(steps) == len(set(steps)), f"{tag} written twice at a step"
    return {event.step: event.value for event in events.Scalars(tag)}


def expected_series(output, name, pick=lambda value: value):
    return {step: pick(entry[name]) for step, entry in output.items() if entry.get(name) is not None}


def assert_float32_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for step, value in expected.items():
        assert actual[step] == pytest.approx(value, rel=FLOAT32_ROUNDING, abs=0), step


def test_scalars_under_cockpit_every_tracked_step(logged_run):
    _, cockpit, events = logged_run
    output = cockpit.get_output()
    for name in ("Loss", "Alpha", "NormTest", "InnerTest", "OrthoTest", "HessMaxEV", "TICDiag"):
        series = scalar_series(events, f"cockpit/{name}")
        assert_float32_equal(series, expected_series(output, name))
    # Alpha of a step is known one step later: the next call wrote it, the last step has none.
    assert sorted(scalar_series(events, "cockpit/Alpha")) == list(range(STEPS - 1))
    assert sorted(scalar_series(events, "cockpit/Loss")) == list(range(STEPS))


def test_per_parameter_values_are_tagged_with_the_models_names(logged_run):
    model, cockpit, events = logged_run
    output = cockpit.get_output()
    names = [name for name, _ in model.named_parameters()]
    assert names == ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
    for index, name in enumerate(names):
        for quantity in ("GradNorm", "Distance", "UpdateSize", "HessTrace"):
            series = scalar_series(events, f"cockpit/{quantity}/{name}")
            assert_float32_equal(series, expected_series(output, quantity, lambda values: values[index]))
        series = scalar_series(events, f"cockpit/GradNoiseScale/b_simple_per_param/{name}")
        expected = expected_series(output, "GradNoiseScale", lambda value: value["b_simple_per_param"][index])
        assert_float32_equal(series, expected)
    total = expected_series(output, "GradNorm", lambda norms: float(np.sqrt(np.sum(np.square(norms)))))
    assert_float32_equal(scalar_series(events, "cockpit/GradNorm/all"), total)
    b_simple = expected_series(output, "GradNoiseScale", lambda value: value["b_simple"])
    assert_float32_equal(scalar_series(events, "cockpit/GradNoiseScale/b_simple"), b_simple)
    assert not any("Parameters" in tag for tag in events.Tags()["scalars"])


def test_histograms_hold_the_cockpits_counts_and_edges(logged_run):
    model, cockpit, events = logged_run
    output = cockpit.get_output()
    elements = BATCH_SIZE * sum(p.numel() for p in model.parameters())  # one count per gradient element
    for tag, pick in (
        ("cockpit/GradHist1d", lambda entry: (entry["GradHist1d"]["hist"], entry["GradHist1d"]["edges"])),
        (
            "cockpit/GradHist2d/gradients",
            lambda entry: (entry["GradHist2d"]["hist"].sum(axis=1), entry["GradHist2d"]["edges"][0]),
        ),
    ):
        written = events.Histograms(tag)
        assert [event.step for event in written] == list(range(STEPS))
        for event in written:
            counts, edges = (np.asarray(array, dtype=np.float64) for array in pick(output[event.step]))
            histogram = event.histogram_value
            np.testing.assert_array_equal(histogram.bucket, counts)
            np.testing.assert_array_equal(histogram.bucket_limit, edges[1:])
            assert (histogram.min, histogram.max) == (edges[0], edges[-1])
            assert histogram.num == elements
        log_view = events.Histograms(f"{tag}/log10")[-1].histogram_value
        counts, _ = pick(output[STEPS - 1])
        expected = np.log10(1 + np.asarray(counts, dtype=np.float64))
        # torch's log10 against NumPy's: a few ulps apart at most.
        np.testing.assert_allclose(log_view.bucket, expected, rtol=4 * np.finfo(np.float64).eps)


def test_log_up_to_a_step_and_names_given(tmp_path):
    """``step`` bounds what is written; ``names`` replaces the model's; a writer handed in stays open."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from torch.utils.tensorboard import SummaryWriter

    _, cockpit = train(3)
    writer = SummaryWriter(log_dir=str(tmp_path))
    names = ["w1", "b1", "w2", "b2"]
    logger = TensorBoardLogger(writer, names=names)
    logger.log(cockpit, step=1)
    logger.close()
    writer.add_scalar("after", 1.0, 0)  # still open
    writer.close()
    events = event_accumulator.EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(scalar_series(events, "cockpit/Loss")) == [0, 1]
    assert {f"cockpit/GradNorm/{name}" for name in names} <= set(events.Tags()["scalars"])
    assert "after" in events.Tags()["scalars"]


def test_wrong_arguments_are_one_clear_error(tmp_path):
    _, cockpit = train(1)
    with pytest.raises(TypeError, match="log_dir must be a folder .* or a SummaryWriter, got int"):
        TensorBoardLogger(42)
    with pytest.raises(TypeError, match="names must be strings"):
        TensorBoardLogger(tmp_path, names=[0, 1, 2, 3])
    logger = TensorBoardLogger(tmp_path, names=["a", "b"])
    with pytest.raises(ValueError, match="names has 2 entries, the cockpit tracks 4 parameters"):
        logger.log(cockpit)
    logger.close()


class FakeWandb(types.ModuleType):
    """The part of ``wandb`` the logger calls: the active run, ``Histogram(np_histogram=...)``."""

    class Histogram:
        def __init__(self, np_histogram):
            self.np_histogram = np_histogram

    class Run:
        def __init__(self):
            self.metrics, self.records = [], []

        def define_metric(self, name, step_metric=None):
            self.metrics.append((name, step_metric))

        def log(self, record):
            self.records.append(record)

    def __init__(self):
        super().__init__("wandb")
        self.run = self.Run()


def test_wandb_logger_logs_each_step_against_the_cockpit_step(monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    _, cockpit = train(2)
    logger = WandbLogger(names=["w1", "b1", "w2", "b2"])
    logger.log(cockpit)
    output = cockpit.get_output()

    assert wandb.run.metrics == [("cockpit/step", None), ("cockpit/*", "cockpit/step")]
    assert [record["cockpit/step"] for record in wandb.run.records] == [0, 1]
    first = wandb.run.records[0]
    assert first["cockpit/Loss"] == output[0]["Loss"]
    assert first["cockpit/GradNorm/w2"] == output[0]["GradNorm"][2]
    assert first["cockpit/GradNorm/all"] == pytest.approx(math.hypot(*output[0]["GradNorm"]), rel=1e-15)
    histogram = first["cockpit/GradHist1d"]
    assert isinstance(histogram, FakeWandb.Histogram)
    np.testing.assert_array_equal(histogram.np_histogram[0], output[0]["GradHist1d"]["hist"])
    np.testing.assert_array_equal(histogram.np_histogram[1], output[0]["GradHist1d"]["edges"])
    logger.log(cockpit)  # nothing new
    assert len(wandb.run.records) == 2


def test_wandb_logger_without_wandb_or_a_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match="WandbLogger needs wandb, which is not installed: pip install wandb"):
        WandbLogger()
    wandb = FakeWandb()
    wandb.run = None
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    with pytest.raises(ValueError, match=r"no W&B run is active: call wandb.init\(\) first"):
        WandbLogger()


def test_the_output_by_parameter_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    every = lambda step: True  # noqa: E731
    cockpit = Cockpit(model.parameters(), quantities=[
        quantities.GradNorm(every), quantities.NormTest(every), quantities.GradNoiseScale(every)])
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    row, plain = cockpit.output_by_name()[0], cockpit.get_output()[0]
    assert list(row["GradNorm"]) == names
    assert [row["GradNorm"][name] for name in names] == list(plain["GradNorm"])
    assert [float(p.grad.norm()) for p in model.parameters()] == pytest.approx(list(row["GradNorm"].values()), rel=1e-5)
    assert list(row["GradNoiseScale"]["b_simple_per_param"]) == names
    assert row["NormTest"] == plain["NormTest"]
    assert isinstance(plain["GradNorm"], list)  # get_output() unchanged: Cockpit's format
    named = torch.nn.ModuleDict({"encoder": model})
    assert list(cockpit.output_by_name(named)[0]["GradNorm"]) == [f"encoder.{name}" for name in names]
