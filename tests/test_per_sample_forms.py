"""The per-sample engine's forms and rules: closed forms equal the statistics of the formed
per-sample gradients, and every rule's per-sample gradients equal torch.func's."""

import pytest
import torch
from torch import nn

from cockpit_fast import per_sample
from cockpit_fast.statistics import (
    BATCH_L2, DOT_MEAN_GRAD, GRAD_ABS_MAX, GRAD_BATCH, SUM_GRAD_SQUARED, Hist1d, Hist2d, Projection, compute_statistics,
)
from cockpit_fast.per_sample import Capture, ConvGrads, DenseGrads, FactoredGrads, RowGrads, combine, stats_rows
from cockpit_fast.per_sample.grads import HookedGrads, SummedGrads, ZeroGrads
from conftest import values_near_edges

ROUTES = ["auto", "factors", "grad_batch"]


def _forms(dtype):
    gen = torch.Generator().manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    n = 6
    ids = torch.randint(0, 7, (n, 4), generator=gen)
    ids[0, :2] = 3  # a row looked up twice by one sample
    ids[1] = 0  # a sample that looks up only the padding row
    return {
        "outer": FactoredGrads(randn(n, 1, 5), randn(n, 1, 7), (5, 7)),
        "gram": FactoredGrads(randn(n, 3, 5), randn(n, 3, 7), (5, 7)),  # 3 * 12 < 35: pays
        "long": FactoredGrads(randn(n, 9, 3), randn(n, 9, 4), (3, 4)),  # 9 * 7 > 12: forms
        "rows": RowGrads.from_lookups(ids, randn(n, 4, 3), 7, skip=0),
        # Every sample looks up every row (twice): no entry is an untouched zero.
        "all_rows": RowGrads.from_lookups(torch.arange(4).repeat(n, 2), randn(n, 8, 3), 4),
        "summed": combine([FactoredGrads(randn(n, 2, 5), randn(n, 2, 7), (5, 7)), DenseGrads(randn(n, 5, 7))]),
        # Tied input and output embeddings: rows added into the head's factors.
        "tied": combine([RowGrads.from_lookups(ids, randn(n, 4, 3), 7), FactoredGrads(randn(n, 2, 7), randn(n, 2, 3), (7, 3))]),
        # Rows added into a dense part, which must stay as it was.
        "dense_rows": combine([RowGrads.from_lookups(ids, randn(n, 4, 3), 7), DenseGrads(randn(n, 7, 3))]),
        "joined": combine([FactoredGrads(randn(n, 1, 5), randn(n, 1, 7), (5, 7)), FactoredGrads(randn(n, 2, 5), randn(n, 2, 7), (5, 7))]),
        "hooked": HookedGrads(FactoredGrads(randn(n, 1, 5), randn(n, 1, 7), (5, 7)), [lambda g: g.clamp(-0.3, 0.3)]),
        "dense": DenseGrads(randn(n, 5, 7)),
        "conv": ConvGrads(randn(n, 2, 7, 6), randn(n, 4, 3, 4), (4, 2, 3, 3), (2, 1), (1, 1), 1),
        "conv_groups": ConvGrads(randn(n, 4, 6, 6), randn(n, 6, 4, 2), (6, 2, 3, 2), (1, 2), (1, 2), 2),
        "zeros": ZeroGrads(n, randn(4, 3, 2)),  # a parameter no backward pass of a micro-batch reached
    }


