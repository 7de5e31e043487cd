"""A step accumulated over micro-batches (``tracked.micro_batch``): its statistics are those of the
union of the micro-batches, against one backward pass on that union and against float64
per-sample gradients from torch.func; micro-batches of equal and unequal sizes, the loss scaled
as users scale it, memory bounded, and the mistakes a hurried user makes."""

import copy
import warnings

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from any_models import flat, gradient_tests, oracle_grads
from cockpit_fast import Cockpit, quantities
from cockpit_fast.per_sample.grads import FactoredGrads
from cockpit_fast.utils.configuration import configuration

EVERY = staticmethod(lambda step: True)
FEATURES, CLASSES = 5, 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _batches(sizes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(n, FEATURES, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)) for n in sizes]
        for _ in range(steps)
    ]


def _weights(sizes, scaling):
    """Each sample's weight in the step's loss: its micro-batch's loss over its losses' sum."""
    total = sum(sizes)
    return torch.cat([torch.full((n,), 1 / total if scaling == "sum" else 1 / (len(sizes) * n)) for n in sizes])


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _accumulated(model, steps, scaling, tracked, hand_in_loss=True, size_at_entry=True, optimizer=_sgd, **kwargs):
    cockpit = Cockpit(list(model.parameters()), quantities=tracked(), **kwargs)
    opt = optimizer(model.parameters())
    for step, parts in enumerate(steps):
        total = sum(len(x) for x, _ in parts)
        opt.zero_grad()
        info = {"batch_size": total, "optimizer": opt} if size_at_entry else {"optimizer": opt}
        with cockpit(step, info=info) as micro:
            for x, y in parts:
                losses = F.cross_entropy(model(x), y, reduction="none")
                loss = losses.sum() / total if scaling == "sum" else losses.mean() / len(parts)
                micro.micro_batch(individual_losses=losses, loss=loss if hand_in_loss else None)
                loss.backward()
        opt.step()
    return cockpit


def _one_pass(model, steps, scaling, tracked, optimizer=_sgd):
    """The same steps as one backward pass on the union, each sample's loss weighted as the
    accumulated steps weigh it (their mean is the step's loss)."""
    cockpit = Cockpit(list(model.parameters()), quantities=tracked())
    opt = optimizer(model.parameters())
    for step, parts in enumerate(steps):
        sizes = [len(x) for x, _ in parts]
        x, y = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none") * (len(x) * _weights(sizes, scaling))
        loss = losses.mean()
        with cockpit(step, info={"batch_size": len(x), "optimizer": opt, "individual_losses": losses, "loss": loss}):
            loss.backward()
        opt.step()
    return cockpit


def _assert_same_output(actual, expected, rel=1e-5):
    assert actual.keys() == expected.keys()
    for step in expected:
        assert actual[step].keys() == expected[step].keys(), step
        for name, value in expected[step].items():
            _assert_close(actual[step][name], value, rel, f"{step} {name}")


def _assert_close(got, value, rel, path):
    """Values equal to ``rel``, item by item through dicts and lists of arrays of other lengths."""
    if isinstance(value, dict):
        assert got.keys() == value.keys(), path
        for key in value:
            _assert_close(got[key], value[key], rel, f"{path} {key}")
    elif value is None:
        assert got is None, path
    elif isinstance(value, (list, tuple)) and len({numpy.shape(v) for v in value}) > 1:
        assert len(got) == len(value), path
        for i, (g, v) in enumerate(zip(got, value)):
            _assert_close(g, v, rel, f"{path} [{i}]")
    else:
        numpy.testing.assert_allclose(numpy.asarray(got, dtype=float), numpy.asarray(value, dtype=float), rtol=rel, atol=1e-7, err_msg=path)


@pytest.mark.parametrize(
    "sizes, scaling",
    [([12], "sum"), ([6, 6], "mean"), ([6, 6], "sum"), ([5, 3, 4], "sum"), ([5, 3, 4], "mean"), ([7, 1], "sum")],
)
def test_economy_over_micro_batches_equals_one_backward_pass_on_their_union(sizes, scaling):
    steps = _batches(sizes, steps=3)
    tracked = lambda: configuration("economy", track_schedule=lambda step: True)  # noqa: E731
    accumulated = _accumulated(_model(), steps, scaling, tracked).get_output()
    one_pass = _one_pass(_model(), steps, scaling, tracked).get_output()
    _assert_same_output(accumulated, one_pass)
    assert {"Alpha", "InnerTest", "OrthoTest", "NormTest", "GradHist1d", "Loss"} <= set(accumulated[1])


