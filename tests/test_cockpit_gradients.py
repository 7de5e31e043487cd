"""Histograms, bin adaptation, GSNR, Hessian trace and the gradient tests against Cockpit 1.0.2."""

import warnings

import numpy as np
import pytest
import torch
from backpack import extend

from cockpit_fast import Cockpit
from cockpit_fast import quantities as fast_quantities
from cockpit_fast.utils import schedules as fast_schedules
from cockpit_fast.utils.training import training_step
from distributed_training import train
from test_cockpit_core import MODELS, ROUTES, assert_same_output, cockpit, one, ref_schedules, side_by_side

# Histogram counts may differ by a few elements sitting on a bin edge, where N * g rounds
# differently inside the fused kernel than in Cockpit's scaled copy.
EDGE_COUNTS = 3


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize(
    "kwargs", [{}, {"bins": 7, "range": (-0.3, 0.5)}], ids=["default", "narrow"]
)
@pytest.mark.parametrize("route", ROUTES)
def test_hist1d_matches_cockpit(route, model_name, kwargs):
    expected, actual = side_by_side(one("GradHist1d", **kwargs), model_name, route=route)
    assert_same_output(actual, expected, max_count_diff=EDGE_COUNTS)


@pytest.mark.parametrize("adapt", ["GradAbsMax", "ParamAbsMax"])
@pytest.mark.parametrize("route", ROUTES)
def test_hist1d_bin_adaptation_matches_cockpit(route, adapt):
    def make(q, s):
        policy = getattr(q.bin_adaptation, adapt)(s.linear(2), padding=0.1)
        return [q.GradHist1d(s.linear(1), bins=9, adapt=policy)]

    expected, actual = side_by_side(make, "cnn", steps=4, route=route)
    assert_same_output(actual, expected, max_count_diff=EDGE_COUNTS)
    assert actual[3]["GradHist1d"]["edges"][0] != -2  # the range did move


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("keep_individual", [False, True])
@pytest.mark.parametrize("route", ROUTES)
def test_hist2d_matches_cockpit(route, model_name, keep_individual):
    expected, actual = side_by_side(
        one("GradHist2d", bins=(6, 5), range=((-0.5, 0.5), (-1, 1)), keep_individual=keep_individual),
        model_name,
        route=route,
    )
    assert_same_output(actual, expected, max_count_diff=EDGE_COUNTS)


@pytest.mark.parametrize("route", ROUTES)
def test_hist2d_per_axis_adaptation_matches_cockpit(route):
    def make(q, s):
        adapt = (q.bin_adaptation.GradAbsMax(s.linear(1)), q.bin_adaptation.ParamAbsMax(s.linear(2), padding=0.2))
        return [q.GradHist2d(s.linear(1), bins=(8, 4), adapt=adapt)]

    expected, actual = side_by_side(make, "mlp", steps=4, route=route)
    assert_same_output(actual, expected, max_count_diff=EDGE_COUNTS)


@pytest.mark.parametrize("route", ROUTES)
def test_histogram_counts_are_exact_past_float32(route):
    # 4099 samples x 4095 weights = 2^24 + 8189 values in the one bin: float32 would round them.
    config = {"model": "wide", "quantities": "one_bin", "steps": 1, "batch_size": 4099, "route": route}
    output = train(config)["output"][0]
    hist_1d, hist_2d = output["GradHist1d"]["hist"], output["GradHist2d"]["hist"]
    assert hist_1d.dtype == np.float64 and hist_1d.tolist() == [4099 * 4095]  # float, as Cockpit's
    assert hist_2d.dtype == np.int64 and hist_2d.tolist() == [[4099 * 4095]]


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("name", ["MeanGSNR", "NormTest", "InnerTest", "OrthoTest"])
@pytest.mark.parametrize("route", ROUTES)
def test_gradient_statistics_match_cockpit(route, name, model_name):
    expected, actual = side_by_side(one(name), model_name, route=route)
    assert_same_output(actual, expected, rtol=1e-4)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact", "diag_ggn_mc"])
def test_hess_trace_matches_cockpit(curvature, model_name):
    expected, actual = side_by_side(one("HessTrace", curvature=curvature), model_name, steps=2)
    assert_same_output(actual, expected, rtol=1e-4)


@pytest.mark.parametrize("name", ["HessTrace", "TICDiag", "TICTrace"])
def test_unknown_curvature_lists_the_options(name):
    with pytest.raises(KeyError, match="diag_h.*diag_ggn_exact.*diag_ggn_mc"):
        getattr(fast_quantities, name)(track_schedule=lambda step: True, curvature="diag_kfac")


