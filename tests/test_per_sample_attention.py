"""The rule of nn.MultiheadAttention (cockpit_fast/per_sample/attention.py): each projection's
per-sample gradients against float64 torch.func references in every call it covers (self- and
cross-attention, packed and separate projection weights, masks, causality, attention weights in
the loss, time first or batch first), and the calls it leaves to the generic route."""

import copy

import pytest
import torch
from torch import nn

from any_models import oracle_grads
from cockpit_fast.per_sample import Capture, FactoredGrads
from cockpit_fast.per_sample.attention import multihead_attention

N, L, S, E, HEADS = 3, 5, 4, 8, 2

CALLS = {  # name -> (layer keyword arguments, how the call is made)
    "self_batch_first": ({"batch_first": True}, "self"),
    "self_time_first_causal": ({}, "causal"),
    "cross_packed_key_padding": ({"batch_first": True}, "cross_padded"),
    "cross_separate_weights": ({"batch_first": True, "kdim": 6, "vdim": 7}, "cross"),
    "weights_in_the_loss_no_bias": ({"batch_first": True, "bias": False}, "weights"),
    "weights_per_head_time_first": ({}, "weights_per_head"),
}


class Attending(nn.Module):
    """One nn.MultiheadAttention called as ``how`` says, on ``(N, L, E)`` inputs (and ``(N, S,
    kdim)`` / ``(N, S, vdim)`` memories for cross-attention); returns its output batch first and
    its attention weights (or None)."""

    def __init__(self, how, **options):
        super().__init__()
        self.attention, self.how = nn.MultiheadAttention(E, HEADS, **options), how
        g = torch.Generator().manual_seed(3)
        self.register_buffer("keys", torch.randn(N, S, options.get("kdim", E), generator=g))
        self.register_buffer("values", torch.randn(N, S, options.get("vdim", E), generator=g))

    def forward(self, x):
        layer, how = self.attention, self.how
        batch_first = layer.batch_first
        seq = lambda t: t if batch_first else t.transpose(0, 1)  # noqa: E731
        if how in ("self", "causal", "weights", "weights_per_head"):
            q = seq(x)
            kwargs = {"need_weights": how.startswith("weights"), "average_attn_weights": how != "weights_per_head"}
            if how == "causal":
                kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L, dtype=x.dtype)
                kwargs["is_causal"] = True
            out, weights = layer(q, q, q, **kwargs)
        else:
            # The memories are a function of x: key and value carry each sample's own gradient.
            keys, values = seq(self.keys * x[:, :1, :1]), seq(self.values * x[:, :1, 1:2])
            padding = torch.tensor([[False] * S, [False] * (S - 1) + [True], [False, True] + [False] * (S - 2)])
            out, weights = layer(seq(x), keys, values, key_padding_mask=padding if how == "cross_padded" else None, need_weights=False)
        return seq(out), weights


def _losses(model, x):
    """Each sample's loss: its output through tanh, weighted at random, plus its attention weights' (if any)."""
    out, weights = model(x)
    g = torch.Generator().manual_seed(4)
    losses = (torch.tanh(out) * torch.randn(out.shape[1:], generator=g, dtype=torch.float64).to(out.dtype)).sum((1, 2))
    if weights is not None:
        losses = losses + (weights * torch.randn(weights.shape[1:], generator=g, dtype=torch.float64).to(out.dtype)).flatten(1).sum(1)
    return losses


def _problem(name, dtype):
    torch.manual_seed(0)
    options, how = CALLS[name]
    model = Attending(how, **options).to(dtype)
    x = torch.randn(N, L, E, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return model, x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(CALLS))
def test_per_sample_gradients_match_the_reference(name, dtype):
    model, x = _problem(name, dtype)
    params = dict(model.attention.named_parameters())
    twin = copy.deepcopy(model).double()
    twin_params = dict(twin.attention.named_parameters())
    expected = oracle_grads(twin, list(twin_params.values()), lambda m, inputs, _: _losses(m, inputs), x.double(), None)
    expected = dict(zip(twin_params, expected))

    capture = Capture(list(params.values()))
    losses = _losses(model, x)
    capture.arm()
    torch.autograd.grad(losses.sum(), list(params.values()))
    forms, _ = capture.disarm()
    assert set(params) == set(expected)
    for name_, p in params.items():
        form = forms[id(p)]
        assert isinstance(form, FactoredGrads) == (p.dim() == 2), name_
        got = form.dense()
        assert got.dtype == dtype and got.shape == expected[name_].shape, name_
        scale = float(expected[name_].abs().max())
        tolerance = 50 * torch.finfo(dtype).eps * max(scale, 1.0)  # a few products and a softmax
        torch.testing.assert_close(got.double(), expected[name_], rtol=0, atol=tolerance, msg=name_)


def test_calls_the_rule_does_not_cover_are_left_to_the_generic_route():
    x = torch.randn(N, L, E)
    grads = [torch.ones(N, L, E)]
    unbatched = nn.MultiheadAttention(E, HEADS)
    assert multihead_attention(unbatched, (x[0], x[0], x[0]), {}, None, [torch.ones(L, E)], 1) is None
    with_bias_kv = nn.MultiheadAttention(E, HEADS, add_bias_kv=True, batch_first=True)
    assert multihead_attention(with_bias_kv, (x, x, x), {}, None, grads, 0) is None
    dropping = nn.MultiheadAttention(E, HEADS, dropout=0.5, batch_first=True).train()
    assert multihead_attention(dropping, (x, x, x), {}, None, grads, 0) is None
    assert multihead_attention(dropping.eval(), (x, x, x), {}, None, grads, 0) is not None


def test_the_calls_outputs_are_kept_only_for_rules_that_read_them():
    # Attention weights (N, L, S) per call would otherwise live until the backward pass.
    model, x = _problem("weights_in_the_loss_no_bias", torch.float32)
    recurrent_layer = nn.GRU(E, 4, batch_first=True)
    capture = Capture([*model.parameters(), *recurrent_layer.parameters()])
    out, weights = model(x)
    states, _ = recurrent_layer(x)
    kept = {type(call.module): call.outputs for call in capture.recent}
    assert kept[nn.MultiheadAttention] is None
    assert [o.shape for o in kept[nn.GRU]] == [states.shape, torch.Size((1, N, 4))]
    del capture
