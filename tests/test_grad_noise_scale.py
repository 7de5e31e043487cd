"""GradNoiseScale against McCandlish et al.'s estimates applied here to float64 per-sample
gradients from torch.func (tests/any_models.py): per step, per parameter, smoothed over steps,
with one sample, written to a log, and under torch.distributed."""

import json
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import any_models
from any_models import build, class_losses
from cockpit_fast import Cockpit, quantities
from cockpit_fast.utils.training import training_step
from test_any_model import _oracle

# vmap's notices of ops it batches by a loop, the engine's of parameters it takes the slower route for
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop", "ignore:.*whole-graph route")

N = 5
EVERY = staticmethod(lambda step: True)
TOLERANCE = {dtype: 16 * N * torch.finfo(dtype).eps for dtype in (torch.float64, torch.float32)}
"""Allowed error relative to the scale of the terms: sums over N samples, with room for the
rounding of float32 models' own forward and backward passes (a few eps seen)."""


def _mlp():
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, any_models.CLASSES))


def _mlp_batch(n, gen, dtype):
    return torch.randn(n, 6, generator=gen, dtype=dtype), torch.randint(0, any_models.CLASSES, (n,), generator=gen)


def _build(name, dtype, seed=0):
    """``(model, batch(n, gen), losses_of)`` as :func:`any_models.build` gives them, an MLP too."""
    if name != "mlp":
        return build(name, dtype, seed)
    torch.manual_seed(seed)
    return _mlp().to(dtype), (lambda n, gen: _mlp_batch(n, gen, dtype)), (lambda m, x, y: class_losses(m(x), y))


def _estimates(grads):
    """The estimates of one parameter's float64 per-sample gradients (N, *shape), from their
    definition: (tr Σ, |G|²) and the scales of their terms, which rounding errors are measured against."""
    g = grads.reshape(grads.shape[0], -1)
    n, mean = g.shape[0], g.mean(0)
    trace_sigma = ((g - mean) ** 2).sum() / (n - 1)
    grad_sq = (mean**2).sum() - trace_sigma / n
    trace_scale = (g**2).sum() / (n - 1)  # what sum_n |g_n|² − N |ḡ|² cancels down from
    return trace_sigma, grad_sq, trace_scale, (mean**2).sum() + trace_scale / n


def _assert_close(actual, expected, scale, dtype, what):
    assert abs(actual - float(expected)) <= TOLERANCE[dtype] * float(scale), (what, actual, float(expected))


def _assert_ratio_close(actual, numerator, denominator, numerator_scale, denominator_scale, dtype, what):
    """``actual`` against ``numerator / denominator`` with the errors of both propagated."""
    expected = float(numerator / denominator)
    error = TOLERANCE[dtype] * float((numerator_scale + abs(expected) * denominator_scale) / abs(denominator))
    assert abs(actual - expected) <= error, (what, actual, expected)


def _tracked_steps(name, dtype, batch_sizes, quantity):
    """Train with ``quantity`` over batches of ``batch_sizes`` (one per step); returns the
    cockpit and the oracle's per-parameter estimates of every step."""
    model, batch, losses_of = _build(name, dtype)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    cockpit = Cockpit(params, quantities=[quantity])
    gen = torch.Generator().manual_seed(1)
    oracle = []

    def individual(x):
        return lambda outputs, labels: losses_of(lambda _: outputs, x, labels)

    for step, n in enumerate(batch_sizes):
        x, y = batch(n, gen)
        oracle.append([_estimates(g) for g in _oracle(model, params, losses_of, x, y, {})] if n > 1 else None)
        training_step(model, opt, (x, y), individual(x), cockpit=cockpit, step=step)
    return cockpit, oracle


def _totals(per_param):
    return [sum(values) for values in zip(*per_param)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["mlp", "gpt_like", "residual_cnn"])