def _explicit(name, form):
    """The dense per-sample gradients, built the obvious way."""
    if isinstance(form, FactoredGrads):
        return torch.einsum("ntp,ntq->npq", form.left, form.right).reshape(-1, *form.shape)
    if isinstance(form, RowGrads):
        out = torch.zeros(form.batch_size, *form.shape, dtype=form.rows.dtype)
        for row, n, i in zip(form.rows, form.samples.tolist(), form.indices.tolist()):
            out[n, i] += row
        return out
    if isinstance(form, SummedGrads):
        return sum(_explicit(name, part) for part in form.parts)
    if isinstance(form, ConvGrads):  # each sample's weight gradient by autograd
        weight = torch.zeros(form.shape, dtype=form.input.dtype, requires_grad=True)
        grads = []
        for x, g in zip(form.input, form.output_grad):
            out = torch.nn.functional.conv2d(x[None], weight, None, form.stride, 0, form.dilation, form.groups)
            grads.append(torch.autograd.grad(out, weight, g[None])[0])
        return torch.stack(grads)
    if isinstance(form, HookedGrads):
        return _explicit(name, form.form).clamp(-0.3, 0.3)
    if isinstance(form, ZeroGrads):
        return torch.zeros(form.batch_size, *form.shape, dtype=form.zero.dtype)
    return form.values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(_forms(torch.float64)))
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("sum_grad_squared", [True, False], ids=["with_sum_grad_squared", "without"])
@pytest.mark.parametrize("kept", [False, True], ids=["", "kept"])
def test_every_statistic_of_every_form_equals_the_formed_gradients(name, route, dtype, sum_grad_squared, kept, monkeypatch):
    """Also with the gradients kept (Alpha's, from the formed chunks where the form does not pay
    to keep): each chunk kept as it was formed, not in memory a later chunk took."""
    monkeypatch.setattr(per_sample.grads, "CHUNK_VALUES", 80)  # several chunks of samples
    form = _forms(dtype)[name]
    dense = _explicit(name, form)
    torch.testing.assert_close(form.dense(), dense)
    n = form.batch_size
    param = torch.randn(form.shape, dtype=dtype)
    direction = torch.randn(form.shape, dtype=dtype)
    largest = float((n * dense).abs().max()) or 1.0
    hist1d, hist2d = Hist1d(13, (-0.6 * largest, 0.5 * largest)), Hist2d((5, 4), ((-0.5 * largest, 0.7 * largest), (-1, 1)))
    requests = {BATCH_L2, SUM_GRAD_SQUARED, GRAD_ABS_MAX, DOT_MEAN_GRAD, Projection("test", "d", lambda hot: direction), hist1d, hist2d}
    if not sum_grad_squared:  # the squared norms then come with the histogram and the dot products
        requests.remove(SUM_GRAD_SQUARED)
    if kept:
        requests.add(GRAD_BATCH)
    values = compute_statistics(0, param, form, requests, route=route)
    reference = compute_statistics(0, param, DenseGrads(dense), requests, route="grad_batch")
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    for statistic in requests:
        actual, expected = values[statistic], reference[statistic]
        if statistic is GRAD_BATCH:  # what is kept: its products with a later direction
            actual, expected = actual.dot(direction), expected.dot(direction)
        if isinstance(statistic, (Hist1d, Hist2d)):
            assert actual.sum() == expected.sum()
            lo, hi = statistic.range if isinstance(statistic, Hist1d) else statistic.range[0]
            bins = statistic.bins if isinstance(statistic, Hist1d) else statistic.bins[0]
            assert (actual - expected).abs().sum() <= 2 * values_near_edges(n * dense, lo, hi, bins, tol=1e-3), statistic
        else:
            # Sums in another order: to the rounding of the largest value.
            atol = rtol * float(expected.abs().max()) + 1e-12
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=repr(statistic))
    rows = stats_rows(form, [1.0, 3.0])
    torch.testing.assert_close(rows, stats_rows(DenseGrads(dense), [1.0, 3.0]), rtol=rtol, atol=1e-12)
    row_dots = form.row_dots(direction)  # closed forms only: the factored ones whose rows are the left factor's
    assert (row_dots is not None) == (isinstance(form, FactoredGrads) and form.shape[0] == form.left_size or name == "zeros")
    if row_dots is not None:
        expected = (dense * direction).flatten(2).sum(2)
        torch.testing.assert_close(row_dots, expected, rtol=rtol, atol=rtol * float(expected.abs().max()) + 1e-12)


def test_summed_forms_leave_their_parts_unchanged():
    form = _forms(torch.float64)["dense_rows"]
    dense_part = next(part for part in form.parts if isinstance(part, DenseGrads))
    before = dense_part.values.clone()
    first = form.dense()
    torch.testing.assert_close(form.dense(), first, rtol=0, atol=0)
    torch.testing.assert_close(dense_part.values, before, rtol=0, atol=0)


def test_outer_products_form_no_per_sample_gradient(monkeypatch):
    def formed(*args):
        raise AssertionError("a per-sample gradient was formed")

    form = _forms(torch.float32)["outer"]
    monkeypatch.setattr(FactoredGrads, "dense_range", formed)
    requests = {BATCH_L2, SUM_GRAD_SQUARED, GRAD_ABS_MAX, DOT_MEAN_GRAD, Hist1d(5, (-1, 1)), Hist2d((3, 3), ((-1, 1), (-1, 1)))}
    compute_statistics(0, torch.randn(5, 7), form, requests)
    stats_rows(form, [2.0])


def test_chunks_bound_what_is_formed_at_once(monkeypatch):
    monkeypatch.setattr(per_sample.grads, "CHUNK_VALUES", 100)
    form = FactoredGrads(torch.randn(10, 3, 5), torch.randn(10, 3, 7), (5, 7))
    chunks = list(form.chunks())
    assert [c.shape[0] for c in chunks] == [2, 2, 2, 2, 2]
    torch.testing.assert_close(torch.cat(chunks), torch.einsum("nto,nti->noi", form.left, form.right))