@pytest.mark.parametrize("size_at_entry", [True, False], ids=["size at entry", "size at the end"])
def test_alpha_with_adam_over_micro_batches_equals_one_pass_and_keeps_each_ones_factors(size_at_entry):
    """With Adam, Alpha keeps a step's individual gradients until its update is known and projects
    them once the optimizer has stepped: once, whatever micro-batches the step had. It keeps each
    micro-batch's Linear factors as they are, not the step's gradients formed."""
    from cockpit_fast.quantities import alpha

    steps = _batches([5, 3, 4], steps=3)
    tracked = lambda: [quantities.Alpha(lambda step: True), quantities.GradHist1d(lambda step: True)]  # noqa: E731
    kept = []  # what the waiting starts keep when the accumulated run's optimizer is about to step

    def adam(params, record=False):
        opt = torch.optim.Adam(params, lr=0.05)
        if record:
            opt.register_step_pre_hook(lambda *_: kept.extend(start.grad_batch for start in alpha._WAITING))
        return opt

    accumulated = _accumulated(
        _model(), steps, "mean", tracked, size_at_entry=size_at_entry, optimizer=lambda params: adam(params, record=True)
    )
    one_pass = _one_pass(_model(), steps, "mean", tracked, optimizer=adam)
    expected = one_pass.get_output()
    assert [isinstance(expected[step]["Alpha"], float) for step in (0, 1)] == [True, True]
    _assert_same_output(accumulated.get_output(), expected)
    assert len(kept) == len(steps)
    weights = [i for i, p in enumerate(accumulated.params) if p.dim() == 2]
    for grad_batch in kept:
        for i in weights:
            assert [(type(f), f.batch_size) for f in grad_batch[i].forms] == [(FactoredGrads, n) for n in (5, 3, 4)]