def test_statistics_shared_by_quantities_are_computed_once():
    """GradHist1d twice with one setting and NormTest + OrthoTest share their statistics."""
    from cockpit_fast.statistics import BATCH_L2, DOT_MEAN_GRAD, Hist1d, StepPlan

    every = lambda step: True  # noqa: E731
    tracked = [
        fast_quantities.GradHist1d(every),
        fast_quantities.GradHist1d(every),
        fast_quantities.NormTest(every),
        fast_quantities.OrthoTest(every),
    ]
    plan = StepPlan(0, [], {}, quantities=tracked)
    assert plan.requests == {Hist1d(100, (-2, 2)), BATCH_L2, DOT_MEAN_GRAD}


def _spiked_run(cockpit_cls, q, s, make, route="auto"):
    """Four tracked steps of a Linear layer; on step 1 two inputs are ±1e37 (per-sample weight
    gradients of about 1e37) and a weight is 1e37 (its inputs are zero). Returns the output."""
    torch.manual_seed(0)
    model, loss_fn = extend(torch.nn.Linear(3, 2)), extend(torch.nn.CrossEntropyLoss())
    individual = torch.nn.CrossEntropyLoss(reduction="none")
    kwargs = {} if cockpit_cls is cockpit.Cockpit else {"per_sample_route": route}
    cp = cockpit_cls(model.parameters(), quantities=make(q, s), **kwargs)
    for step in range(4):
        x = torch.randn(4, 3)
        saved = model.weight.detach().clone()
        if step == 1:
            x[0, 0], x[1, 0], x[:, 1] = 1e37, -1e37, 0.0
            with torch.no_grad():
                model.weight[0, 1] = 1e37
        batch = x, torch.tensor([1, 0, 0, 1])
        training_step(
            model, None, batch, individual, loss_fn=loss_fn, cockpit=cp, step=step, drop_info=("individual_losses",)
        )
        with torch.no_grad():
            model.weight.copy_(saved)
    return cp.get_output()


@pytest.mark.parametrize("name", ["GradHist1d", "GradHist2d"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_gradient_spike_does_not_freeze_range_adaptation(route, name):
    """Cockpit adapts to ±1e37, which the ops cannot bin in float32: the range is narrowed to the
    widest they can, the step after the spike is counted, and the next one adapts back."""

    def make(q, s):
        every = s.linear(1)
        if name == "GradHist1d":
            return [q.GradHist1d(every, adapt=q.bin_adaptation.GradAbsMax(every))]
        adapt = (q.bin_adaptation.GradAbsMax(every), q.bin_adaptation.ParamAbsMax(every))
        return [q.GradHist2d(every, adapt=adapt)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _spiked_run(cockpit.Cockpit, cockpit.quantities, ref_schedules, make)
        actual = _spiked_run(Cockpit, fast_quantities, fast_schedules, make, route)
    for step in (0, 1, 3):
        assert_same_output(actual[step], expected[step], max_count_diff=EDGE_COUNTS)
    spiked, theirs = actual[2][name], expected[2][name]
    assert spiked["hist"].sum() == theirs["hist"].sum()
    edges = [spiked["edges"]] if name == "GradHist1d" else spiked["edges"]
    their_edges = [theirs["edges"]] if name == "GradHist1d" else theirs["edges"]
    for ours, cockpits in zip(edges, their_edges):
        assert cockpits[-1] == np.float32(1e37)
        assert 1e35 < ours[-1] < 1e37 and ours[0] == -ours[-1]


def test_adapted_ranges_are_those_the_ops_can_bin():
    from cockpit_fast._validation import check_range
    from cockpit_fast.quantities.bin_adaptation import _computable_end

    float32, float64 = {torch.float32}, {torch.float64}
    assert _computable_end(1.5, 100, float32) == 1.5
    assert _computable_end(1e37, 100, float64) == 1e37  # binned in float64
    for end, dtypes in [(1e37, float32), (float("inf"), float32), (1e37, float32 | float64), (0.0, float32)]:
        fitted = _computable_end(end, 100, dtypes)
        for dtype in dtypes:
            check_range("test", (-fitted, fitted), 100, dtype)
        with pytest.raises(ValueError, match="overflows or rounds to nothing|lo < hi"):  # the nearest end that fits
            check_range("test", (-np.nextafter(fitted, end), np.nextafter(fitted, end)), 100, torch.float32)