def test_estimates_match_the_oracle(name, dtype):
    cockpit, oracle = _tracked_steps(name, dtype, [N], quantities.GradNoiseScale(EVERY))
    output = cockpit.get_output()[0]["GradNoiseScale"]
    trace_sigma, grad_sq, trace_scale, grad_sq_scale = _totals(oracle[0])
    _assert_close(output["trace_sigma"], trace_sigma, trace_scale, dtype, "trace_sigma")
    _assert_close(output["grad_sq"], grad_sq, grad_sq_scale, dtype, "grad_sq")
    _assert_ratio_close(output["b_simple"], trace_sigma, grad_sq, trace_scale, grad_sq_scale, dtype, "b_simple")

    assert len(output["b_simple_per_param"]) == len(oracle[0]) == len(list(cockpit.params))
    for i, (t, g, t_scale, g_scale) in enumerate(oracle[0]):
        _assert_close(output["trace_sigma_per_param"][i], t, t_scale, dtype, f"trace_sigma of parameter {i}")
        _assert_close(output["grad_sq_per_param"][i], g, g_scale, dtype, f"grad_sq of parameter {i}")
        _assert_ratio_close(output["b_simple_per_param"][i], t, g, t_scale, g_scale, dtype, f"b_simple of parameter {i}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_moving_averages_over_three_tracked_steps_match_a_hand_computation(dtype):
    decay = 0.6
    # Step 1 is not tracked: the averages run over tracked steps.
    quantity = quantities.GradNoiseScale(lambda step: step != 1, decay=decay)
    cockpit, oracle = _tracked_steps("gpt_like", dtype, [N, N, 4, 6], quantity)
    output = cockpit.get_output()
    assert [step for step in sorted(output) if "GradNoiseScale" in output[step]] == [0, 2, 3]

    trace_average = grad_sq_average = 0.0
    for count, step in enumerate([0, 2, 3], start=1):
        trace_sigma, grad_sq, trace_scale, grad_sq_scale = _totals(oracle[step])
        trace_average = decay * trace_average + (1 - decay) * float(trace_sigma)
        grad_sq_average = decay * grad_sq_average + (1 - decay) * float(grad_sq)
        corrected_trace, corrected_grad_sq = trace_average / (1 - decay**count), grad_sq_average / (1 - decay**count)
        value = output[step]["GradNoiseScale"]
        _assert_close(value["trace_sigma_ema"], corrected_trace, trace_scale, dtype, f"trace_sigma_ema at {step}")
        _assert_close(value["grad_sq_ema"], corrected_grad_sq, grad_sq_scale, dtype, f"grad_sq_ema at {step}")
        _assert_ratio_close(
            value["b_simple_ema"], trace_average, grad_sq_average, trace_scale, grad_sq_scale, dtype, f"b_simple_ema at {step}"
        )
    # Smoothing changed something: the last average is not that step's own ratio.
    assert value["b_simple_ema"] != pytest.approx(value["b_simple"], rel=1e-3)


def test_steps_of_one_sample_are_skipped_with_one_warning():
    quantity = quantities.GradNoiseScale(EVERY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit, oracle = _tracked_steps("mlp", torch.float64, [1, 1, N], quantity)
    skipped = [w for w in caught if "GradNoiseScale needs at least 2 samples" in str(w.message)]
    assert len(skipped) == 1 and "first at step 0" in str(skipped[0].message)
    output = cockpit.get_output()
    assert [step for step in sorted(output) if "GradNoiseScale" in output[step]] == [2]
    # The skipped steps left the averages alone: the first step that counts is their only one.
    value = output[2]["GradNoiseScale"]
    trace_sigma, grad_sq, trace_scale, grad_sq_scale = _totals(oracle[2])
    _assert_close(value["trace_sigma_ema"], trace_sigma, trace_scale, torch.float64, "trace_sigma_ema")
    _assert_close(value["grad_sq_ema"], grad_sq, grad_sq_scale, torch.float64, "grad_sq_ema")
    assert value["b_simple_ema"] == pytest.approx(value["b_simple"], rel=1e-12)


def test_output_is_plain_and_written_as_strict_json(tmp_path):
    cockpit, _ = _tracked_steps("mlp", torch.float32, [N, N], quantities.GradNoiseScale(EVERY))
    output = cockpit.get_output()
    for step in (0, 1):
        value = output[step]["GradNoiseScale"]
        for key, entry in value.items():
            if key.endswith("_per_param"):
                assert isinstance(entry, list) and len(entry) == 4 and all(type(v) is float for v in entry), key
            else:
                assert type(entry) is float, key
    cockpit.write(str(tmp_path / "log"))

    def refuse(constant):
        raise AssertionError(f"the log holds {constant}, which is not JSON")

    written = json.loads((tmp_path / "log.json").read_text(), parse_constant=refuse)
    assert written["1"]["GradNoiseScale"] == output[1]["GradNoiseScale"]  # Python floats round-trip exactly


@pytest.mark.parametrize(
    "decay, error, message",
    [(1.0, ValueError, r"decay must be in \[0, 1\), got 1.0"), (-0.1, ValueError, "got -0.1"), ("0.9", TypeError, "got str")],
)
def test_decay_outside_its_range_is_refused(decay, error, message):
    with pytest.raises(error, match=message):
        quantities.GradNoiseScale(EVERY, decay=decay)


# torch.distributed: two gloo processes with 2 and 3 samples equal one process with all 5.

RANK_SIZES = [2, 3]


def _distributed_run(rank, rank_sizes):
    """Three tracked steps of the MLP on this rank's slice of each global batch; the output."""
    global_n, start = sum(rank_sizes), sum(rank_sizes[:rank])
    model, batch, losses_of = _build("mlp", torch.float64)
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.GradNoiseScale(EVERY, decay=0.5)])
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = batch(global_n, gen)
        x, y = x[start : start + rank_sizes[rank]], y[start : start + rank_sizes[rank]]
        training_step(model, None, (x, y), lambda out, labels: class_losses(out, labels), cockpit=cockpit, step=step)
    return {step: values["GradNoiseScale"] for step, values in cockpit.get_output().items()}