@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_every_first_order_quantity_with_another_optimizer_than_sgd_equals_one_pass_in_float64(optimizer):
    """With an optimizer whose update is known only after its step, the quantities that read the
    update (Alpha, UpdateSize, Distance) take other paths than with plain SGD."""
    make = {"adam": lambda p: torch.optim.Adam(p, lr=0.05), "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)}[optimizer]
    every = lambda step: True  # noqa: E731
    curvatures = ("HessMaxEV", "HessTrace", "TICDiag")  # one backward pass only (a clear error otherwise)

    def tracked():
        full = [q for q in configuration("full", track_schedule=every) if type(q).__name__ not in curvatures]
        return full + [quantities.GradHist2d(every), quantities.GradNoiseScale(every), quantities.MeanGSNR(every)]

    steps = [[(x.double(), y) for x, y in parts] for parts in _batches([5, 3, 4], steps=3)]
    accumulated = _accumulated(_model().double(), steps, "sum", tracked, optimizer=make).get_output()
    expected = _one_pass(_model().double(), steps, "sum", tracked, optimizer=make).get_output()
    assert {"Alpha", "UpdateSize", "Distance", "GradNoiseScale", "GradHist2d", "MeanGSNR"} <= set(expected[1])
    _assert_same_output(accumulated, expected, rel=1e-9)


class _Branch(nn.Module):
    """A Linear layer whose branch only some samples take (``uses``: 1 or 0 per sample)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.branch = nn.Linear(FEATURES, CLASSES), nn.Linear(FEATURES, CLASSES)

    def forward(self, x, uses):
        if not uses.any():
            return self.trunk(x)  # the branch is not called: its backward pass never runs
        return self.trunk(x) + self.branch(x) * uses[:, None]


@pytest.mark.parametrize("taken_by", [(1, 0), (0, 1), (0, 1, 0)], ids=["first", "second", "middle of three"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_parameter_one_micro_batch_does_not_use_counts_its_samples_as_zeros(taken_by, optimizer):
    """A one-pass step counts the zero gradients of the samples that skip a branch (in the
    histograms, the per-sample norms and products); over micro-batches the same, where a
    micro-batch's backward pass does not reach the branch at all."""
    every = lambda step: True  # noqa: E731
    curvatures = ("HessMaxEV", "HessTrace", "TICDiag")

    def tracked():
        full = [q for q in configuration("full", track_schedule=every) if type(q).__name__ not in curvatures]
        return full + [quantities.GradHist2d(every), quantities.GradNoiseScale(every), quantities.MeanGSNR(every)]

    gen = torch.Generator().manual_seed(3)
    steps = [[(torch.randn(4, FEATURES, generator=gen, dtype=torch.float64), torch.randint(0, CLASSES, (4,), generator=gen))
              for _ in taken_by] for _ in range(3)]
    runs = {}
    for mode in ("accumulated", "one pass"):
        model = _Branch().double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd" else torch.optim.Adam(model.parameters(), lr=0.05)
        cockpit = Cockpit(list(model.parameters()), quantities=tracked())
        for step, parts in enumerate(steps):
            opt.zero_grad()
            uses = [torch.full((len(x),), float(taken), dtype=torch.float64) for (x, _), taken in zip(parts, taken_by)]
            if mode == "accumulated":
                with cockpit(step, info={"batch_size": 4 * len(parts), "optimizer": opt}) as micro:
                    for (x, y), used in zip(parts, uses):
                        losses = F.cross_entropy(model(x, used), y, reduction="none")
                        loss = losses.sum() / (4 * len(parts))
                        micro.micro_batch(individual_losses=losses, loss=loss)
                        loss.backward()
            else:
                x, y = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
                losses = F.cross_entropy(model(x, torch.cat(uses)), y, reduction="none")
                loss = losses.mean()
                with cockpit(step, info={"batch_size": len(x), "optimizer": opt, "individual_losses": losses, "loss": loss}):
                    loss.backward()
            opt.step()
        runs[mode] = cockpit.get_output()
    assert {"Alpha", "NormTest", "GradHist1d", "GradHist2d", "GradNoiseScale", "MeanGSNR"} <= set(runs["one pass"][1])
    _assert_same_output(runs["accumulated"], runs["one pass"], rel=1e-9)

class _Tokens(nn.Module):
    """Linear layers over positions: each sample's weight gradient is a sum of outer products
    (no closed-form histogram), so a histogram forms the per-sample gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.out = nn.Linear(FEATURES, 16), nn.Linear(16, CLASSES)

    def forward(self, x):
        positions = torch.stack([x, x.flip(1), x.roll(1, 1)], 1)  # (N, 3, FEATURES)
        return self.out(torch.tanh(self.inner(positions))).mean(1)


def test_a_single_pass_reads_its_dot_products_from_the_formed_gradients_equal_to_the_factors(monkeypatch):
    """A step of one backward pass knows its gradient when the pass ends: its dot products with
    it come out of the pass that forms the per-sample gradients for the histogram. Over micro-
    batches they wait for the step's gradient and come from the factors: the same numbers."""
    steps = _batches([6, 6], steps=2, seed=5)
    tracked = lambda: configuration("economy", track_schedule=lambda step: True)  # noqa: E731
    accumulated = _accumulated(_Tokens(), steps, "mean", tracked).get_output()
    factor_dots = []
    original = FactoredGrads.dot
    monkeypatch.setattr(FactoredGrads, "dot", lambda self, d: factor_dots.append(d) or original(self, d))
    one_pass = _one_pass(_Tokens(), steps, "mean", tracked).get_output()
    assert factor_dots == []
    _assert_same_output(one_pass, accumulated, rel=1e-4)
    assert {"InnerTest", "OrthoTest", "NormTest", "GradHist1d"} <= set(one_pass[1])


def test_economy_bins_a_layers_factors_over_positions_without_forming_its_gradients(monkeypatch):
    """A Linear layer over positions has no closed-form histogram: economy's histogram, norms and
    dot products come from its factors by the fused op, no per-sample gradient written to memory,
    and equal those of the formed gradients."""
    steps = _batches([12], steps=2, seed=6)
    tracked = lambda: configuration("economy", track_schedule=lambda step: True)  # noqa: E731
    with monkeypatch.context() as formed_route:
        formed_route.setattr(FactoredGrads, "binned_ranges", lambda *args: None)
        formed = _one_pass(_Tokens(), steps, "mean", tracked).get_output()

    def no_forming(*args):
        raise AssertionError("a per-sample gradient was formed")

    monkeypatch.setattr(FactoredGrads, "dense_range", no_forming)
    unformed = _one_pass(_Tokens(), steps, "mean", tracked).get_output()
    _assert_same_output(unformed, formed, rel=1e-5)
    assert {"InnerTest", "OrthoTest", "NormTest", "GradHist1d", "Alpha"} <= set(unformed[0]) | set(unformed[1])


@pytest.mark.parametrize("sizes, scaling", [([4, 4], "mean"), ([5, 2, 4], "sum"), ([5, 2, 4], "mean")])
def test_the_gradient_tests_match_float64_per_sample_gradients_of_the_union(sizes, scaling):
    steps = _batches(sizes, steps=1, seed=3)
    model = _model()
    twin = copy.deepcopy(model).double()
    tracked = lambda: [quantities.NormTest(EVERY), quantities.InnerTest(EVERY), quantities.OrthoTest(EVERY)]  # noqa: E731
    output = _accumulated(model, steps, scaling, tracked).get_output()[0]
    x, y = torch.cat([x for x, _ in steps[0]]), torch.cat([y for _, y in steps[0]])
    losses_of = lambda m, a, b: F.cross_entropy(m(a), b, reduction="none")  # noqa: E731
    g = flat(oracle_grads(twin, list(twin.parameters()), losses_of, x.double(), y))
    g = g * (len(x) * _weights(sizes, scaling).double())[:, None]  # each sample as the step weighs it
    for name, value in gradient_tests(g).items():
        assert output[name] == pytest.approx(value, rel=1e-4), name


def test_without_the_loss_each_micro_batch_is_taken_as_its_share_of_the_step():
    steps = _batches([5, 3, 4], steps=2, seed=4)
    tracked = lambda: [  # noqa: E731  (the step's loss is not known without the micro-batches')
        quantities.NormTest(EVERY), quantities.InnerTest(EVERY), quantities.OrthoTest(EVERY),
        quantities.GradHist1d(EVERY), quantities.GradNorm(EVERY), quantities.GradNoiseScale(EVERY),
    ]
    accumulated = _accumulated(_model(), steps, "sum", tracked, hand_in_loss=False).get_output()
    one_pass = _one_pass(_model(), steps, "sum", tracked).get_output()
    _assert_same_output(accumulated, one_pass)


def test_a_step_whose_batch_size_is_known_only_after_its_last_micro_batch():
    steps = _batches([5, 3, 4], steps=3, seed=5)
    tracked = lambda: configuration("economy", track_schedule=lambda step: True)  # noqa: E731
    accumulated = _accumulated(_model(), steps, "mean", tracked, size_at_entry=False).get_output()
    one_pass = _one_pass(_model(), steps, "mean", tracked).get_output()
    _assert_same_output(accumulated, one_pass)
    with pytest.warns(RuntimeWarning, match=r"InnerTest, NormTest skipped: .*batch size"):
        _accumulated(_model(), steps[:1], "mean", lambda: [quantities.InnerTest(EVERY), quantities.NormTest(EVERY)],
                     size_at_entry=False, max_kept_bytes=64)


def test_statistics_that_wait_for_the_steps_gradient_are_skipped_beyond_the_memory_bound():
    steps = _batches([6, 6], steps=1)
    tracked = lambda: [quantities.InnerTest(EVERY), quantities.NormTest(EVERY)]  # noqa: E731
    with pytest.warns(RuntimeWarning, match=r"InnerTest skipped: .*max_kept_bytes=64"):
        cockpit = _accumulated(_model(), steps, "mean", tracked, max_kept_bytes=64)
    output = cockpit.get_output()[0]
    assert "InnerTest" not in output and output["NormTest"] > 0
    roomy = _accumulated(_model(), steps, "mean", tracked, max_kept_bytes=2**30).get_output()[0]
    assert roomy["InnerTest"] > 0


def test_a_step_of_micro_batches_without_any_per_sample_statistic_reads_the_summed_gradient():
    steps = _batches([4, 4], steps=1)
    tracked = lambda: [quantities.GradNorm(EVERY), quantities.Distance(EVERY), quantities.UpdateSize(EVERY)]  # noqa: E731
    accumulated = _accumulated(_model(), steps, "mean", tracked).get_output()
    one_pass = _one_pass(_model(), steps, "mean", tracked).get_output()
    _assert_same_output(accumulated, one_pass)


def _micro_step(cockpit, model, parts, info, call_micro_batch=True):
    with cockpit(0, info=info) as micro:
        for x, y in parts:
            losses = F.cross_entropy(model(x), y, reduction="none")
            if call_micro_batch:
                micro.micro_batch(individual_losses=losses)
            (losses.sum() / 8).backward()


def test_the_mistakes_of_a_hurried_user_are_one_clear_error_each():
    model = _model()
    parts = _batches([4, 4], steps=1)[0]
    norm = lambda: Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])  # noqa: E731
    with pytest.raises(ValueError, match=r"2 backward passes ran for one step: for gradient accumulation, call tracked.micro_batch"):
        model.zero_grad()
        _micro_step(norm(), model, parts, {"batch_size": 8}, call_micro_batch=False)
    with pytest.raises(ValueError, match=r"micro_batch\(individual_losses=...\) needs the micro-batch's loss too"):
        model.zero_grad()
        _micro_step(norm(), model, parts, {})
    with pytest.raises(ValueError, match=r"info\['batch_size'\] is 10, but the step's micro-batches held 8 samples"):
        model.zero_grad()
        _micro_step(norm(), model, parts, {"batch_size": 10})
    with pytest.raises(ValueError, match=r"micro_batch\(individual_losses=...\) tells 3 samples, but the forward pass"):
        model.zero_grad()
        with norm()(0, info={"batch_size": 8}) as micro:
            losses = F.cross_entropy(model(parts[0][0]), parts[0][1], reduction="none")
            micro.micro_batch(individual_losses=losses[:3])
    with pytest.raises(ValueError, match=r"no backward pass reached the tracked parameters after micro_batch\(\): call tracked"):
        model.zero_grad()
        with norm()(0, info={"batch_size": 4}) as micro:
            micro.micro_batch(individual_losses=F.cross_entropy(model(parts[0][0]), parts[0][1], reduction="none"))
    late = r"micro_batch\(\) came after its micro-batch's backward pass .*: call tracked.micro_batch\(...\) after each"
    for checked in (False, True):  # the first step checks the model with a backward pass of its own
        cockpit = norm()
        if checked:
            model.zero_grad()
            _micro_step(cockpit, model, parts, {"batch_size": 8})
        with pytest.raises(ValueError, match=late):  # (checked: the first backward pass's statistics were taken)
            model.zero_grad()
            with cockpit(1, info={"batch_size": 8}) as micro:
                for x, y in parts:
                    losses = F.cross_entropy(model(x), y, reduction="none")
                    (losses.sum() / 8).backward()
                    micro.micro_batch(individual_losses=losses, loss=losses.sum() / 8)
    model.zero_grad()
    with norm()(0, info={"batch_size": 4}) as micro:
        F.cross_entropy(model(parts[0][0]), parts[0][1]).backward()
    with pytest.raises(ValueError, match=r"micro_batch\(\) starts a micro-batch inside"):
        micro.micro_batch()
    with pytest.raises(ValueError, match=r"hold gradients from before `with cockpit"):
        model.zero_grad()
        x, y = parts[0]
        F.cross_entropy(model(x), y).backward()  # the first micro-batch's backward pass, outside
        _micro_step(norm(), model, parts[1:], {"batch_size": 8})


