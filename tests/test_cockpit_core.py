"""cockpit_fast's Cockpit against Cockpit 1.0.2: the class, its context, schedules, byproducts.

Also home of the side-by-side harness the other ``test_cockpit_*`` files import: the same model,
data and seed trained twice, once under each Cockpit, and the outputs compared.
"""

import json
import math
import re
import warnings

import numpy as np
import pytest
import torch
from backpack import extend
from backpack.extensions import BatchGrad

from cockpit_fast import quantities as fast_quantities
from cockpit_fast.cockpit import Cockpit as FastCockpit
from cockpit_fast.utils import schedules as fast_schedules
from cockpit_fast.utils.training import training_step

cockpit = pytest.importorskip("cockpit")
ref_schedules = pytest.importorskip("cockpit.utils.schedules")

BATCH_SIZE = 8
MODELS = ["mlp", "cnn", "sequence"]
# cockpit_fast's per-sample routes: factors where they pay and serve the step (the default),
# factors wherever possible, and BackPACK's materialised grad_batch. Quantities of per-sample
# gradients are checked on all three.
ROUTES = ["auto", "factors", "grad_batch"]


class _Branch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
        self.branch = torch.nn.Linear(10, 4)

    def forward(self, x):
        taken = (x[:, 0] > 0).to(x.dtype)
        if not taken.any():
            return self.trunk(x)  # the branch is not called: no backward pass reaches it
        return self.trunk(x) + self.branch(x) * taken[:, None]


def build_model(name):
    """A small model whose Linear layers see (N, in), conv + pooling, or (N, T, in) inputs."""
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
        input_shape = (10,)
    elif name == "cnn":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(2, 3, 3),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(3 * 3 * 3, 4),
        )
        input_shape = (2, 8, 8)
    elif name == "branch":  # a Linear branch that only the samples with a positive first feature take
        model = _Branch()
        input_shape = (10,)
    elif name == "wide":  # 63 x 65 = 4095 weights: a batch of 4099 has 2^24 + 8189 gradient values
        model = torch.nn.Sequential(torch.nn.Linear(63, 65, bias=False))
        input_shape = (63,)
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.Sigmoid(), torch.nn.Linear(5, 3), torch.nn.Flatten(), torch.nn.Linear(12, 4)
        )
        input_shape = (4, 6)
    return model, input_shape


def train(cockpit_cls, make_quantities, model_name, steps=3, optimizer="sgd", seed=0, drop_info=(), **cockpit_kwargs):
    """Train ``steps`` steps under a cockpit; return its output (and the cockpit)."""
    torch.manual_seed(seed)
    model, input_shape = build_model(model_name)
    model = extend(model)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    elif optimizer == "momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cp = cockpit_cls(model.parameters(), quantities=make_quantities(), **cockpit_kwargs)
    data = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        inputs = torch.randn(BATCH_SIZE, *input_shape, generator=data)
        labels = torch.randint(0, 4, (BATCH_SIZE,), generator=data)
        batch = inputs, labels
        training_step(
            model, opt, batch, individual_loss_fn, loss_fn=loss_fn, cockpit=cp, step=step, drop_info=drop_info
        )
    return cp.get_output(), cp


def side_by_side(make, model_name, steps=3, optimizer="sgd", seed=0, route="auto"):
    """Outputs of Cockpit 1.0.2 and cockpit_fast (on ``route``) for ``make(quantities, schedules)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, _ = train(
            cockpit.Cockpit, lambda: make(cockpit.quantities, ref_schedules), model_name, steps, optimizer, seed
        )
        actual, _ = train(
            FastCockpit,
            lambda: make(fast_quantities, fast_schedules),
            model_name,
            steps,
            optimizer,
            seed,
            per_sample_route=route,
        )
    return expected, actual


def assert_same_output(actual, expected, rtol=1e-4, atol=1e-6, max_count_diff=0, path="output"):
    """Same structure and types; floats to tolerance; integer-valued arrays within a count budget."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        assert set(actual) == set(expected), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_same_output(actual[key], expected[key], rtol, atol, max_count_diff, f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_output(a, e, rtol, atol, max_count_diff, f"{path}[{i}]")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: {type(actual)}"
        assert actual.shape == expected.shape, path
        # Histogram counts are exact: float64 where Cockpit's 1D counts are float32 (README).
        exact_dtype = np.float64 if path.endswith("['hist']") and expected.dtype == np.float32 else expected.dtype
        assert actual.dtype == exact_dtype, path
        if path.endswith("['hist']"):
            assert actual.sum() == expected.sum(), path
            assert np.abs(actual - expected).sum() <= 2 * max_count_diff, f"{path}: counts differ"
        else:
            np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=path)
    elif expected is None:
        assert actual is None, path
    else:
        assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
        assert math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol), f"{path}: {actual} != {expected}"