@pytest.mark.parametrize("name", ["outer", "gram", "long", "dense"])
def test_chunks_formed_in_scratch_take_its_memory_in_turn(name):
    """Factors form each chunk in the memory of the one before (a new tensor each costs its pages'
    first touch); a form that forms nothing hands out its own values, which no chunk overwrites."""
    form = _forms(torch.float64)[name]
    before = [t.clone() for t in per_sample.grads.held_tensors(form)]
    scratch = per_sample.grads.Scratch()
    chunks = [(chunk.clone(), chunk.untyped_storage().data_ptr()) for chunk in form.chunks(size=2, scratch=scratch)]
    assert len(chunks) == 3
    torch.testing.assert_close(torch.cat([chunk for chunk, _ in chunks]), _explicit(name, form), rtol=0, atol=0)
    memory = {address for _, address in chunks}
    assert len(memory) == 1 if isinstance(form, FactoredGrads) else memory == {form.values.untyped_storage().data_ptr()}
    for kept, now in zip(before, per_sample.grads.held_tensors(form)):
        assert torch.equal(kept, now)


def test_chunks_of_a_replayed_call_bound_all_its_parameters(monkeypatch):
    class NoRule(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 5))
            self.b = nn.Parameter(torch.randn(5))

        def forward(self, x):
            return torch.tanh(x @ self.w) + self.b

    layer = NoRule()
    capture = Capture(list(layer.parameters()))
    capture.arm()
    layer(torch.randn(6, 4)).pow(2).sum().backward()
    bias = capture.disarm()[0][id(layer.b)]
    monkeypatch.setattr(per_sample.grads, "CHUNK_VALUES", 2 * 25)  # two samples of both parameters
    assert [chunk.shape for chunk in bias.chunks()] == [(2, 5)] * 3