def test_curvatures_are_not_combined_over_micro_batches_a_clear_error():
    model = _model()
    parts = _batches([4, 4], steps=1)[0]
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY), quantities.HessMaxEV(EVERY)])
    with pytest.raises(ValueError, match=r"HessMaxEV cannot be combined over micro-batches"):
        _micro_step(cockpit, model, parts, {"batch_size": 8})


@pytest.mark.filterwarnings("ignore:.*whole-graph route")
def test_a_forward_pass_before_the_block_that_needs_losses_gets_them_from_micro_batch():
    # A trainer's hooks open the step after the forward pass (Lightning): a batch norm in training
    # mode needs each sample's loss, which micro_batch() hands in before the backward pass.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Tanh(), nn.Linear(8, CLASSES))
    twin = copy.deepcopy(model).double()
    (x, y), = _batches([8], steps=1, seed=6)[0]
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, info={"batch_size": 8}) as tracked:
        tracked.micro_batch(individual_losses=losses, loss=losses.mean())
        losses.mean().backward()
    g = flat(oracle_grads(twin, list(twin.parameters()), lambda m, a, b: F.cross_entropy(m(a), b, reduction="none"), x.double(), y))
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-4)
    model.zero_grad()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(ValueError, match=r"need every sample's own loss"):
        with cockpit(1, info={"batch_size": 8}):
            losses.mean().backward()


