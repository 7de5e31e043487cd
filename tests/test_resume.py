"""Resume: a run restored from a checkpoint (model, optimizer and ``Cockpit.state_dict()``) goes on
exactly as the uninterrupted run, and a state dict is refused by a cockpit it does not fit."""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from cockpit_fast.cockpit import Cockpit
from cockpit_fast.quantities import Alpha, GradAbsMax, GradHist1d, GradHist2d, GradNoiseScale, ParamAbsMax
from cockpit_fast.quantities.quantity import ByproductQuantity, TwoStepQuantity
from cockpit_fast.utils import schedules
from cockpit_fast.utils.configuration import configuration
from cockpit_fast.utils.training import training_step

IN, HIDDEN, CLASSES, BATCH_SIZE = 5, 7, 3, 8
STEPS, SAVED_AFTER = 6, 3
individual_loss_fn = nn.CrossEntropyLoss(reduction="none")


class GradL2Squared(ByproductQuantity):
    """A quantity written on Cockpit's bare contract: its output is what the base class keeps."""

    def _compute(self, global_step, params, batch_loss):
        return self._fetch_grad_l2_squared(params, aggregate=True)


class UpdateNorm(TwoStepQuantity):
    """Cockpit's two-step contract: the norm of the update of step t, under step t."""

    SAVE_SHIFT = 1

    def extensions(self, global_step):
        return []

    def is_start(self, global_step):
        return self._track_schedule(global_step)

    def is_end(self, global_step):
        return self._track_schedule(global_step - 1)

    def _compute_start(self, global_step, params, batch_loss):
        copies = [p.detach().clone() for p in params]
        self.save_to_cache(global_step, "params", copies, lambda step: step <= global_step + 1)

    def _compute_end(self, global_step, params, batch_loss):
        start = self.load_from_cache(global_step - 1, "params")
        return torch.sqrt(sum(((p - s) ** 2).sum() for p, s in zip(params, start)))


def make_quantities():
    """``economy`` with its histogram's range adapted, and GradHist2d, GradNoiseScale and a
    quantity on Cockpit's contract."""
    every, even = schedules.linear(1), schedules.linear(2)  # ranges adapt after steps 0, 2, 4
    economy = [
        GradHist1d(every, bins=9, adapt=GradAbsMax(even, padding=0.1)) if isinstance(q, GradHist1d) else q
        for q in configuration("economy")
    ]
    hist2d = GradHist2d(every, bins=(6, 5), adapt=(GradAbsMax(even), ParamAbsMax(even)))
    return [*economy, hist2d, GradNoiseScale(every, decay=0.5), GradL2Squared(every)]