def one(name, **kwargs):
    """A factory of the single quantity ``name``, tracked every step."""
    return lambda q, s: [getattr(q, name)(track_schedule=s.linear(1), **kwargs)]


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("name", ["Loss", "Parameters", "GradNorm", "Distance", "UpdateSize"])
def test_byproducts_match_cockpit(name, model_name):
    expected, actual = side_by_side(one(name), model_name)
    assert_same_output(actual, expected)


def test_time_is_tracked_on_the_schedule():
    actual, _ = train(FastCockpit, lambda: [fast_quantities.Time(fast_schedules.linear(2))], "mlp", steps=5)
    assert sorted(actual) == [0, 2, 4]
    times = [actual[step]["Time"] for step in (0, 2, 4)]
    assert all(isinstance(t, float) for t in times) and times == sorted(times)


def test_two_step_quantities_on_sparse_schedules():
    make = lambda q, s: [q.UpdateSize(s.linear(3, offset=1)), q.Distance(s.linear(2))]  # noqa: E731
    expected, actual = side_by_side(make, "mlp", steps=6)
    assert_same_output(actual, expected)


@pytest.mark.parametrize(
    "args", [(1, 0), (3, 0), (4, 2), (5, 7)], ids=["every", "every-3", "offset-2", "offset-past-interval"]
)
def test_linear_schedule_matches_cockpit(args):
    ours, theirs = fast_schedules.linear(*args), ref_schedules.linear(*args)
    assert [ours(s) for s in range(40)] == [theirs(s) for s in range(40)]


@pytest.mark.parametrize("args", [(0, 3, 20), (1, 2, 300, 10, False), (0, 4, 50, 2, True)])
def test_logarithmic_schedule_matches_cockpit(args):
    ours, theirs = fast_schedules.logarithmic(*args), ref_schedules.logarithmic(*args)
    assert [ours(s) for s in range(1200)] == [bool(theirs(s)) for s in range(1200)]


def test_parameter_without_requires_grad_is_rejected():
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        FastCockpit([frozen])


def test_only_quantities_can_be_added():
    with pytest.raises(ValueError, match="Quantity"):
        FastCockpit([torch.nn.Parameter(torch.ones(1))], quantities=[cockpit.quantities.Loss(fast_schedules.linear(1))])