@pytest.mark.parametrize("accumulated", [True, False])
def test_a_validation_forward_pass_whose_graph_is_kept_is_no_part_of_the_step(accumulated):
    # A forward pass with gradients on (validation without no_grad), its loss kept for logging,
    # of another size. Before: the accumulated step was refused at entry ("info['batch_size'] tells
    # 11 samples, but the forward pass ... had 3"); one pass took the whole graph, with a warning.
    sizes = [5, 2, 4] if accumulated else [11]
    (parts,) = _batches(sizes, steps=1, seed=7)
    model = _model()
    twin = copy.deepcopy(model).double()
    tracked = [quantities.NormTest(EVERY), quantities.InnerTest(EVERY), quantities.OrthoTest(EVERY)]
    cockpit = Cockpit(list(model.parameters()), quantities=tracked)
    kept = F.cross_entropy(model(torch.randn(3, FEATURES)), torch.randint(0, CLASSES, (3,)))  # noqa: F841
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if accumulated:
            with cockpit(0, info={"batch_size": 11}) as micro:
                for x, y in parts:
                    losses = F.cross_entropy(model(x), y, reduction="none")
                    micro.micro_batch(individual_losses=losses, loss=losses.sum() / 11)
                    (losses.sum() / 11).backward()
        else:
            ((x, y),) = parts
            losses = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(0, info={"batch_size": 11, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward()
    assert all(route.startswith("module-local") for route in cockpit.routes().values()), cockpit.routes()
    x, y = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
    losses_of = lambda m, a, b: F.cross_entropy(m(a), b, reduction="none")  # noqa: E731
    g = flat(oracle_grads(twin, list(twin.parameters()), losses_of, x.double(), y))
    for name, value in gradient_tests(g).items():
        assert cockpit.get_output()[0][name] == pytest.approx(value, rel=1e-4), name


def test_a_grad_scalers_scale_is_divided_out_of_every_micro_batch():
    steps = _batches([5, 3], steps=2, seed=8)
    tracked = lambda: [quantities.NormTest(EVERY), quantities.InnerTest(EVERY), quantities.GradHist1d(EVERY), quantities.GradNorm(EVERY)]  # noqa: E731
    outputs = []
    for scaled in (False, True):
        model = _model()
        cockpit = Cockpit(list(model.parameters()), quantities=tracked())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
        for step, parts in enumerate(steps):
            model.zero_grad()
            info = {"batch_size": 8, **({"grad_scaler": scaler} if scaled else {})}
            with cockpit(step, info=info) as micro:
                for x, y in parts:
                    losses = F.cross_entropy(model(x), y, reduction="none")
                    loss = losses.sum() / 8
                    micro.micro_batch(individual_losses=losses, loss=loss)  # the loss before scaling
                    (scaler.scale(loss) if scaled else loss).backward()
        outputs.append(cockpit.get_output())
    _assert_same_output(outputs[1], outputs[0], rel=1e-5)


def test_under_fsdp2_reading_a_parameter_some_rank_did_not_use_is_refused_alike_on_every_rank(monkeypatch):
    """Where a statistic reads the values of a sharded parameter that some micro-batch or rank did
    not reach, the ranks would have to gather it alone: every rank refuses alike (the decision
    is made from the sets every rank shares), none waits for the others."""
    import cockpit_fast.statistics as statistics

    monkeypatch.setattr(statistics, "is_sharded", lambda tensor: True)
    params = list(_model().parameters())
    hist2d = statistics.Hist2d((3, 3), ((-1, 1), (-1, 1)))
    for requests, anywhere, everywhere, refused in [
        ({hist2d}, {0, 1, 2, 3}, {0, 1}, True),
        ({hist2d}, {0, 1, 2, 3}, {0, 1, 2, 3}, False),  # every rank's every backward pass reached each
        ({statistics.BATCH_L2}, {0, 1, 2, 3}, {0, 1}, False),  # no statistic reads the values
    ]:
        stats = statistics.StepStatistics(params, requests, batch_size=8)
        if refused:
            with pytest.raises(ValueError, match=r"Hist2d.*read the values of tracked parameters \[2, 3\], sharded by FSDP2"):
                stats.agree(anywhere, everywhere, dropped=False)
        else:
            stats.agree(anywhere, everywhere, dropped=False)
