"""The factor route: every statistic of Linear and Conv2d layers equals the materialised route's."""

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import BatchGrad

from cockpit_fast import factors
from cockpit_fast.factors import CheckedBatchGrad
from cockpit_fast._step import (
    BATCH_L2,
    DOT_MEAN_GRAD,
    GRAD_ABS_MAX,
    STATISTIC_SOURCES,
    SUM_GRAD_SQUARED,
    Hist1d,
    Hist2d,
    Projection,
    StatisticsHook,
    StepContext,
)
from conftest import values_near_edges

# (layer, per-sample input shape): 2-d Linear inputs (outer products), extra input dimensions
# (Gram form for the norms where cheaper, chunks of samples otherwise), convolutions with
# stride, padding and dilation, and layers the factors do not cover (grad_batch instead).
LAYERS = {
    "linear": (lambda: torch.nn.Linear(7, 5), (7,)),
    "linear_no_bias": (lambda: torch.nn.Linear(9, 4, bias=False), (9,)),
    "linear_short_sequence": (lambda: torch.nn.Linear(7, 5), (2, 7)),
    "linear_long_sequence": (lambda: torch.nn.Linear(7, 5), (4, 3, 7)),
    "conv": (lambda: torch.nn.Conv2d(3, 4, 3), (3, 6, 7)),
    "conv_strided": (lambda: torch.nn.Conv2d(3, 4, (3, 2), stride=2, padding=1, dilation=(2, 1)), (3, 9, 8)),
    "conv_groups": (lambda: torch.nn.Conv2d(4, 6, 3, groups=2), (4, 6, 6)),
    "conv_same": (lambda: torch.nn.Conv2d(3, 4, 3, padding="same"), (3, 5, 5)),
    "conv_same_even": (lambda: torch.nn.Conv2d(3, 4, (2, 4), padding="same", dilation=(1, 2)), (3, 6, 7)),
    "conv_valid": (lambda: torch.nn.Conv2d(3, 4, 3, padding="valid"), (3, 5, 6)),
    "conv_reflect": (lambda: torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (3, 5, 6)),
    "conv_circular": (lambda: torch.nn.Conv2d(3, 4, 3, stride=2, padding=(1, 2), padding_mode="circular"), (3, 7, 6)),
    "conv_replicate": (lambda: torch.nn.Conv2d(3, 4, 2, padding=1, padding_mode="replicate", bias=False), (3, 5, 5)),
}
COVERED = set(LAYERS) - {"conv_groups"}


def materialising_twin(layer, inputs):
    """A layer BackPACK's BatchGrad gets right, with the same per-sample gradients: for a Conv2d
    padded as BackPACK cannot ('same', reflect, ...), a copy without padding fed the input
    padded the way torch's Conv2d pads it."""
    if not isinstance(layer, torch.nn.Conv2d) or factors.batch_grad_is_exact(layer):
        return layer, inputs
    twin = torch.nn.Conv2d(
        layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, 0, layer.dilation,
        bias=layer.bias is not None,
    ).to(layer.weight.dtype)
    twin.load_state_dict(layer.state_dict())
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    return extend(twin), torch.nn.functional.pad(inputs, layer._reversed_padding_repeated_twice, mode=mode)


def statistics_on(layer, inputs, extension, requests):
    """The hook's results for ``requests`` after one backward pass under ``extension``."""
    params = list(layer.parameters())
    ctx = StepContext(0, params, {})
    ctx.requests.update(requests)
    sources = []
    hook = StatisticsHook(ctx, STATISTIC_SOURCES)

    def spy(module):  # what the hook is handed, before it frees it
        sources.extend(type(getattr(p, extension.savefield, None)) for p in module.parameters())
        hook(module)

    layer.zero_grad()
    with backpack(extension, extension_hook=spy):
        (layer(inputs) ** 2).mean(0).sum().backward()  # a mean over samples, as a training loss
    assert all(not hasattr(p, extension.savefield) for p in params)  # freed by the hook
    return {s: ctx.per_param(s) for s in requests}, sources


def requests_for(grad_batches, params):
    """Every statistic kind, histogram ranges chosen so that some values are clamped."""
    n = grad_batches[0].shape[0]
    largest = max(float((n * g).abs().max()) for g in grad_batches)
    directions = [torch.randn_like(p) for p in params]
    projection = Projection("test", "random", lambda hot: directions[hot.index])
    hist1d = Hist1d(23, (-0.6 * largest, 0.5 * largest))
    hist2d = Hist2d((9, 7), ((-0.5 * largest, 0.7 * largest), (-0.3, 0.3)))
    return [BATCH_L2, SUM_GRAD_SQUARED, GRAD_ABS_MAX, DOT_MEAN_GRAD, projection, hist1d, hist2d]


