"""Histograms, bin adaptation, GSNR, Hessian trace and the gradient tests against Cockpit 1.0.2."""

import numpy as np
import pytest
import torch

from cockpit_fast import quantities as fast_quantities
from distributed_training import train
from test_cockpit_core import MODELS, ROUTES, assert_same_output, one, side_by_side

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
    from cockpit_fast._step import BATCH_L2, DOT_MEAN_GRAD, Hist1d, StepContext

    every = lambda step: True  # noqa: E731
    tracked = [
        fast_quantities.GradHist1d(every),
        fast_quantities.GradHist1d(every),
        fast_quantities.NormTest(every),
        fast_quantities.OrthoTest(every),
    ]
    ctx = StepContext(0, [], {})
    for q in tracked:
        ctx.requests.update(q.statistics(ctx))
    assert ctx.requests == {Hist1d(100, (-2, 2)), BATCH_L2, DOT_MEAN_GRAD}


def test_route_choice():
    from backpack.extensions import BatchGrad

    from cockpit_fast._step import BATCH_L2, GRAD_BATCH, Hist1d, extensions_for
    from cockpit_fast.factors import CheckedBatchGrad, GradBatchFactors

    served = {BATCH_L2, Hist1d(3, (-1, 1))}
    assert [type(e) for e in extensions_for(served)] == [GradBatchFactors]
    assert [type(e) for e in extensions_for(served, "factors")] == [GradBatchFactors]
    assert [type(e) for e in extensions_for(served, "grad_batch")] == [CheckedBatchGrad]
    assert [type(e) for e in extensions_for(served | {GRAD_BATCH})] == [CheckedBatchGrad]
    with pytest.raises(ValueError, match=r"per_sample_route='factors' cannot compute \['grad_batch'\]"):
        extensions_for(served | {GRAD_BATCH}, "factors")
    with pytest.raises(ValueError, match="per_sample_route must be one of"):
        extensions_for(served, "ghost")
    assert extensions_for(served, user_extensions=[BatchGrad()]) == []  # computed anyway: read it
    assert extensions_for(set()) == []