def _rank_main(rank, rank_sizes, workdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=len(rank_sizes))
    try:
        torch.save(_distributed_run(rank, rank_sizes), workdir / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_distributed_ranks_equal_one_process_on_the_global_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    expected = _distributed_run(0, [sum(RANK_SIZES)])
    mp.spawn(_rank_main, args=(RANK_SIZES, tmp_path), nprocs=len(RANK_SIZES), join=True)
    for rank in range(len(RANK_SIZES)):
        output = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert sorted(output) == [0, 1, 2]
        for step in range(3):
            for key, value in expected[step].items():
                assert output[step][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (rank, step, key)


def _micro_batch_run(sizes, estimator, seed=0):
    """One step of the MLP over micro-batches of ``sizes``, tracked by GradNoiseScale; returns its
    output and the float64 per-sample gradients of the batch (N, D) from torch.func."""
    model, batch, losses_of = _build("mlp", torch.float32, seed)
    x, y = batch(sum(sizes), torch.Generator().manual_seed(seed))
    cockpit = Cockpit(model.parameters(), quantities=[quantities.GradNoiseScale(EVERY, decay=0.0, estimator=estimator)])
    with cockpit(0, info={"batch_size": len(x)}) as tracked:
        for xm, ym in zip(x.split(sizes), y.split(sizes)):
            losses = losses_of(model, xm, ym)
            tracked.micro_batch(batch_size=len(xm))
            (losses.sum() / len(x)).backward()
    twin = _build("mlp", torch.float64, seed)[0]
    twin.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    g = torch.cat([part.reshape(len(x), -1) for part in any_models.oracle_grads(twin, list(twin.parameters()), losses_of, x.double(), y)], 1)
    return cockpit.get_output()[0]["GradNoiseScale"], g


@pytest.mark.parametrize("sizes", [[3, 5], [2, 2, 4], [1, 6, 1]])
def test_the_micro_batch_estimator_against_its_formula_on_float64_per_sample_gradients(sizes):
    output, g = _micro_batch_run(sizes, "micro_batches")
    n, k = g.shape[0], len(sizes)
    mean_sq = (g.mean(0) ** 2).sum()
    small = sum(len(part) * (part.mean(0) ** 2).sum() for part in g.split(sizes)) / n  # sum_m B_m |G_m|^2 / B
    trace_sigma = (small - mean_sq) * n / (k - 1)
    assert output["trace_sigma"] == pytest.approx(float(trace_sigma), rel=1e-4)
    assert output["grad_sq"] == pytest.approx(float(mean_sq - trace_sigma / n), rel=1e-4)


def test_the_micro_batch_estimator_with_one_sample_per_micro_batch_is_the_per_sample_one():
    sizes = [1] * 6
    micro, _ = _micro_batch_run(sizes, "micro_batches")
    per_sample, _ = _micro_batch_run(sizes, "per_sample")
    for key in ("trace_sigma", "grad_sq", "b_simple"):
        assert micro[key] == pytest.approx(per_sample[key], rel=1e-5)


def test_the_micro_batch_estimator_forms_no_per_sample_gradient_and_needs_the_sizes():
    quantity = quantities.GradNoiseScale(EVERY, estimator="micro_batches")
    cockpit = Cockpit(_mlp().parameters(), quantities=[quantity])
    assert cockpit._engine is None  # no module call is watched
    model = _mlp()
    cockpit = Cockpit(model.parameters(), quantities=[quantities.GradNoiseScale(EVERY, estimator="micro_batches")])
    x, y = _mlp_batch(4, torch.Generator().manual_seed(0), torch.float32)
    with pytest.raises(ValueError, match=r"needs each micro-batch's size"):
        with cockpit(0, info={"batch_size": 4}) as tracked:
            for xm, ym in zip(x.split(2), y.split(2)):
                tracked.micro_batch()
                (class_losses(model(xm), ym).sum() / 4).backward()
    with pytest.raises(ValueError, match=r"estimator must be one of"):
        quantities.GradNoiseScale(EVERY, estimator="ranks")