def test_only_backpack_extensions_are_accepted():
    cp = FastCockpit([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="BackPACK extensions"):
        cp(0, "BatchGrad")


def test_missing_info_names_entry_and_quantity():
    make = lambda: [fast_quantities.MeanGSNR(fast_schedules.linear(1))]  # noqa: E731
    with pytest.raises(KeyError, match="MeanGSNR needs 'batch_size'"):
        train(FastCockpit, make, "mlp", drop_info=("batch_size",))


def test_non_scalar_loss_is_rejected():
    model = extend(torch.nn.Linear(3, 2))
    cp = FastCockpit(model.parameters(), quantities=[fast_quantities.Loss(fast_schedules.linear(1))])
    losses = model(torch.randn(4, 3)).sum(1)
    with pytest.raises(ValueError, match="scalar"):
        with cp(0, info={"loss": losses}):
            losses.sum().backward()


def test_buffers_are_freed_and_user_extensions_kept():
    """No BackPACK buffer outlives the step unless the user asked for it via *exts."""

    def run(user_exts):
        torch.manual_seed(0)
        model, shape = build_model("mlp")
        model = extend(model)
        loss_fn, individual = extend(torch.nn.CrossEntropyLoss()), torch.nn.CrossEntropyLoss(reduction="none")
        make = lambda q, s: [q.GradHist1d(s.linear(1)), q.NormTest(s.linear(1)), q.HessTrace(s.linear(1))]  # noqa
        cp = FastCockpit(model.parameters(), quantities=make(fast_quantities, fast_schedules))
        batch = torch.randn(4, *shape), torch.randint(0, 4, (4,))
        training_step(
            model, None, batch, individual, loss_fn=loss_fn, cockpit=cp, exts=user_exts, drop_info=("individual_losses",)
        )
        return model, cp.get_output()

    model, output = run(())
    for p in model.parameters():
        assert not {"grad_batch", "diag_h", "batch_l2", "sum_grad_squared"} & set(vars(p)), vars(p).keys()
    model, output_with_grad_batch = run((BatchGrad(),))
    for p in model.parameters():
        assert p.grad_batch.shape[0] == 4 and not hasattr(p, "diag_h")
    assert_same_output(output_with_grad_batch, output)


def test_full_configuration_leaves_nothing_on_the_parameters():
    from cockpit_fast.utils.configuration import configuration

    _, cp = train(FastCockpit, lambda: configuration("full"), "cnn", steps=2)
    for p in cp.params:
        assert set(vars(p)) <= {"grad"}, vars(p).keys()


def test_write_produces_cockpits_json_log(tmp_path):
    make = lambda q, s: [q.Loss(s.linear(1)), q.GradHist1d(s.linear(1)), q.GradNorm(s.linear(2))]  # noqa: E731
    outputs = []
    packages = [(cockpit.Cockpit, cockpit.quantities, ref_schedules), (FastCockpit, fast_quantities, fast_schedules)]
    for cls, q, s in packages:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, cp = train(cls, lambda: make(q, s), "mlp", steps=3)
        cp.log(2, 1, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.1)
        path = tmp_path / cls.__module__ / "log"
        cp.write(str(path))
        outputs.append(json.loads((path.parent / "log.json").read_text()))
    expected, actual = outputs
    assert actual.keys() == expected.keys()
    for step in expected:
        # Ours also gives the steps log() did not cover the optimizer's learning rate (for the dashboard).
        assert actual[step].keys() == expected[step].keys() | {"learning_rate"}
        hist_e, hist_a = expected[step]["GradHist1d"]["hist"], actual[step]["GradHist1d"]["hist"]
        assert hist_a.keys() == hist_e.keys() and (hist_e["dtype"], hist_a["dtype"]) == ("float32", "float64")
    assert actual["2"]["train_accuracy"] == 0.8
    assert actual["2"]["learning_rate"] == 0.1 and actual["0"]["learning_rate"] == 0.1  # log()'s; the optimizer's


def test_the_dashboard_reads_the_learning_rate_from_the_optimizer(tmp_path):
    from cockpit_fast.instruments.tracking_log import TrackingLog, read_output

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    cp = FastCockpit(model.parameters(), quantities=[fast_quantities.Loss(fast_schedules.linear(2))])
    for step in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.randn(6, 4)), torch.randint(0, 3, (6,)))
        with cp(step, info={"loss": loss, "optimizer": opt}):
            loss.backward()
        opt.step()
        scheduler.step()
    assert "learning_rate" not in cp.get_output()[0]  # get_output() stays Cockpit's
    cp.write(str(tmp_path / "log"))
    for source in (cp, str(tmp_path / "log")):
        steps, rates = TrackingLog(read_output(source)).series("learning_rate")
        assert list(steps) == [0, 2, 4] and list(rates) == pytest.approx([0.5, 0.125, 0.03125])
    assert sorted(cp._learning_rates) == [0, 2, 4]  # the untracked steps' are not kept


def test_memory_stays_flat_over_many_steps():
    """Caches are dropped as steps pass: nothing but the (small) results accumulates."""
    every = fast_schedules.linear(1)
    make = lambda: [fast_quantities.Alpha(every), fast_quantities.UpdateSize(every)]  # noqa: E731
    _, cp = train(FastCockpit, make, "mlp", steps=6, optimizer="adam")
    alpha, update_size = cp.quantities
    assert len(alpha._starts._entries) == 1 and len(update_size._start._entries) == 1


def test_values_on_the_cpu_become_output_as_the_run_goes(monkeypatch):
    """Few values wait as tensors (memory), and converting them early changes nothing."""
    make = lambda: [fast_quantities.GradNorm(fast_schedules.linear(1)), fast_quantities.Alpha(fast_schedules.linear(1))]  # noqa: E731
    expected, _ = train(FastCockpit, make, "mlp", steps=9)
    from cockpit_fast.quantities.quantity import FastQuantity

    waiting, store = [], FastQuantity._store
    monkeypatch.setattr(
        FastQuantity, "_store", lambda self, *args: (store(self, *args), waiting.append(len(self._pending)))
    )
    monkeypatch.setattr(FastCockpit, "CPU_OUTPUT_EVERY", 4)
    actual, _ = train(FastCockpit, make, "mlp", steps=9)
    assert max(waiting) == 4 and actual == expected