def make_run(optimizer_name, dtype, seed, hidden=HIDDEN, quantities=make_quantities):
    """A fresh model (weights from ``seed``), optimizer and cockpit."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES)).to(dtype)
    if optimizer_name == "sgd":  # plain SGD: Alpha keeps the update's projections only
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:  # Alpha keeps the parameters and individual gradients until the update is known
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer, Cockpit(model.parameters(), quantities=quantities())


def batches(dtype):
    data = torch.Generator().manual_seed(1)
    inputs = [torch.randn(BATCH_SIZE, IN, generator=data, dtype=dtype) for _ in range(STEPS)]
    return [(x, torch.randint(0, CLASSES, (BATCH_SIZE,), generator=data)) for x in inputs]


def train(run, data, steps):
    model, optimizer, cockpit = run
    for step in steps:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Alpha's notes on its fits
            _, loss, _ = training_step(model, optimizer, data[step], individual_loss_fn, cockpit=cockpit, step=step)
        if step % 2:  # what log() records is part of the log too
            cockpit.log(step, step // 2, loss.item(), None, None, None, None, None, np.float32(0.1))


def assert_identical(actual, expected, path="output"):
    """Same structure, same types, same values bit for bit (NaN where NaN)."""
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} vs {type(expected).__name__}"
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{path}: keys {sorted(actual)} vs {sorted(expected)}"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: lengths {len(actual)} vs {len(expected)}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{path}[{index}]")
    elif isinstance(expected, (np.ndarray, np.generic)):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert np.array_equal(actual, expected, equal_nan=expected.dtype.kind == "f"), path
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), path
    else:
        assert actual == expected, f"{path}: {actual!r} vs {expected!r}"


def tensors_in(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors_in(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from tensors_in(value)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_a_restored_run_goes_on_as_the_uninterrupted_one(tmp_path, optimizer_name, dtype):
    data = batches(dtype)
    uninterrupted = make_run(optimizer_name, dtype, seed=0)
    train(uninterrupted, data, range(STEPS))

    first = make_run(optimizer_name, dtype, seed=0)
    train(first, data, range(SAVED_AFTER))
    model, optimizer, cockpit = first
    state = cockpit.state_dict()
    own_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for tensor in tensors_in(state):  # a copy, on the CPU, sharing nothing with the live run
        assert tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() not in own_storages
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "cockpit": state}, path)
    del first, model, optimizer, cockpit, state

    resumed = make_run(optimizer_name, dtype, seed=1)  # other weights until the checkpoint is loaded
    checkpoint = torch.load(path, weights_only=True)  # plain types and tensors only
    model, optimizer, cockpit = resumed
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    cockpit.load_state_dict(checkpoint["cockpit"])
    train(resumed, data, range(SAVED_AFTER, STEPS))

    expected = uninterrupted[2].get_output()
    assert set(expected) == set(range(STEPS)) and len(expected[STEPS - 2]) == len(make_quantities())
    assert_identical(cockpit.get_output(), expected)
    uninterrupted[2].write(str(tmp_path / "uninterrupted"))
    cockpit.write(str(tmp_path / "resumed"))
    assert (tmp_path / "resumed.json").read_text() == (tmp_path / "uninterrupted.json").read_text()


def test_a_checkpoint_holds_the_rows_alpha_keeps_with_adam_not_the_formed_table(tmp_path):
    """With Adam, Alpha keeps a step's individual gradients until its update is known: an
    embedding's looked-up rows are saved as they are kept (formed: N x the table) and read back
    to the same numbers."""
    vocab, width, positions = 5000, 4, 3
    data = torch.Generator().manual_seed(1)
    steps = [(torch.randint(0, vocab, (BATCH_SIZE, positions), generator=data), torch.randint(0, CLASSES, (BATCH_SIZE,), generator=data)) for _ in range(4)]

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(vocab, width), nn.Flatten(), nn.Linear(positions * width, CLASSES))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, optimizer, Cockpit(model.parameters(), quantities=[Alpha(schedules.linear(1)), GradHist1d(schedules.linear(1))])

    def train_steps(run, steps_taken):
        for step in steps_taken:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Alpha's notes on its fits
                training_step(*run[:2], steps[step], individual_loss_fn, cockpit=run[2], step=step)

    uninterrupted, first = run(), run()
    train_steps(uninterrupted, range(4))
    train_steps(first, range(2))
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": first[0].state_dict(), "optimizer": first[1].state_dict(), "cockpit": first[2].state_dict()}, path)
    saved = sum(t.numel() * t.element_size() for t in tensors_in(torch.load(path, weights_only=True)["cockpit"]))
    table = vocab * width * 4  # 80 kB: the parameters kept, once; formed, the rows take N x that
    assert saved < 1.5 * table

    resumed = run()
    checkpoint = torch.load(path, weights_only=True)
    resumed[0].load_state_dict(checkpoint["model"])
    resumed[1].load_state_dict(checkpoint["optimizer"])
    resumed[2].load_state_dict(checkpoint["cockpit"])
    train_steps(resumed, range(2, 4))
    expected = uninterrupted[2].get_output()
    assert all(isinstance(expected[step]["Alpha"], float) for step in (1, 2))
    assert_identical(resumed[2].get_output(), expected)


def saved_state():
    run = make_run("sgd", torch.float64, seed=0)
    train(run, batches(torch.float64), range(2))
    return run[2].state_dict()


@pytest.mark.parametrize(
    "other, message",
    [
        (lambda: make_run("sgd", torch.float64, 0, quantities=lambda: configuration("economy"))[2],
         r"state holds the quantities \[.*'GradNoiseScale', 'GradL2Squared'\], this cockpit tracks \['Alpha'"),
        (lambda: make_run("sgd", torch.float64, 0, hidden=HIDDEN + 1)[2],
         r"parameter 0 has shape \(7, 5\) in state, \(8, 5\)"),
    ],
    ids=["other quantities", "other parameter shapes"],
)
def test_a_cockpit_the_state_does_not_fit_refuses_it(other, message):
    with pytest.raises(ValueError, match=message):
        other().load_state_dict(saved_state())


def test_a_state_dict_of_another_version_is_refused():
    state = saved_state()
    state["version"] += 1
    version = state["version"]
    with pytest.raises(ValueError, match=f"version {version}, this cockpit reads version {version - 1}"):
        make_run("sgd", torch.float64, 0)[2].load_state_dict(state)
    with pytest.raises(ValueError, match="with a 'version'"):
        make_run("sgd", torch.float64, 0)[2].load_state_dict({"quantities": []})


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_a_state_saved_after_a_step_that_raised_restores_and_goes_on(tmp_path, optimizer_name):
    # The step's Alpha kept its start before the `with` block raised (an interrupt, an exception a
    # trainer saves a checkpoint on): that start never saw its step, and is saved so.
    data = batches(torch.float64)
    whole = make_run(optimizer_name, torch.float64, seed=0)
    train(whole, data, range(STEPS))
    interrupted = make_run(optimizer_name, torch.float64, seed=0)
    train(interrupted, data, range(SAVED_AFTER))
    model, optimizer, cockpit = interrupted
    x, y = data[SAVED_AFTER]
    optimizer.zero_grad()
    losses = individual_loss_fn(model(x), y)
    with pytest.raises(KeyboardInterrupt):
        with cockpit(SAVED_AFTER, info={"batch_size": len(x), "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
            raise KeyboardInterrupt
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "cockpit": cockpit.state_dict()}
    torch.save(saved, tmp_path / "checkpoint.pt")
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    resumed = make_run(optimizer_name, torch.float64, seed=1)
    for part, state in zip(resumed, (checkpoint["model"], checkpoint["optimizer"], checkpoint["cockpit"])):
        part.load_state_dict(state)
    train(resumed, data, range(SAVED_AFTER, STEPS))
    expected, actual = whole[2].get_output(), resumed[2].get_output()
    assert sorted(actual) == sorted(expected)
    assert_identical(actual[SAVED_AFTER + 1], expected[SAVED_AFTER + 1])


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_a_state_holding_a_process_s_own_values_is_refused_by_another_process(optimizer_name):
    # (as another rank's state would read) Values of a process's own samples: Alpha's kept
    # individual gradients (not with plain SGD), the noise scale's averages of its micro-batches,
    # a quantity on Cockpit's contract (its batch and buffers).
    every = schedules.linear(1)
    own = lambda: [Alpha(every), GradNoiseScale(every, estimator="micro_batches"), GradL2Squared(every)]  # noqa: E731
    run = make_run(optimizer_name, torch.float64, seed=0, quantities=own)
    train(run, batches(torch.float64), range(2))
    state = run[2].state_dict()
    assert state["process"] == {"rank": 0, "world_size": 1}
    state["process"] = {"rank": 1, "world_size": 2}
    named = "Alpha, GradNoiseScale, GradL2Squared" if optimizer_name == "adam" else "GradNoiseScale, GradL2Squared"
    with pytest.raises(ValueError, match=rf"saved by process 1 of 2 and holds that process's own values \(of {named}:.*this is process 0 of 1"):
        make_run(optimizer_name, torch.float64, seed=0, quantities=own)[2].load_state_dict(state)
    # The noise scale from per-sample gradients, as every quantity of the global batch: any process's.
    shared = lambda: [Alpha(every), GradNoiseScale(every)]  # noqa: E731
    run = make_run("sgd", torch.float64, seed=0, quantities=shared)
    train(run, batches(torch.float64), range(2))
    state = {**run[2].state_dict(), "process": {"rank": 1, "world_size": 2}}
    make_run("sgd", torch.float64, seed=0, quantities=shared)[2].load_state_dict(state)


def test_a_state_dict_of_version_2_is_read():
    # Version 3 added the tags of each process's own values: a single process's version 2 has none.
    state = saved_state()
    state["version"] = 2
    del state["process"]
    fresh = make_run("sgd", torch.float64, 0)[2]
    fresh.load_state_dict(state)
    assert_identical(fresh.get_output(), make_run_output_after_two_steps())


def make_run_output_after_two_steps():
    run = make_run("sgd", torch.float64, seed=0)
    train(run, batches(torch.float64), range(2))
    return run[2].get_output()


def test_the_nan_losses_a_device_holds_back_are_reported_after_a_resume():
    """On a GPU the NaN-loss warning waits on the device until output is read (the CPU warns at
    once, so the watch's device state is set here as a device step leaves it)."""
    cockpit = make_run("sgd", torch.float64, 0)[2]
    cockpit._nan_loss._first, cockpit._nan_loss._count = torch.tensor(4), torch.tensor(3)
    restored = make_run("sgd", torch.float64, 0)[2]
    restored.load_state_dict(cockpit.state_dict())
    with pytest.warns(UserWarning, match=r"\[Step 4\] Mini-batch loss is nan \(and on 2 later tracked steps\)"):
        restored.get_output()


def test_a_two_step_quantity_with_values_cached_for_a_later_step_says_so():
    run = make_run("sgd", torch.float64, 0, quantities=lambda: [UpdateNorm(schedules.linear(1))])
    train(run, batches(torch.float64), range(1))
    with pytest.raises(RuntimeError, match=r"UpdateNorm holds values cached at steps \[0\]"):
        run[2].state_dict()


@pytest.mark.parametrize("made_otherwise", [
    lambda every: GradHist1d(every, bins=10),
    lambda every: GradHist1d(every, range=(-5, 5)),
    lambda every: GradHist2d(every, bins=(40, 20)),
], ids=["1d bins", "1d range", "2d bins"])
def test_a_state_restored_into_a_histogram_made_otherwise_is_refused(tmp_path, made_otherwise):
    # Before: accepted, the new bins over the saved range (10 bins over (-2, 2)), and nothing said.
    every = schedules.linear(1)
    model = nn.Sequential(nn.Linear(4, 3))
    saved = Cockpit(model.parameters(), quantities=[GradHist1d(every), GradHist2d(every)])
    torch.save(saved.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    Cockpit(model.parameters(), quantities=[GradHist1d(every), GradHist2d(every)]).load_state_dict(state)  # made alike
    quantities = [GradHist1d(every), GradHist2d(every)]
    index = 0 if isinstance(made_otherwise(every), GradHist1d) else 1
    quantities[index] = made_otherwise(every)
    refused = Cockpit(model.parameters(), quantities=quantities)
    with pytest.raises(ValueError, match=r"state holds a GradHist[12]d made with .*this cockpit's has"):
        refused.load_state_dict(state)