class HFConv1D(nn.Module):
    """Hugging Face's Conv1D as it computes: x @ weight + bias, weight (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


per_sample.register_rule(HFConv1D)(per_sample.rules.hf_conv1d)

# (layer, per-sample input shape, whether a rule covers every parameter)
LAYERS = {
    "linear": (lambda: nn.Linear(7, 5), (7,), True),
    "linear_sequence": (lambda: nn.Linear(7, 5), (4, 3, 7), True),
    "hf_conv1d": (lambda: HFConv1D(5, 7), (3, 7), True),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2), (3, 11), True),
    "conv1d_circular": (lambda: nn.Conv1d(3, 4, 3, padding="same", padding_mode="circular"), (3, 8), True),
    "conv2d": (lambda: nn.Conv2d(3, 4, (3, 2), stride=2, padding=1, dilation=(2, 1)), (3, 9, 8), True),
    "conv2d_same": (lambda: nn.Conv2d(3, 4, (2, 4), padding="same", dilation=(1, 2)), (3, 6, 7), True),
    "conv2d_valid": (lambda: nn.Conv2d(3, 4, 3, padding="valid"), (3, 5, 6), True),
    "conv2d_reflect": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (3, 5, 6), True),
    "conv2d_replicate": (lambda: nn.Conv2d(3, 4, 2, padding=1, padding_mode="replicate", bias=False), (3, 5, 5), True),
    "conv2d_groups": (lambda: nn.Conv2d(4, 6, 3, groups=2, stride=(2, 1), padding=1), (4, 6, 6), True),
    "conv2d_depthwise": (lambda: nn.Conv2d(3, 6, 3, groups=3, padding=1, padding_mode="reflect"), (3, 5, 5), True),
    "conv2d_wide": (lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 12, 12), True),  # factors do not pay
    "conv2d_channels": (lambda: nn.Conv2d(8, 3, 3, padding=1, stride=2), (8, 9, 9), True),  # a group per sample
    "conv1d_wide": (lambda: nn.Conv1d(2, 3, 3, stride=2, dilation=2), (2, 40), True),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1), dilation=(2, 1, 1), padding=(1, 0, 1)), (2, 5, 4, 3), True),
    "conv3d_channels": (lambda: nn.Conv3d(8, 2, 2, padding=(1, 0, 0)), (8, 3, 3, 3), True),
    "layer_norm": (lambda: nn.LayerNorm((3, 4)), (2, 3, 4), True),
    "rms_norm": (lambda: nn.RMSNorm(4), (3, 4), True),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (4, 3, 3), True),
    "batch_norm_eval": (lambda: _eval_batch_norm(), (3, 5), True),
}


def _eval_batch_norm():
    layer = nn.BatchNorm1d(3)
    layer.running_mean.uniform_(-1, 1)
    layer.running_var.uniform_(0.5, 2)
    return layer.eval()


@pytest.mark.parametrize("name", list(LAYERS))
def test_rules_give_torch_func_per_sample_gradients(name):
    make, shape, by_rule = LAYERS[name]
    torch.manual_seed(0)
    layer = make().double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p))  # norms start at ones and zeros
    x = torch.randn(5, *shape, dtype=torch.float64)
    target = torch.randn_like(layer(x))
    params = list(layer.parameters())
    capture = Capture(params)
    loss = ((layer(x) - target) ** 2).flatten(1).sum(1).mean()
    capture.arm()
    loss.backward()
    forms, _ = capture.disarm()

    names = dict(layer.named_parameters())

    def one(p, xn, tn):
        out = torch.func.functional_call(layer, p, (xn[None],))
        return ((out - tn[None]) ** 2).sum() / x.shape[0]

    expected = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))({k: v.detach() for k, v in names.items()}, x, target)
    for key, p in names.items():
        form = forms[id(p)]
        assert isinstance(form, per_sample.generic.ModuleVjpGrads) != by_rule, key
        torch.testing.assert_close(form.dense(), expected[key], rtol=1e-10, atol=1e-12, msg=key)
        torch.testing.assert_close(form.grad, p.grad, rtol=1e-10, atol=1e-12, msg=key)


def test_convolutions_take_the_cheaper_form():
    def form_of(layer, x):
        capture = Capture(list(layer.parameters()))
        loss = layer(x).pow(2).sum()
        capture.arm()
        loss.backward()
        return capture.disarm()[0][id(layer.weight)]

    # Many positions: a grouped convolution's weight gradient, no unfolded input of every sample.
    assert isinstance(form_of(nn.Conv2d(3, 4, 3, padding=1), torch.randn(2, 3, 16, 16)), ConvGrads)
    # Few positions: factors smaller than the gradients.
    assert isinstance(form_of(nn.Conv2d(64, 8, 3), torch.randn(2, 64, 3, 3)), FactoredGrads)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_unfolded_input_equals_unfold(dims):
    from cockpit_fast.per_sample.rules import _unfolded

    gen = torch.Generator().manual_seed(dims)
    # A channel slice: strided, with a storage offset.
    x = torch.randn(3, 5, *[7 + i for i in range(dims)], generator=gen, dtype=torch.float64)[:, 1:4]
    kernel, dilation, stride = (3, 2, 2)[:dims], (1, 2, 1)[:dims], (2, 1, 3)[:dims]
    weight = torch.randn(4, 3, *kernel, generator=gen, dtype=torch.float64)
    conv = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[dims]
    expected = conv(x, weight, None, stride, 0, dilation).flatten(2)
    torch.testing.assert_close(weight.flatten(1) @ _unfolded(x, kernel, dilation, stride), expected)
    if dims == 2:
        torch.testing.assert_close(_unfolded(x, kernel, dilation, stride), torch.nn.functional.unfold(x, kernel, dilation, 0, stride))


def test_a_parameter_unfrozen_after_the_first_step_is_captured():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    capture = Capture(list(model.parameters()))
    for step in range(2):
        x = torch.randn(5, 3)
        capture.arm()
        model(x).pow(2).sum().backward()
        forms, _ = capture.disarm()
        assert (id(model[0].weight) in forms) == (step == 1)
        model[0].weight.requires_grad_(True)  # unfrozen for the second step


def test_embedding_rows_never_form_the_table():
    layer = nn.Embedding(1000, 4, padding_idx=0).double()
    ids = torch.randint(0, 1000, (6, 5))
    capture = Capture([layer.weight])
    loss = layer(ids).pow(2).sum((1, 2)).mean()
    capture.arm()
    loss.backward()
    form = capture.disarm()[0][id(layer.weight)]
    assert isinstance(form, RowGrads) and form.rows.shape[0] <= 30
    expected = torch.zeros(6, 1000, 4, dtype=torch.float64)
    for n in range(6):
        for i in ids[n].tolist():
            if i != 0:
                expected[n, i] += 2 * layer.weight[i].detach() / 6
    torch.testing.assert_close(form.dense(), expected)


@pytest.mark.parametrize("name", [name for name, form in _forms(torch.float32).items() if form.keepable])
def test_a_kept_form_read_back_from_a_checkpoint_gives_the_same_gradients(name, tmp_path):
    from cockpit_fast.per_sample.grads import Kept, ScaledGrads
    from cockpit_fast.quantities.quantity import plain_state, restored_state

    form = _forms(torch.float32)[name]
    for kept in (Kept.copied(form), Kept.copied(ScaledGrads(form, 0.5)), Kept.copied(SummedGrads([form, form]))):
        torch.save(plain_state(kept.state()), tmp_path / "kept.pt")
        restored = Kept.from_state(restored_state(torch.load(tmp_path / "kept.pt", weights_only=True)))
        [restored_form], [kept_form] = restored.forms, kept.forms
        assert type(restored_form) is type(kept_form) and restored_form.shape == form.shape
        torch.testing.assert_close(restored_form.dense(), kept_form.dense(), rtol=0, atol=0)