def leftover_buffers(model):
    """(parameter name, attribute) of what a step left on ``model``'s parameters besides grad."""
    return [(name, attr) for name, p in model.named_parameters() for attr in vars(p) if attr != "grad"]


def test_a_quantity_that_raises_leaves_no_buffers_behind():
    from cockpit_fast.utils.configuration import configuration

    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3)))
    loss_fn, individual = extend(torch.nn.CrossEntropyLoss()), torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cp = FastCockpit(model.parameters(), quantities=configuration("full"))
    batch = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with pytest.raises(KeyError, match="individual_losses"):  # Alpha needs them: no 'info' entry
        training_step(model, opt, batch, individual, loss_fn=loss_fn, cockpit=cp, drop_info=("individual_losses",))
    assert leftover_buffers(model) == []


def test_tracking_part_of_a_model_leaves_no_buffers_on_the_rest():
    from cockpit_fast.utils.configuration import configuration

    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3)))
    loss_fn, individual = extend(torch.nn.CrossEntropyLoss()), torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cp = FastCockpit(model[0].parameters(), quantities=configuration("full"))
    for step in range(2):
        batch = torch.randn(4, 5), torch.randint(0, 3, (4,))
        training_step(model, opt, batch, individual, loss_fn=loss_fn, cockpit=cp, step=step)
    assert leftover_buffers(model) == []