@pytest.mark.parametrize("layer_name", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 6])
def test_factor_route_equals_materialised_route(layer_name, dtype, n, monkeypatch):
    monkeypatch.setattr(factors, "CHUNK_VALUES", 150)  # several chunks of samples per layer
    make, input_shape = LAYERS[layer_name]
    torch.manual_seed(n)
    layer = extend(make().to(dtype))
    inputs = torch.randn(n, *input_shape, dtype=dtype)
    params = list(layer.parameters())
    twin, twin_inputs = materialising_twin(layer, inputs)

    with backpack(BatchGrad()):
        (twin(twin_inputs) ** 2).mean(0).sum().backward()
    grad_batches = [p.grad_batch.clone() for p in twin.parameters()]
    for p in twin.parameters():
        del p.grad_batch
    requests = requests_for(grad_batches, params)

    materialised, _ = statistics_on(twin, twin_inputs, BatchGrad(), requests)
    # Forced where the layer has factors (forcing them elsewhere is an error, tested below).
    factored, sources = statistics_on(layer, inputs, factors.GradBatchFactors(force=layer_name in COVERED), requests)
    assert (factors.WeightFactors in sources) == (layer_name in COVERED)

    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    outer = layer_name in ("linear", "linear_no_bias")
    for statistic in requests:
        for i, (expected, actual) in enumerate(zip(materialised[statistic], factored[statistic])):
            if isinstance(statistic, (Hist1d, Hist2d)):
                if outer:  # the very products BackPACK forms: the same counts
                    assert torch.equal(actual, expected), (statistic, i)
                    continue
                assert actual.sum() == expected.sum()
                lo, hi = statistic.range if isinstance(statistic, Hist1d) else statistic.range[0]
                bins = statistic.bins if isinstance(statistic, Hist1d) else statistic.bins[0]
                near = values_near_edges(n * grad_batches[i], lo, hi, bins, tol=1e-3)
                assert (actual - expected).abs().sum() <= 2 * near, (statistic, i)
            else:
                torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-12, msg=f"{statistic} of parameter {i}")


def test_outer_product_route_forms_no_per_sample_gradient(monkeypatch):
    def no_chunks(self):
        raise AssertionError("a per-sample gradient was formed")

    monkeypatch.setattr(factors.WeightFactors, "chunks", no_chunks)
    layer = extend(torch.nn.Linear(30, 20))
    inputs = torch.randn(16, 30)
    params = list(layer.parameters())
    requests = requests_for([torch.ones(16, 1)], params)
    values, sources = statistics_on(layer, inputs, factors.GradBatchFactors(), requests)
    assert sources[0] is factors.WeightFactors  # the weight; the bias keeps its (N, out) grad_batch
    assert values[BATCH_L2][0].shape == (16,)


def test_chunks_bound_what_is_formed_at_once(monkeypatch):
    monkeypatch.setattr(factors, "CHUNK_VALUES", 100)
    a, delta = torch.randn(10, 3, 7), torch.randn(10, 3, 5)
    weight_factors = factors.WeightFactors(a, delta, torch.Size([5, 7]))
    chunks = list(weight_factors.chunks())
    assert [c.shape[0] for c in chunks] == [2, 2, 2, 2, 2]
    torch.testing.assert_close(torch.cat(chunks), torch.einsum("nto,nti->noi", delta, a))


@pytest.mark.parametrize(
    "make, input_shape, factored",
    [
        (lambda: torch.nn.Linear(30, 20), (30,), True),  # one outer product per sample
        (lambda: torch.nn.Linear(30, 20), (3, 30), True),  # 3 * (20 + 30) < 20 * 30
        (lambda: torch.nn.Linear(4, 3), (5, 4), False),  # 5 * (3 + 4) > 3 * 4
        (lambda: torch.nn.Conv2d(64, 64, 3), (64, 6, 6), True),  # 16 positions, 576 inputs
        (lambda: torch.nn.Conv2d(3, 16, 3, padding=1), (3, 32, 32), False),  # 1024 positions
    ],
    ids=["linear", "linear-short-sequence", "linear-long-sequence", "conv-deep", "conv-wide"],
)
def test_factors_only_where_they_pay_unless_forced(make, input_shape, factored):
    layer = extend(make())
    inputs = torch.randn(2, *input_shape)
    _, chosen = statistics_on(layer, inputs, factors.GradBatchFactors(), [BATCH_L2])
    _, forced = statistics_on(layer, inputs, factors.GradBatchFactors(force=True), [BATCH_L2])
    assert (chosen[0] is factors.WeightFactors) == factored
    assert forced[0] is factors.WeightFactors
    assert chosen[1] is not factors.WeightFactors  # the bias keeps its grad_batch


@pytest.mark.parametrize("layer_name", ["conv_same", "conv_same_even", "conv_reflect", "conv_circular", "conv_replicate"])
def test_padded_convolutions_per_sample_gradients_sum_to_the_gradient(layer_name):
    # Independent of BackPACK: the factors' per-sample gradients add up to autograd's gradient.
    make, input_shape = LAYERS[layer_name]
    torch.manual_seed(0)
    layer = extend(make().double())
    with backpack(factors.GradBatchFactors()):  # 'auto' too takes factors where BatchGrad errs
        (layer(torch.randn(5, *input_shape, dtype=torch.float64)) ** 2).mean(0).sum().backward()
    weight_factors = layer.weight.grad_batch_factors
    assert isinstance(weight_factors, factors.WeightFactors)
    torch.testing.assert_close(torch.cat(list(weight_factors.chunks())).sum(0), layer.weight.grad)


@pytest.mark.parametrize("layer_name", ["conv_same", "conv_reflect"])
def test_materialising_such_a_convolution_is_a_clear_error(layer_name):
    make, input_shape = LAYERS[layer_name]
    layer = extend(make())
    with pytest.raises(ValueError, match="BackPACK's BatchGrad gives wrong per-sample gradients .* use per_sample_route='auto'"):
        statistics_on(layer, torch.randn(2, *input_shape), CheckedBatchGrad(), [BATCH_L2])


def test_forcing_factors_on_a_grouped_convolution_is_a_clear_error():
    make, input_shape = LAYERS["conv_groups"]
    layer = extend(make())
    with pytest.raises(ValueError, match="per_sample_route='factors': .* has no factored form"):
        statistics_on(layer, torch.randn(2, *input_shape), factors.GradBatchFactors(force=True), [BATCH_L2])