def _nan_loss_warnings(cockpit_cls, q, s):
    """Warnings of 2 tracked steps of NormTest (which does not read the loss) with a NaN loss."""
    torch.manual_seed(0)
    model, loss_fn = extend(torch.nn.Linear(5, 3)), extend(torch.nn.CrossEntropyLoss())
    cp = cockpit_cls(model.parameters(), quantities=[q.NormTest(s.linear(1))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            model.zero_grad()
            loss = loss_fn(model(torch.randn(4, 5)), torch.randint(0, 3, (4,)))
            with cp(step, info={"loss": loss * float("nan"), "batch_size": 4}):
                loss.backward()
        cp.get_output()
    return [str(w.message) for w in caught if "Mini-batch loss" in str(w.message)]


def test_a_nan_loss_is_warned_about_on_every_tracked_step_as_in_cockpit():
    expected = _nan_loss_warnings(cockpit.Cockpit, cockpit.quantities, ref_schedules)
    actual = _nan_loss_warnings(FastCockpit, fast_quantities, fast_schedules)
    assert len(expected) == 2 and len(actual) == 2
    for step, message in enumerate(actual):
        assert message.startswith(f"[Step {step}] Mini-batch loss is nan.")


@pytest.mark.parametrize("name", ["NormTest", "InnerTest", "OrthoTest"])
def test_a_variance_over_one_sample_skips_the_step_with_one_warning(name):
    # The last batch of an epoch may hold one sample: the run goes on (Cockpit 1.0.2 divides by zero).
    torch.manual_seed(0)
    model = extend(torch.nn.Linear(5, 3))
    loss_fn, individual = extend(torch.nn.CrossEntropyLoss()), torch.nn.CrossEntropyLoss(reduction="none")
    cp = FastCockpit(model.parameters(), quantities=[getattr(fast_quantities, name)(fast_schedules.linear(1))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, n in enumerate([1, 4, 1]):
            batch = torch.randn(n, 5), torch.randint(0, 3, (n,))
            training_step(model, None, batch, individual, loss_fn=loss_fn, cockpit=cp, step=step)
    said = [str(w.message) for w in caught if "needs at least 2 samples" in str(w.message)]
    assert said == [f"{name} needs at least 2 samples to estimate the gradient's variance: steps with 1 are skipped (first at step 0)"]
    output = cp.get_output()
    assert [step for step in sorted(output) if name in output[step]] == [1]
    assert np.isfinite(output[1][name])


@pytest.mark.parametrize("name", ["GradNorm", "Alpha", "CABS"])
def test_a_parameter_without_gradient_counts_as_zero_said_once(name):
    torch.manual_seed(0)
    model, unused = extend(torch.nn.Linear(5, 3)), torch.nn.Linear(5, 3)
    loss_fn, individual = extend(torch.nn.CrossEntropyLoss()), torch.nn.CrossEntropyLoss(reduction="none")
    batch = torch.randn(4, 5), torch.randint(0, 3, (4,))
    outputs = []
    for params in ([*model.parameters(), *unused.parameters()], list(model.parameters())):
        torch.manual_seed(1)
        for p, value in zip(model.parameters(), (torch.ones(3, 5) / 7, torch.zeros(3))):
            p.data.copy_(value)
        opt = torch.optim.SGD(params, lr=0.1)
        cp = FastCockpit(params, quantities=[getattr(fast_quantities, name)(fast_schedules.linear(1))])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                training_step(model, opt, batch, individual, loss_fn=loss_fn, cockpit=cp, step=step)
        said = [str(w.message) for w in caught if "got no gradient" in str(w.message)]
        assert len(said) == (0 if len(params) == 2 else 1)
        assert all(s.startswith("[Step 0]") and re.search(r"parameters? \[?2\b.*\b3\b", s) for s in said), said
        outputs.append(cp.get_output())
    with_unused, without = outputs
    for step in (0,) if name == "Alpha" else (0, 1):
        value = with_unused[step][name]
        expected = without[step][name]
        if name == "GradNorm":
            assert value[2:] == [0.0, 0.0]
            value = value[:2]
        assert value == pytest.approx(expected, rel=1e-6), step


def test_all_lists_the_quantities_as_cockpit_does():
    assert fast_quantities.__all__ == cockpit.quantities.__all__ + ["GradNoiseScale"]
    for name in fast_quantities.__all__:
        assert isinstance(getattr(fast_quantities, name)(fast_schedules.linear(1)), fast_quantities.FastQuantity)
    assert {"FastQuantity", "Quantity", "NoAdaptation", "GradAbsMax", "ParamAbsMax"} <= set(vars(fast_quantities))


def test_quantities_without_per_sample_statistics_leave_the_forward_pass_alone():
    from torch.nn.modules import module as torch_module

    model = torch.nn.Linear(3, 2)
    before = len(torch_module._global_forward_hooks)
    cheap = [getattr(fast_quantities, name)(fast_schedules.linear(1)) for name in ("Loss", "GradNorm", "Distance", "UpdateSize", "Time", "Parameters")]
    cp = FastCockpit(model.parameters(), quantities=cheap)
    assert len(torch_module._global_forward_hooks) == before
    cp.add(fast_quantities.NormTest(fast_schedules.linear(1)))  # watches the calls from now on
    assert len(torch_module._global_forward_hooks) == before + 1


def test_a_parameter_with_a_gradient_but_no_per_sample_gradients_is_an_error_not_zeros():
    # A tensor no module owns, read by a plain function, without the individual losses: its
    # gradient is not zero (a first version of the zero gradients counted it as zeros: NormTest
    # 0.44 for 0.62).
    torch.manual_seed(0)
    lin, w = torch.nn.Linear(4, 3).double(), torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    cockpit = FastCockpit([w, *lin.parameters()], quantities=[fast_quantities.NormTest(fast_schedules.linear(1))])
    loss = torch.nn.functional.cross_entropy(lin(torch.tanh(x @ w)), y)
    with pytest.raises(RuntimeError, match=r"batch_l2 was not computed for parameters \[0\]: the backward pass gave them a gradient"):
        with cockpit(0, info={"batch_size": 6, "loss": loss}):
            loss.backward()


def test_steps_no_quantity_tracks_say_nothing_of_parameters_without_gradient():
    # Every step in a `with` block (as the trainer callbacks open one): the warning comes with the
    # first step that computes something, naming what it counts as zeros.
    torch.manual_seed(0)
    model, unused = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    params = [*model.parameters(), *unused.parameters()]
    cockpit = FastCockpit(params, quantities=[fast_quantities.NormTest(lambda step: step == 2)])
    batch = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            training_step(model, torch.optim.SGD(params, lr=0.1), batch, torch.nn.CrossEntropyLoss(reduction="none"),
                          cockpit=cockpit, step=step)
    said = [str(w.message) for w in caught if "got no gradient" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("[Step 2]"), said
    assert sorted(cockpit.get_output()) == [2]
