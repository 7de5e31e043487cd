"""The per-sample engine's front door (cockpit_fast.per_sample.engine) where users meet it: mixed
precision and a GradScaler, the shapes of ``individual_losses``, empty batches, LoRA, two
cockpits, hooks, NaN, compiled models, info that disagrees with the forward pass, accumulation,
the routes it reports; against float64 per-sample gradients from torch.func."""

import contextlib
import copy
import gc
import sys
import threading
import warnings
import weakref

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune

from any_models import build, flat, gradient_tests, one_pass_per_sample, oracle_grads
from cockpit_fast import Cockpit, quantities
from cockpit_fast.gradient_metrics import GradientMetricCollector
from cockpit_fast.gradient_metrics import metrics as gm
from cockpit_fast.per_sample.capture import Call, outside_autocast
from cockpit_fast.utils.configuration import configuration
from cockpit_fast.utils.training import training_step

N = 6
EVERY = staticmethod(lambda step: True)


def _steps_of_norm_test(params, losses_of, steps=2):
    """A Cockpit's NormTest of ``params`` over ``steps`` steps (the first runs the checks, the
    later ones the routes alone), each on the losses ``losses_of(step)`` computes once the
    gradients are zeroed, its graph kept; each step's NormTest must be that of the per-sample
    gradients from a backward pass per sample. Returns the cockpit."""
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    for step in range(steps):
        for p in params:
            p.grad = None
        losses = losses_of(step)
        with cockpit(step, info={"batch_size": losses.shape[0], "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward(retain_graph=True)
        g = one_pass_per_sample(losses, params)
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-9), step
    return cockpit


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _oracle(model, x, y, params=None):
    twin = copy.deepcopy(model).double()
    names = {id(p): name for name, p in model.named_parameters()}
    twin_params = dict(twin.named_parameters())
    chosen = [twin_params[names[id(p)]] for p in (params or list(model.parameters()))]
    return flat(oracle_grads(twin, chosen, lambda m, a, b: F.cross_entropy(m(a), b, reduction="none"), x.double(), y))


def _tracked(model, x, y, tracked, params=None, losses_of=None, autocast=None):
    cockpit = Cockpit(params or list(model.parameters()), quantities=tracked)
    model.zero_grad()
    if autocast is None:
        out = model(x)
    else:
        with torch.autocast("cpu", dtype=autocast):
            out = model(x)
    losses = (losses_of or (lambda o: F.cross_entropy(o.float(), y, reduction="none")))(out)
    loss = losses.mean()
    with cockpit(0, info={"batch_size": len(x), "individual_losses": losses, "loss": loss}):
        loss.backward()
    return cockpit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_takes_the_layers_rules_and_matches_the_oracle_within_its_rounding(dtype):
    model = _mlp()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 5, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    tracked = [quantities.NormTest(EVERY), quantities.GradNorm(EVERY), quantities.InnerTest(EVERY), quantities.GradHist1d(EVERY)]
    cockpit = _tracked(model, x, y, tracked, autocast=dtype)
    assert set(cockpit.routes().values()) == {"module-local: Linear rule"}
    g = _oracle(model, x, y)
    eps = torch.finfo(dtype).eps
    output = cockpit.get_output()[0]
    assert output["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=8 * eps)
    norms = [float(part.mean(0).norm()) for part in g.split([p.numel() for p in model.parameters()], 1)]
    assert output["GradNorm"] == pytest.approx(norms, rel=8 * eps)


@pytest.mark.parametrize("batch_size", [2, 12])
def test_a_transformer_under_bf16_autocast_keeps_module_local_routes_and_matches_the_oracle(batch_size):
    """GPT-2 with its tied embedding: bf16 rounds the engine's checking passes by 2^-8, which must
    not read as samples that interact (it sent every LayerNorm and embedding to the whole graph)."""
    from any_models import TOKENS, VOCAB, hf_gpt2, token_losses

    torch.manual_seed(0)
    model = hf_gpt2(layers=2, width=16, heads=2)
    tokens = torch.randint(0, VOCAB, (batch_size, TOKENS), generator=torch.Generator().manual_seed(2))
    tracked = [quantities.NormTest(EVERY), quantities.GradNorm(EVERY)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a whole-graph route warns
        cockpit = _tracked(model, tokens, tokens, tracked, losses_of=lambda out: token_losses(out.float(), tokens), autocast=torch.bfloat16)
    assert not [route for route in cockpit.routes().values() if "whole" in route]
    twin = copy.deepcopy(model).double()
    g = flat(oracle_grads(twin, list(twin.parameters()), lambda m, a, b: token_losses(m(a), b), tokens, tokens))
    output = cockpit.get_output()[0]
    # bf16 operands in every product: agreement to a few of its eps, not float32's.
    assert output["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=0.05)
    norms = [float(part.mean(0).norm()) for part in g.split([p.numel() for p in model.parameters()], 1)]
    assert output["GradNorm"] == pytest.approx(norms, rel=0.05, abs=1e-6)


class _UpcastLinear(nn.Module):
    """A layer without a rule that computes in autocast's dtype and returns float32 (as HF's GPT-2
    MLP hands its Conv1D a float32 GELU output on a GPU): its parameters' gradients are rounded in
    bfloat16, while every tensor the capture sees is float32."""

    def __init__(self, features_in, features_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features_in, features_out) / features_in**0.5)
        self.bias = nn.Parameter(torch.randn(features_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight).float()


def test_a_call_computing_in_autocasts_dtype_but_returning_float32_is_checked_at_that_precision():
    """The sum check's tolerance is that of the least precise dtype a call computed in: autocast's
    bfloat16 rounding of the layer's gradient is no sign of a use outside the layer (it sent every
    HF Conv1D bias of GPT-2 to the whole graph under bf16 autocast on a GPU)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), _UpcastLinear(16, 3))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 5, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a whole-graph route warns
        cockpit = _tracked(model, x, y, [quantities.NormTest(EVERY), quantities.GradNorm(EVERY)], autocast=torch.bfloat16)
    assert cockpit.routes()["2.bias"] == "module-local: _UpcastLinear replayed with torch.func"
    g = _oracle(model, x, y)
    output = cockpit.get_output()[0]
    assert output["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=0.05)
    norms = [float(part.mean(0).norm()) for part in g.split([p.numel() for p in model.parameters()], 1)]
    assert output["GradNorm"] == pytest.approx(norms, rel=0.05)


class _Float32Norm(nn.Module):
    """Gemma's RMSNorm: computes in float32 whatever the model's dtype (x.float(), weight.float())."""

    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(features))

    def forward(self, x):
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (out * (1.0 + self.weight.float())).type_as(x)


@pytest.mark.parametrize("with_losses", [True, False])
def test_a_float64_model_whose_layer_computes_in_float32_inside_is_checked_at_that_precision(with_losses):
    """Gemma's and Mamba2's layers cast to float32 inside a float64 model: their sums are exact to
    float32's rounding only, which is no sign of a use outside the layer (it sent their weights to
    the whole graph with a false warning, and was a ValueError without the individual losses)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), _Float32Norm(16), nn.Linear(16, 3)).double()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (32,), generator=gen)
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    losses = F.cross_entropy(model(x), y, reduction="none")
    info = {"batch_size": len(x), "loss": losses.mean(), **({"individual_losses": losses} if with_losses else {})}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a whole-graph route warns
        with cockpit(0, info=info):
            losses.mean().backward()
    assert cockpit.routes()["2.weight"] == "module-local: _Float32Norm replayed with torch.func"
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(_oracle(model, x, y))["NormTest"], rel=1e-5)


def test_a_cockpit_inside_an_autocast_region_computes_its_statistics_in_the_models_dtypes():
    """A float32 model's forward and backward passes outside autocast, the cockpit's block inside
    one (a loop that wraps the whole step, its backward pass taken out as PyTorch advises): the
    engine's products (the Gram matrices of a layer over positions, the dot products) stay
    float32, equal to the float64 oracle to float32's rounding; they were bf16 products (errors
    of 2^-8) before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 7, 5, generator=gen), torch.randint(0, 3, (N, 7), generator=gen)
    losses_of = lambda out, labels: F.cross_entropy(out.transpose(1, 2), labels, reduction="none").mean(1)  # noqa: E731
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY), quantities.InnerTest(EVERY)])
    losses = losses_of(model(x), y)
    loss = losses.mean()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": loss}):
            with torch.autocast("cpu", enabled=False):
                loss.backward()
    twin = copy.deepcopy(model).double()
    g = flat(oracle_grads(twin, list(twin.parameters()), lambda m, a, b: losses_of(m(a), b), x.double(), y))
    mean = g.mean(0)
    inner = float(((g @ mean - (mean**2).sum()) ** 2).sum() / (N - 1) / N / (mean**2).sum() ** 2)
    output = cockpit.get_output()[0]
    assert output["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-6)
    assert output["InnerTest"] == pytest.approx(inner**0.5, rel=1e-6)


def test_outside_autocast_turns_autocast_off_where_it_is_on_and_on_again_after():
    """The engine's and the statistics' arithmetic runs outside autocast; where autocast is off
    already, entering costs nothing and changes nothing."""
    param = torch.zeros(2)
    with outside_autocast([param]):
        assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with outside_autocast([param, torch.zeros(2, device="meta")]):  # (meta tensors have no autocast)
            assert not torch.is_autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_a_functional_use_outside_its_layer_under_autocast_still_takes_the_whole_graph():
    """The tolerance autocast adds scales with each entry's own terms: a bias added again outside
    its layer still fails the check and takes the whole graph, exact."""
    torch.manual_seed(0)

    class Reused(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.head = nn.Linear(5, 16), _UpcastLinear(16, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.first(x))) + 4.0 * self.head.bias

    model = Reused()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 5, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    with pytest.warns(RuntimeWarning, match="head.bias"):
        cockpit = _tracked(model, x, y, [quantities.NormTest(EVERY), quantities.GradNorm(EVERY)], autocast=torch.bfloat16)
    assert cockpit.routes()["head.bias"] == "whole graph"
    g = _oracle(model, x, y)
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=0.05)


def test_samples_that_interact_under_bf16_autocast_take_the_whole_graph():
    """A mean over the batch mixes each sample's gradient by 1/N: under bf16 the proof holds its
    calls to float32's rounding, not bf16's 2^-8 (which let them pass, 12% off)."""
    torch.manual_seed(0)

    class Centered(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(5, 5), nn.Linear(5, 3)

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            return self.head(torch.tanh(h - h.mean(0, keepdim=True)).mean(1))

    model = Centered()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 6, 5, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    with pytest.warns(RuntimeWarning, match="lin.weight"):
        cockpit = _tracked(model, x, y, [quantities.NormTest(EVERY)], autocast=torch.bfloat16)
    assert cockpit.routes()["lin.weight"] == "whole graph"
    g = _oracle(model, x, y)
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=0.02)


class _RoundsItsOwnWay(torch.autograd.Function):
    """The identity, whose backward pass rounds otherwise in each pass, as kernels with atomic
    adds do on a GPU (bf16 attention: 1e-4 of the absolute sums): the k-th pass scales the
    gradient by 1 + (k % 3) * 2^-12."""

    passes = 0
    generate_vmap_rule = True  # (the oracle's torch.func)

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        _RoundsItsOwnWay.passes += 1
        return grad * (1 + (_RoundsItsOwnWay.passes % 3) * 2.0**-12)


@pytest.mark.parametrize("centered", [False, True])
def test_kernels_that_round_otherwise_in_each_pass_are_not_samples_that_interact(centered):
    """The proof allows what a repeated pass deviates by: layers upstream of such a kernel keep
    their rules (every one took the whole graph), samples that interact are still found."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(5, 5), nn.Linear(5, 3)

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            h = h - h.mean(0, keepdim=True) if centered else h
            return self.head(_RoundsItsOwnWay.apply(torch.tanh(h)).mean(1))

    model = Model()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = _tracked(model, x, y, [quantities.NormTest(EVERY)])
    routes = cockpit.routes()
    if centered:
        assert routes["lin.weight"] == "whole graph" and any("lin.weight" in str(w.message) for w in caught)
    else:
        assert set(routes.values()) == {"module-local: Linear rule"}
    g = _oracle(model, x, y)
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=2e-3)


def test_a_random_draw_in_the_backward_pass_does_not_turn_the_proof_off():
    """Dropout recomputed by a checkpoint without its random state deviates by about 1 from one
    pass to the next: not rounding. The Linear upstream of a batch norm still takes the whole
    graph (it kept its rule, 87% off, when that deviation loosened every call's proof)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn, self.head = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
            self.a, self.drop, self.b = nn.Linear(5, 16), nn.Dropout(0.5), nn.Linear(16, 3)

        def aux(self, x):
            return self.b(self.drop(torch.tanh(self.a(x))))

        def forward(self, x):  # the checkpointed branch never reaches lin
            aux = checkpoint(self.aux, x, use_reentrant=False, preserve_rng_state=False)
            return self.head(torch.relu(self.bn(self.lin(x)))) + aux

    model = Model()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    with pytest.warns(RuntimeWarning, match="lin.weight"):
        cockpit = _tracked(model, x, y, [quantities.NormTest(EVERY)])
    assert cockpit.routes()["lin.weight"] == "whole graph"


def test_float16_gradients_among_its_subnormals_keep_the_layers_rules():
    """float16's subnormals (below 6e-5) round a gradient scaled by a power of two otherwise: the
    proof holds float16 calls to their own rounding (float32's sent this MLP to the whole graph)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 5, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    small = lambda out: 1e-3 * F.cross_entropy(out.float(), y, reduction="none")  # noqa: E731
    cockpit = _tracked(model, x, y, [quantities.NormTest(EVERY)], losses_of=small, autocast=torch.float16)
    assert set(cockpit.routes().values()) == {"module-local: Linear rule"}


class _MaskedEncoder(nn.Module):
    """nn.TransformerEncoder (batch first) with a causal float mask and a boolean key padding
    mask: under autocast its attention computes in bfloat16, its masks stay as given."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder, self.head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(16, 3)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        padding[0, -2:] = True
        return self.head(self.encoder(x, mask=mask, src_key_padding_mask=padding.to(x.dtype), is_causal=True).mean(1))


def test_multihead_attention_under_bf16_autocast_keeps_its_rule_and_matches_the_oracle():
    torch.manual_seed(0)
    model = _MaskedEncoder()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 7, 16, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    tracked = [quantities.NormTest(EVERY), quantities.GradNorm(EVERY)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own note on the masks' two types
        cockpit = _tracked(model, x, y, tracked, autocast=torch.bfloat16)
    routes = set(cockpit.routes().values())
    assert "module-local: MultiheadAttention rule" in routes and not [r for r in routes if "whole" in r or "replayed" in r]
    g = _oracle(model, x, y)
    output = cockpit.get_output()[0]
    assert output["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=0.05)
    norms = [float(part.mean(0).norm()) for part in g.split([p.numel() for p in model.parameters()], 1)]
    assert output["GradNorm"] == pytest.approx(norms, rel=0.05, abs=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_a_bfloat16_model_is_not_rejected_for_rounding_its_losses(seed):
    model = _mlp().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 5, generator=gen).to(torch.bfloat16), torch.randint(0, 3, (16,), generator=gen)
    out = model(x)
    loss, losses = F.cross_entropy(out, y), F.cross_entropy(out, y, reduction="none")
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with cockpit(0, info={"batch_size": 16, "individual_losses": losses, "loss": loss}):
        loss.backward()
    assert cockpit.get_output()[0]["NormTest"] > 0


def test_a_loss_that_is_a_sum_is_still_rejected_in_bfloat16():
    model = _mlp().to(torch.bfloat16)
    x, y = torch.randn(16, 5).to(torch.bfloat16), torch.randint(0, 3, (16,))
    out = model(x)
    losses = F.cross_entropy(out, y, reduction="none")
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with pytest.raises(ValueError, match="is not the mean of info\\['individual_losses'\\]"):
        with cockpit(0, info={"batch_size": 16, "individual_losses": losses, "loss": losses.sum()}):
            losses.sum().backward()


def test_individual_losses_of_shape_n_by_1_as_cockpits_own_tests_pass_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(N, 4), torch.randn(N, 1)
    values = []
    for shape in [(N, 1), (N,)]:
        cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
        model.zero_grad()
        losses = F.mse_loss(model(x), y, reduction="none").reshape(shape)
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
        values.append(cockpit.get_output()[0]["NormTest"])
    twin = copy.deepcopy(model).double()
    g = flat(oracle_grads(twin, list(twin.parameters()), lambda m, a, b: F.mse_loss(m(a), b, reduction="none")[:, 0], x.double(), y.double()))
    assert values[0] == values[1] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-4)


def test_a_batch_of_no_samples_with_individual_losses():
    model, batch, _ = build("twice_applied", torch.float32)
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.GradHist1d(EVERY, bins=5)])
    x, y = batch(0, torch.Generator().manual_seed(1))
    training_step(model, None, (x, y), lambda out, labels: F.cross_entropy(out, labels, reduction="none"), cockpit=cockpit)
    assert cockpit.get_output()[0]["GradHist1d"]["hist"].sum() == 0


def test_a_call_shared_by_every_sample_takes_its_rule_where_it_is_broadcast():
    # T5's relative-attention-bias table: one lookup of position buckets for the whole batch.
    model, batch, losses_of = build("hf_t5", torch.float64)
    x, _ = batch(N, torch.Generator().manual_seed(1))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no whole-graph notice
        training_step(model, None, (x, None), lambda out, _: losses_of(lambda _: out, x, None), cockpit=cockpit)
    routes = cockpit.routes()
    bias = [name for name in routes if "relative_attention_bias" in name]
    assert len(bias) == 2 and {routes[name] for name in bias} == {"module-local: Embedding rule"}
    g = flat(oracle_grads(model, list(model.parameters()), losses_of, x, None))
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-7)



def _shared_calls_against_the_oracle(
    model, params, losses_of, batch, reader, shared, rel=1e-9, route="module-local: Embedding rule", without_losses=False
):
    """Two steps of the ``reader`` (a cockpit's NormTest, the collector's norms of each of
    ``params``) on ``losses_of(*batch())``, each against a backward pass per sample; the
    parameters named in ``shared`` take ``route``, and no parameter the whole graph;
    ``without_losses``: a cockpit's third step without the individual losses, likewise."""
    if reader == "cockpit":
        watching = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    else:
        watching = GradientMetricCollector([gm.PNorm(p, p=2) for p in params])
    for step in range(2):
        inputs = batch()
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no whole-graph notice
            losses = losses_of(*inputs)
            if reader == "cockpit":
                with watching(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
                    losses.mean().backward(retain_graph=True)
            else:
                rows = watching(losses)
                losses = losses_of(*inputs)  # (the collector's pass frees the graph)
        g = one_pass_per_sample(losses, params)
        if reader == "cockpit":
            assert watching.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=rel), step
        else:
            expected = torch.stack([gp.flatten(1).norm(dim=1) for gp in _per_parameter(g, params)], 1)
            # (a gradient zero in exact arithmetic, a key projection's bias, is rounding noise either way)
            torch.testing.assert_close(rows.double(), expected, rtol=rel, atol=1e-12 * float(expected.max()), msg=f"step {step}")
        routes = (watching if reader == "cockpit" else watching._engine).routes()
        assert all(routes[name] == route for name in shared), routes
    if without_losses and reader == "cockpit":
        losses = losses_of(*batch())
        model.zero_grad()
        with watching(2, info={"batch_size": N, "loss": losses.mean()}):
            losses.mean().backward(retain_graph=True)
        expected = gradient_tests(one_pass_per_sample(losses, params))["NormTest"]
        assert watching.get_output()[2]["NormTest"] == pytest.approx(expected, rel=rel)


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
def test_a_call_shared_by_every_sample_broadcast_in_several_layers_takes_its_rule(reader):
    """T5 of two layers: its position bias, looked up once, is broadcast in each layer. The proof
    paired the call's first broadcast in one pass with its last in the other (the whole graph,
    6.8x a plain step); paired fire by fire, the forms taken while the pass ran held the first
    broadcast's gradients twice (NormTest 0.292161 for 0.292171) until they were kept by fire."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=13, d_model=8, d_kv=4, d_ff=16, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=4, relative_attention_max_distance=8, dropout_rate=0.0, decoder_start_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config).double()

    def losses_of(ids, targets):
        logits = model(input_ids=ids, decoder_input_ids=targets).logits
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)

    batch = lambda: (torch.randint(1, 13, (N, 5)), torch.randint(1, 13, (N, 5)))  # noqa: E731
    shared = [f"{part}.block.0.layer.0.SelfAttention.relative_attention_bias.weight" for part in ("encoder", "decoder")]
    # (T5's norms compute in float32 inside the float64 model: 1e-7, as the test above)
    _shared_calls_against_the_oracle(model, list(model.parameters()), losses_of, batch, reader, shared, rel=1e-7)


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
def test_a_call_shared_by_every_sample_expanded_to_the_batch_takes_its_rule(reader):
    """MPNet expands its position bias, looked up once, to the batch (``expand`` then
    ``contiguous``), where T5 adds it: the whole graph for the table (8x a plain step)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MPNetConfig(
        vocab_size=13, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = transformers.MPNetForSequenceClassification(config).double()
    params = [p for name, p in model.named_parameters() if not name.startswith("mpnet.pooler")]  # (unused)
    losses_of = lambda ids, labels: F.cross_entropy(model(input_ids=ids).logits, labels, reduction="none")  # noqa: E731
    batch = lambda: (torch.randint(3, 13, (N, 5)), torch.randint(0, 3, (N,)))  # noqa: E731
    _shared_calls_against_the_oracle(model, params, losses_of, batch, reader, ["mpnet.encoder.relative_attention_bias.weight"])


class _WindowBias(nn.Module):
    """A table of biases by relative position, read through a buffer of indices for every
    window alike (Swin's relative position bias): a call with no inputs."""

    def __init__(self, heads, size):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * size - 1, heads))
        self.register_buffer("index", torch.arange(size)[:, None] - torch.arange(size)[None, :] + size - 1)

    def forward(self):
        return self.table[self.index].permute(2, 0, 1)  # (heads, size, size)


class _WindowAttention(nn.Module):
    """Attention within windows of 3 tokens (Swin's): each sample's W windows are rows
    ``(N * W, 3, C)``, sample-major, or window-major (``window_major``), and the bias is
    broadcast to every row."""

    def __init__(self, window_major=False):
        super().__init__()
        self.embed, self.query, self.key, self.value = (nn.Linear(4, 4) for _ in range(4))
        self.bias, self.out, self.head, self.window_major = _WindowBias(2, 3), nn.Linear(4, 4), nn.Linear(4, 3), window_major

    def forward(self, x):  # (N, 3 * W, 4)
        n, length, x = x.shape[0], x.shape[1], self.embed(x)
        windows = x.view(n, -1, 3, 4).transpose(0, 1) if self.window_major else x.view(n, -1, 3, 4)
        rows = windows.reshape(-1, 3, 4)
        q, k, v = (layer(rows).view(-1, 3, 2, 2).transpose(1, 2) for layer in (self.query, self.key, self.value))  # (R, heads, 3, 2)
        scores = q @ k.transpose(-1, -2) + self.bias().unsqueeze(0)
        out = self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(-1, 3, 4)).reshape(windows.shape)
        out = out.transpose(0, 1) if self.window_major else out
        return self.head(torch.tanh(out.reshape(n, length, 4))).mean(1)


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
def test_a_call_shared_by_every_window_of_every_sample_is_replayed_where_it_is_broadcast(reader):
    """Swin adds its relative position bias, made once, to rows that are each sample's windows
    ``(N * W, ...)``, not the N samples: its table took the whole graph (Swin 9x a plain step)."""
    torch.manual_seed(0)
    model = _WindowAttention().double()
    losses_of = lambda x, labels: F.cross_entropy(model(x), labels, reduction="none")  # noqa: E731
    batch = lambda: (torch.randn(N, 6, 4, dtype=torch.float64), torch.randint(0, 3, (N,)))  # noqa: E731
    _shared_calls_against_the_oracle(
        model, list(model.parameters()), losses_of, batch, reader, ["bias.table"], route="module-local: _WindowBias replayed with torch.func"
    )


def _windowed_steps(window_major, plan):
    """Steps of :class:`_WindowAttention` on ``plan``'s ``(tokens, with the individual losses)``,
    each against a backward pass per sample; a step without the losses that no exact route
    serves must ask for them. Returns the cockpit and the model (its names for the routes)."""
    torch.manual_seed(0)
    model = _WindowAttention(window_major).double()
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step, (length, with_losses) in enumerate(plan):
        x, y = torch.randn(N, length, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (N,), generator=gen)
        model.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        info = {"batch_size": N, "loss": losses.mean()} | ({"individual_losses": losses} if with_losses else {})
        if window_major and not with_losses:
            with pytest.raises(ValueError, match="need every sample's own loss"):
                with cockpit(step, info=info):
                    losses.mean().backward()
            continue
        with warnings.catch_warnings():
            # (window-major: the whole graph's notice; sample-major: none)
            warnings.simplefilter("ignore" if window_major else "error", RuntimeWarning)
            with cockpit(step, info=info):
                losses.mean().backward(retain_graph=True)
        expected = gradient_tests(one_pass_per_sample(losses, params))["NormTest"]
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected, rel=1e-9), step
    return cockpit, model


def test_windows_taken_window_major_are_never_taken_for_the_samples():
    """One window on the first step proves nothing of their order. With several on later steps,
    window-major: the bias's gradient was split among the samples sample-major, unproven, and
    rows below a transpose of the windows, as many as the samples, were read as the samples:
    wrong numbers, with the individual losses or without. Now the whole graph, or an error."""
    _windowed_steps(True, [(3, True), (3 * N, True), (3 * N, False)])


def test_rows_of_windows_are_read_through_attention_on_steps_without_the_individual_losses():
    """The rows of a projection after attention within windows (Swin's o_proj) were guessed
    sample-major, not read through the products, softmax and transposes that keep each
    window's row: every step without the individual losses raised, needing them."""
    cockpit, _model = _windowed_steps(False, [(6, True), (6, False), (6, False)])
    assert cockpit.routes()["out.weight"] == "module-local: Linear rule, rows regrouped by sample"


def test_hf_swin_takes_no_whole_graph_and_matches_a_pass_per_sample():
    transformers = pytest.importorskip("transformers")
    config = transformers.SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
    )
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(config).double()
    losses_of = lambda x, labels: F.cross_entropy(model(pixel_values=x).logits, labels, reduction="none")  # noqa: E731
    batch = lambda: (torch.randn(N, 3, 32, 32, dtype=torch.float64), torch.randint(0, 3, (N,)))  # noqa: E731
    tables = [name for name, _ in model.named_parameters() if name.endswith("relative_position_bias_table")]
    owner = type(model.get_submodule(tables[0].rsplit(".", 1)[0])).__name__  # (SwinRelativePositionBias)
    _shared_calls_against_the_oracle(  # (without the losses: each window's rows read from the graph)
        model, list(model.parameters()), losses_of, batch, "cockpit", tables,
        route=f"module-local: {owner} replayed with torch.func", without_losses=True,
    )


def test_a_call_shared_by_windows_taken_window_major_takes_the_whole_graph():
    """The windows' rows taken sample-major where they are window-major: the proof refutes it."""
    torch.manual_seed(0)
    model = _WindowAttention(window_major=True).double()
    x, y = torch.randn(N, 6, 4, dtype=torch.float64), torch.randint(0, 3, (N,))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    losses = F.cross_entropy(model(x), y, reduction="none")
    with pytest.warns(RuntimeWarning, match=r"\(bias\.table\) takes the whole-graph route"):
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward(retain_graph=True)
    g = one_pass_per_sample(losses, list(model.parameters()))
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-9)
    assert cockpit.routes()["bias.table"] == "whole graph"


class _PositionsProjectedOnce(nn.Module):
    """Queries against a table of positions, normed and projected once, then repeated for each
    sample's heads (DeBERTa's content-to-position attention); ``share_key``: the positions take
    the queries' projection (DeBERTa-v3's ``share_att_key``), a module called on the samples
    and once for them all."""

    def __init__(self, share_key, flat_positions=False):
        super().__init__()
        self.query, self.norm, self.head = nn.Linear(4, 8), nn.LayerNorm(4), nn.Linear(5, 3)
        self.key = self.query if share_key else nn.Linear(4, 8)
        self.register_buffer("positions", torch.randn(5, 4))
        self.flat_positions = flat_positions  # (5, 4), not (1, 5, 4): as many rows as 5 samples

    def forward(self, x):  # (N, 3, 4): 2 heads of 4
        n = x.shape[0]
        queries = self.query(x).view(n, 3, 2, 4).transpose(1, 2).reshape(n * 2, 3, 4)
        positions = self.norm(self.positions) if self.flat_positions else self.norm(self.positions).unsqueeze(0)
        keys = (self.key(positions) * 0.5).view(1, 5, 2, 4).permute(0, 2, 1, 3).reshape(2, 5, 4)
        scores = torch.bmm(queries, keys.repeat(n, 1, 1).transpose(1, 2))  # (N * 2, 3, 5)
        return self.head(torch.tanh(scores).view(n, 2, 3, 5).mean((1, 2)))


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
def test_a_call_shared_by_every_sample_repeated_for_each_takes_its_rule(reader):
    """DeBERTa repeats its position projections, made once, for each sample's heads: they took
    the whole graph (its calls hold no samples)."""
    torch.manual_seed(0)
    model = _PositionsProjectedOnce(share_key=False).double()
    losses_of = lambda x, labels: F.cross_entropy(model(x), labels, reduction="none")  # noqa: E731
    batch = lambda: (torch.randn(N, 3, 4, dtype=torch.float64), torch.randint(0, 3, (N,)))  # noqa: E731
    _shared_calls_against_the_oracle(model, list(model.parameters()), losses_of, batch, reader, ["key.weight"], route="module-local: Linear rule")


def test_a_module_called_on_the_samples_and_once_for_them_all_takes_the_whole_graph_after_the_checks():
    """DeBERTa-v3's shared key projection: its call on the positions is shared, its calls on
    the samples are not; a later call on the positions with as many rows as samples (N = P)
    cannot be told from one on the samples. Taken for one (the shared module's calls holding
    N rows, kept module-local), it gave wrong numbers; its calls take the whole graph after
    the checks, as before."""
    torch.manual_seed(0)
    model = _PositionsProjectedOnce(share_key=True, flat_positions=True).double()
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step, n in enumerate([4, 4, 5]):  # (5 positions)
        x, y = torch.randn(n, 3, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen)
        model.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (the whole graph's notice)
            with cockpit(step, info={"batch_size": n, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward(retain_graph=True)
        expected = gradient_tests(one_pass_per_sample(losses, params))["NormTest"]
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected, rel=1e-9), step


def test_hf_deberta_v2_position_projections_take_their_rules():
    transformers = pytest.importorskip("transformers")
    config = transformers.DebertaV2Config(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        share_att_key=False, norm_rel_ebd="layer_norm", num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.DebertaV2ForSequenceClassification(config).double()
    # (Its encoder reads rel_embeddings.weight itself, outside a call of its own: the whole graph.)
    params = [p for name, p in model.named_parameters() if name != "deberta.encoder.rel_embeddings.weight"]
    mask = torch.ones(N, 7, dtype=torch.long)
    losses_of = lambda ids, labels: F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels, reduction="none")  # noqa: E731
    batch = lambda: (torch.randint(0, 50, (N, 7)), torch.randint(0, 3, (N,)))  # noqa: E731
    projections = [f"deberta.encoder.layer.{i}.attention.self.pos_key_proj.weight" for i in range(2)]
    _shared_calls_against_the_oracle(model, params, losses_of, batch, "cockpit", projections, route="module-local: Linear rule")


class _Latents(nn.Module):
    """Parameters expanded to the batch inside the call, handed the batch's size alone
    (Perceiver's latents): no input holds the samples, the output does."""

    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(3, 4))

    def forward(self, batch_size):
        return self.latents.expand(batch_size, -1, -1)


class _LatentsAttend(nn.Module):
    def __init__(self):
        super().__init__()
        self.latents, self.key, self.head = _Latents(), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):  # (N, 5, 4)
        attention = (self.latents(x.shape[0]) @ self.key(x).transpose(1, 2)).softmax(-1)  # (N, 3, 5)
        return self.head((attention @ x).mean(1))


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
def test_parameters_a_call_expands_to_the_batch_are_replayed_sample_by_sample(reader):
    """The replay took the batch's output for each sample's (a shape mismatch): Perceiver's
    latents and output positions took the whole graph (7x a plain step)."""
    torch.manual_seed(0)
    model = _LatentsAttend().double()
    losses_of = lambda x, labels: F.cross_entropy(model(x), labels, reduction="none")  # noqa: E731
    batch = lambda: (torch.randn(N, 5, 4, dtype=torch.float64), torch.randint(0, 3, (N,)))  # noqa: E731
    _shared_calls_against_the_oracle(
        model, list(model.parameters()), losses_of, batch, reader, ["latents.latents"],
        route="module-local: _Latents replayed with torch.func", without_losses=True,
    )


def test_hf_perceiver_takes_no_whole_graph_and_matches_a_pass_per_sample():
    transformers = pytest.importorskip("transformers")
    config = transformers.PerceiverConfig(
        num_latents=8, d_latents=16, d_model=16, num_blocks=1, num_self_attends_per_block=1, num_self_attention_heads=2,
        num_cross_attention_heads=2, vocab_size=30, max_position_embeddings=12, num_labels=3,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.PerceiverForSequenceClassification(config).double()
    losses_of = lambda ids, labels: F.cross_entropy(model(inputs=ids).logits, labels, reduction="none")  # noqa: E731
    batch = lambda: (torch.randint(0, 30, (N, 12)), torch.randint(0, 3, (N,)))  # noqa: E731
    _shared_calls_against_the_oracle(
        model, list(model.parameters()), losses_of, batch, "cockpit", ["perceiver.embeddings.latents"],
        route="module-local: PerceiverEmbeddings replayed with torch.func",
    )


class _PositionsLookedUpOnce(nn.Module):
    """Token embeddings plus a position table looked up once for every sample (LED's encoder)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions, self.head = nn.Embedding(13, 8), nn.Embedding(16, 8), nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.tokens(ids) + self.positions(torch.arange(ids.shape[1])))).mean(1)


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
def test_a_shared_lookup_of_as_many_positions_as_a_multiple_of_the_samples_takes_its_rule(reader):
    """T = 2N positions looked up once: the rows, a multiple of N with no graph to tell their
    samples, were guessed sample-major, which the proof refuted; the call then kept the guess's
    shape and was not found shared (the whole graph: LED's encoder at N = 16, T = 32, 8x)."""
    torch.manual_seed(0)
    model = _PositionsLookedUpOnce().double()
    losses_of = lambda ids, labels: F.cross_entropy(model(ids), labels, reduction="none")  # noqa: E731
    batch = lambda: (torch.randint(0, 13, (N, 2 * N)), torch.randint(0, 3, (N,)))  # noqa: E731
    _shared_calls_against_the_oracle(model, list(model.parameters()), losses_of, batch, reader, ["positions.weight"])


@contextlib.contextmanager
def _collector_off():
    """What is let go goes by its references alone: the cyclic garbage collector does not run."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("name", ["lstm", "hf_t5", "hf_gpt2", "checkpointed_lstm"])
def test_a_tracked_step_leaves_no_reference_cycle_holding_its_graph(name):
    """A step's graph (the tensors its backward pass did not release) is freed when the step ends,
    not at the next garbage collection, which may come steps later: a peak of two steps' memory.
    An LSTM's call has several outputs (torch's hook on them and their nodes held each other until
    removed, which a call activation checkpointing recomputes in the backward pass never was);
    T5's shared position bias is found by a recursive closure over the graph."""
    if name == "checkpointed_lstm":
        model, batch, losses_of = _CheckpointedLSTM(), _sequences_and_labels, _cross_entropies
    else:
        model, batch, losses_of = build(name, torch.float32)
    x, y = batch(N, torch.Generator().manual_seed(1))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY), quantities.GradHist1d(EVERY)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gc.collect()
    with _collector_off():
        for step in range(3):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                training_step(model, opt, (x, y), lambda out, labels: losses_of(lambda _: out, x, labels), cockpit=cockpit, step=step)
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            left = [type(o).__name__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert not [kind for kind in left if kind.endswith(("Backward0", "Backward1")) or kind in ("Call", "Tensor")], sorted(set(left))


class _CheckpointedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lstm, self.head = nn.LSTM(3, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)

    def _forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def _sequences_and_labels(n, gen):
    return torch.randn(n, 5, 3, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _cross_entropies(forward, x, y):
    return F.cross_entropy(forward(x), y, reduction="none")


class _TwoOutputs(nn.Module):
    """Returns its product and a view or a function of it, or a function of it and of its
    weight, or its own weight, or its input (of which the product is computed: not the
    parameters')."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.weight, self.how = nn.Parameter(torch.randn(3, 6, dtype=torch.float64)), how

    def forward(self, x):
        source = x.tanh()
        y = source @ self.weight
        second = {
            "view": lambda: y[..., :2],
            "function": lambda: 2 * y.tanh(),
            "function_and_weight": lambda: y.tanh() * self.weight[0],
            "parameter": lambda: self.weight,
            "input": lambda: source,
        }
        return y, second[self.how]()


@pytest.mark.parametrize(
    "how, why",
    [
        ("view", None),
        ("function", None),
        ("function_and_weight", "returns an output computed from another it returns"),
        ("parameter", "returns one of its parameters itself"),
        ("input", None),
    ],
)
def test_outputs_whose_hooks_cannot_tell_the_samples_apart_take_the_whole_graph(how, why):
    """The hook on the first output gets the share of the gradient that passes through a second
    computed from it too, which a rule given both counted twice; a parameter handed out is used
    by the caller (and a hook on it stayed, one more each step). The second output enters the
    losses only after the checks' step, so no check saw it: the per-sample gradients came out
    up to twice too large (and 50-85% off with the parameter), with no warning. A second output
    computed from the first alone (a view, a router's weights of its logits) is left out of the
    forms, whose first output's hook has its share: module-local, where it took the whole graph.
    An output the first is computed from, which the parameters do not reach, counts nothing
    twice."""
    model = _TwoOutputs(how)
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        y, second = model(torch.randn(N, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True))  # (as an upstream layer's output)
        extra = y @ second.t() if how == "parameter" else second
        return y.tanh().sum((1, 2)) + step * extra.square().sum((1, 2))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = _steps_of_norm_test([model.weight], losses_of)
    noticed = [str(w.message) for w in caught if why is not None and why in str(w.message)]
    assert len(noticed) == (why is not None), [str(w.message) for w in caught]  # (once)
    assert cockpit.routes() == {"weight": "whole graph" if why else "module-local: _TwoOutputs replayed with torch.func"}
    assert not model.weight._backward_hooks


class _TakesItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 3, dtype=torch.float64))

    def forward(self, x, weight):
        return torch.tanh(x @ weight.T)


class _HandsItsChildASlice(nn.Module):
    """Hands its child a slice of the child's own weight, as DBRX's experts hand their GLU each
    expert's weights: the child's forward reads its input, not its parameter."""

    def __init__(self):
        super().__init__()
        self.child = _TakesItsWeight()

    def forward(self, x):
        return self.child(x, self.child.weight.view(2, 3, 3)[1])


@pytest.mark.parametrize("hand_in_losses", [True, False])
def test_a_parameter_handed_to_its_own_module_is_claimed_by_the_caller(hand_in_losses):
    """The child's call claimed the weight it was handed a view of, and its replay (of the
    child's own weight) got nothing: the weight took the whole graph, or without the losses
    raised. The caller's call claims it, replayed: module-local."""
    torch.manual_seed(0)
    model = nn.Sequential(_HandsItsChildASlice(), nn.Linear(3, 3)).double()
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x, y = torch.randn(N, 3, dtype=torch.float64, generator=gen), torch.randint(0, 3, (N,), generator=gen)
        model.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        info = {"batch_size": N, "loss": losses.mean()} | ({"individual_losses": losses} if hand_in_losses else {})
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # (no whole graph's notice)
            with cockpit(step, info=info):
                losses.mean().backward(retain_graph=True)
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(one_pass_per_sample(losses, params))["NormTest"], rel=1e-9), step
    assert cockpit.routes()["0.child.weight"] == "module-local: _HandsItsChildASlice replayed with torch.func"


class _MaskFirst(nn.Module):
    """No rule: replayed. Returns a mask that needs no gradient before its product."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(3, 6, dtype=torch.float64))

    def forward(self, x):
        y = torch.tanh(x @ self.weight)
        return y > 0, y


def test_a_replayed_call_returning_a_mask_before_its_output_stays_module_local():
    """The replay took its outputs by their place among those that need a gradient, from all
    its tensor outputs: the mask stood for the product, the replay failed and the weight took
    the whole graph."""
    model = _MaskFirst()
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        mask, y = model(torch.randn(N, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True))
        return (y * mask).tanh().sum((1, 2))

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (no whole graph's notice)
        cockpit = _steps_of_norm_test([model.weight], losses_of)
    assert cockpit.routes() == {"weight": "module-local: _MaskFirst replayed with torch.func"}


def test_a_forward_pass_in_another_thread_still_shows_outputs_computed_from_another():
    """Autograd numbers each thread's nodes in the order it makes them. A call's own nodes were
    told by numbers above its inputs': a forward pass in a worker thread on an input made in
    the main thread (numbered higher, on its own) seemed to make none, so ``(y, y[..., :2])``
    kept the rule, which counted the second output's share twice once it entered the losses after
    the checks' step (NormTest 3x off, silently). They are told by the number the call's
    thread had reached when it began."""
    model = _TwoOutputs("function_and_weight")
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        leaf = torch.randn(N, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(100):  # (the main thread's numbers ahead of a new thread's)
            x = leaf * 1.0
        outputs = []
        worker = threading.Thread(target=lambda: outputs.extend(model(x)))
        worker.start()
        worker.join()
        y, view = outputs
        return y.tanh().sum((1, 2)) + step * view.square().sum((1, 2))

    cockpit = _steps_of_norm_test([model.weight], losses_of)
    assert cockpit.routes() == {"weight": "whole graph"}


def test_a_call_in_a_new_thread_reads_only_its_own_nodes():
    """A new thread numbers its nodes from 0 on: a float64 Linear called there on an input the
    main thread had rounded through bfloat16 seemed to compute in bfloat16 (the walk went on
    into the main thread's nodes, numbered higher), and the sum check took bfloat16's tolerance,
    so a use of its weight outside its call passed it (NormTest 1.5% off). The walk keeps to the
    numbers the call's thread gave while it ran."""
    torch.manual_seed(0)
    linear = nn.Linear(3, 3).double()
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        rounded = (torch.randn(N, 3, generator=gen, dtype=torch.float64, requires_grad=True) * 1.0).bfloat16().double() * 1.0
        outputs = []
        worker = threading.Thread(target=lambda: outputs.append(linear(rounded)))
        worker.start()
        worker.join()
        return outputs[0].tanh().sum(1) + 0.1 * (torch.randn(N, 3, generator=gen, dtype=torch.float64) @ linear.weight).sum(1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cockpit = _steps_of_norm_test(list(linear.parameters()), losses_of, steps=3)
    assert cockpit.routes() == {"weight": "whole graph", "bias": "module-local: Linear rule"}


class _Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight, self.drop = nn.Parameter(torch.randn(5, 5) * 0.3), nn.Dropout(0.1)

    def forward(self, x):
        return torch.tanh(self.drop(x) @ self.weight)


def test_the_whole_graph_notice_comes_once_for_many_parameters():
    """Its text listed the parameters in the order the step's calls came in a weak set, which
    changes from step to step: the "one-time" notice came again at most steps (9 of 10)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Dropping() for _ in range(6)])
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # (as a user's script: the same text once)
        for step in range(6):
            model.zero_grad()
            losses = model(torch.randn(N, 5, generator=gen)).square().sum(1)
            with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward()
    notices = [str(w.message) for w in caught if "whole-graph route" in str(w.message)]
    assert len(notices) == 1 and "6 tracked parameters (0.weight, 1.weight, 2.weight, 3.weight, 4.weight, 5.weight)" in notices[0], notices


@pytest.mark.parametrize("need_weights", [False, True])
def test_an_output_its_caller_changes_in_place_keeps_its_rule(need_weights):
    """nn.MultiheadAttention's batch-first output is a transposed view of its last product; a
    caller's ``out.mul_(1.5)`` or ``out += q`` left the hook on that view never firing, and the
    step raised (batch_l2 not computed, asking for the individual losses it had). The hook sits
    where the product's gradient arrives, which the change does not bypass; also beside the
    attention weights (need_weights=True, the default), which do not read that product."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"pre": nn.Linear(8, 8), "attention": nn.MultiheadAttention(8, 2, batch_first=True)}).double()
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        q = model["pre"](torch.randn(N, 5, 8, generator=gen, dtype=torch.float64))
        out, weights = model["attention"](q, q, q, need_weights=need_weights)
        if need_weights:
            out += q
        else:
            out.mul_(1.5)
        return out.tanh().sum((1, 2)) + (0 if weights is None else weights.square().sum((1, 2)))

    cockpit = _steps_of_norm_test(list(model.parameters()), losses_of)
    assert set(cockpit.routes().values()) == {"module-local: MultiheadAttention rule", "module-local: Linear rule"}


class _ViewsItsProduct(nn.Module):
    """Returns its product flattened (a view) and summed, both read from the product; or a slice
    of the product alone."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.weight, self.how = nn.Parameter(torch.randn(3, 4, dtype=torch.float64)), how

    def forward(self, x):
        product = x.tanh() @ self.weight
        return (product.flatten(1), product.sum(-1)) if self.how == "flat and summed" else (product[..., :2],)


def _changed_views(how, from_step):
    """The losses of :class:`_ViewsItsProduct` whose first output the caller changes in place
    from step ``from_step`` on (and then drops: nothing but the graph holds it)."""
    model = _ViewsItsProduct(how)
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        changed, *summed = model(torch.randn(N, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True) * 1.0)
        if step >= from_step:
            changed.mul_(1.5)
        return changed.tanh().flatten(1).sum(1) + sum(step * s.square().sum(1) for s in summed)

    return model, losses_of


@pytest.mark.parametrize("from_step", [0, 1])
@pytest.mark.parametrize("how", ["flat and summed", "sliced"])
def test_an_output_changed_in_place_where_no_hook_follows_it_takes_the_whole_graph(how, from_step):
    """A flattened output changed in place by the caller cannot be hooked where the product's
    gradient arrives when a second output reads the product too: that one's share arrives there
    as well (counted twice, silently, once it entered the losses after the checks' step: NormTest
    2.8x). Nor can a slice. Hooked on itself, the hook never fires once the output is changed:
    the sums gave it away on the checks' step (or the step raised, batch_l2 not computed, where
    no hook of the call fired); after it, the per-sample gradients were silently wrong (4-40%),
    or the step raised. The change is seen before the backward pass: the parameters take the
    whole graph, saying why."""
    model, losses_of = _changed_views(how, from_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = _steps_of_norm_test([model.weight], losses_of, steps=3)
    assert cockpit.routes() == {"weight": "whole graph"}
    why = "an output of its call, a view of another tensor, was changed in place after the call (no hook follows it)"
    assert any(why in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "how, why", [("flat and summed", "do not add up to its gradient"), ("sliced", "output never reached the hook on it")]
)
def test_hooks_that_miss_a_change_in_place_on_the_checks_step_send_the_parameters_to_the_whole_graph(monkeypatch, how, why):
    """Where a change in place goes unseen before the backward pass (the check of the versions
    switched off here), the checks' step still finds the parameters' per-sample gradients wrong
    or missing and takes the whole graph, saying why: no error, no wrong number."""
    monkeypatch.setattr(Call, "changed_in_place", lambda call: None)
    model, losses_of = _changed_views(how, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = _steps_of_norm_test([model.weight], losses_of)
    assert cockpit.routes() == {"weight": "whole graph"}
    assert any(why in str(w.message) and "changed in place where no hook follows it" in str(w.message) for w in caught), [str(w.message) for w in caught]


class _Gate(nn.Module):
    """``sigmoid(x + shifts[0] + shift + bias)``: its backward pass reads its result only, so
    autograd lets a caller change any of them in place after the call."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.register_buffer("shift", torch.zeros(3, dtype=torch.float64))

    def forward(self, x, shifts=(0.0,)):
        return torch.sigmoid(x + shifts[0] + self.shift + self.bias)


@pytest.mark.parametrize("changed", ["input", "input in a tuple", "buffer", "parameter"])
def test_what_a_replay_reads_changed_in_place_after_the_call_takes_the_whole_graph(changed):
    """``h += 1`` after ``gate(h)`` (or a change to a tensor in a tuple it was given, to its
    buffer, or to its parameter under no_grad), from the step after the checks' on: the replay of
    the gate read the changed values (its kept inputs share their memory): its bias's per-sample
    gradients 43-53% off, silently. The change is seen before the backward pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), _Gate()).double()
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        h = model[0](torch.randn(N, 3, generator=gen, dtype=torch.float64))
        shift = torch.randn(3, generator=gen, dtype=torch.float64)
        gated = model[1](h, (shift,))
        with torch.no_grad():
            touched = {"input": h, "input in a tuple": shift, "buffer": model[1].shift, "parameter": model[1].bias}[changed]
            touched += 0.5 * (step > 0)
        return (gated.square() + h).sum(1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = _steps_of_norm_test(list(model.parameters()), losses_of, steps=3)
    assert list(cockpit.routes().values()) == ["module-local: Linear rule"] * 2 + ["whole graph"]
    why = "its module _Gate: an input, parameter or buffer of its call was changed in place after the call"
    assert any(why in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_an_input_of_a_trained_bias_alone_may_change_after_the_call():
    """A Linear with its weight frozen and its bias trained (bias-only fine-tuning): autograd
    keeps no copy of its input, which a later ``relu_`` changes; nor does the bias's rule read
    it. That change sent the bias to the whole graph (and raised without individual losses)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"first": nn.Linear(3, 4), "second": nn.Linear(4, 2)}).double()
    model["second"].weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        h = model["first"](torch.randn(N, 3, generator=gen, dtype=torch.float64))
        out = model["second"](h)
        F.relu(h, inplace=True)
        return out.square().sum(1) + h.sum(1)

    cockpit = _steps_of_norm_test([p for p in model.parameters() if p.requires_grad], losses_of, steps=3)
    assert set(cockpit.routes().values()) == {"module-local: Linear rule"}


def test_calls_of_an_earlier_step_whose_graph_the_user_keeps_are_no_part_of_this_one():
    """A loop refilling one input buffer, whose user keeps every step's graph (a sum of the
    losses without detach), tracked every other step: the calls of the untracked steps, still
    alive, read the buffer refilled since. They sent the gate to the whole graph, and raised
    without individual losses ("need every sample's own loss"). They are not in this step's
    graph."""
    torch.manual_seed(0)
    model = nn.Sequential(_Gate(), nn.Linear(3, 2)).double()
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(lambda step: step % 2 == 0)])
    gen = torch.Generator().manual_seed(1)
    batch, kept = torch.empty(N, 3, dtype=torch.float64), 0.0
    for step in range(5):
        batch.copy_(torch.randn(N, 3, generator=gen, dtype=torch.float64))
        model.zero_grad()
        losses = model(batch).square().sum(1)
        kept = kept + losses.mean()
        with cockpit(step, info={"batch_size": N, "loss": losses.mean()}):
            losses.mean().backward(retain_graph=True)
        if step % 2 == 0:
            g = one_pass_per_sample(losses, params)
            assert cockpit.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-9), step
    assert set(cockpit.routes().values()) == {"module-local: _Gate replayed with torch.func", "module-local: Linear rule"}


def test_without_individual_losses_a_changed_input_is_refused_after_the_backward_pass():
    """Without the individual losses no route can avoid the changed values: the step that
    reaches such a call raises, naming the module and the cause (the step before it counts)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), _Gate()).double()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        model.zero_grad()
        h = model[0](torch.randn(N, 3, generator=gen, dtype=torch.float64))
        gated = model[1](h)
        if step:
            h += 0.5
        loss = (gated.square() + h).sum(1).mean()
        raises = pytest.raises(ValueError, match="their module _Gate: an input, parameter or buffer of its call was changed in place")
        with raises if step else contextlib.nullcontext():
            with cockpit(step, info={"batch_size": N, "loss": loss}):
                loss.backward()


class _GateView(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.randn(3, 5))

    def forward(self, x):
        return (torch.tanh(x) * self.g).view(x.shape[0], 15)


class _GatedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.gate, self.head = nn.Linear(5, 5), _GateView(), nn.Linear(15, 2)
        self.changes = False

    def forward(self, inputs):
        x = self.lin(inputs)
        h = self.gate(x)
        if self.changes:
            h += inputs.flatten(1)  # (the tagged view's node leaves the graph)
            x.mul_(0.5)  # (what the gate's replay reads)
        return self.head(h) + self.head(self.gate(self.lin(2 * inputs)))


def test_a_changed_call_whose_view_output_was_changed_too_is_still_in_the_graph():
    """The call's output, changed in place, is no longer in the graph, but the hook that takes
    its gradient (where the product's gradient arrives) is: the call was taken for one of an
    earlier pass and left out of the step, its changed input read by the replay (gate.g 16-18%
    off after the checks' step, silently). Calls are found in the graph by their hooked nodes."""
    torch.manual_seed(0)
    model = _GatedTwice().double()
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        model.changes = step > 0
        x, y = torch.randn(N, 3, 5, generator=gen, dtype=torch.float64), torch.randint(0, 2, (N,), generator=gen)
        return F.cross_entropy(model(x), y, reduction="none")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cockpit = _steps_of_norm_test(list(model.parameters()), losses_of, steps=3)
    assert cockpit.routes()["gate.g"] == "whole graph"


def test_an_untracked_pass_kept_alive_and_an_optimizer_step_leave_a_step_without_losses_alone():
    """Sharpness-aware minimization's second forward and backward pass, whose loss the user
    keeps, then the optimizer's step: that pass's calls live on, their parameters changed since.
    Without individual losses (or a loss) the step raised ("need every sample's own loss")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), _Gate()).double()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    kept = []
    for step in range(3):
        x = torch.randn(N, 3, generator=gen, dtype=torch.float64)
        model.zero_grad()
        losses = model(x).square().sum(1)
        with cockpit(step, info={"batch_size": N, "optimizer": optimizer}):
            losses.mean().backward(retain_graph=True)
        g = one_pass_per_sample(losses, params)
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-9), step
        model.zero_grad()
        kept.append(model(x + 0.01).square().sum(1).mean())  # (the second pass, its loss kept)
        kept[-1].backward(retain_graph=True)
        optimizer.step()


def test_outputs_hooked_where_the_viewed_product_is_read_from_their_own_memory():
    """Two heads on sequences (a Linear's output views its product) stacked by the caller, in an
    order that changes after the checks' step: each head's product's gradient is a slice of the
    stack's, starting partway into its memory. Read from the memory's start, one head got the
    other's gradient (NormTest 30% off, no warning)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(5, 5), "b": nn.Linear(5, 5)}).double()
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        x = torch.randn(N, 3, 5, generator=gen, dtype=torch.float64)
        stacked = torch.stack([model[head](x) for head in ["ab", "ba"][step]])
        return (stacked.tanh() * torch.arange(1.0, 3.0, dtype=torch.float64).view(2, 1, 1, 1)).sum((0, 2, 3))

    cockpit = _steps_of_norm_test(list(model.parameters()), losses_of)
    assert set(cockpit.routes().values()) == {"module-local: Linear rule"}


def test_the_checks_passes_hold_no_output_gradient_of_a_call_a_rule_serves(monkeypatch):
    """The first step's checks sum each call's forms as its output gradient arrives: none is held
    through the proof's passes, a second check (T5's shared position bias fails the first proof as
    one call for all samples and is checked again taken apart) or the user's pass. Held, they took
    T5's first step to 98 MiB at its peak against about 82 later (benchmarks/RESULTS.md). (Calls
    whose forms replay the module, T5's norms, are formed after the pass: not counted here.)"""
    from cockpit_fast.per_sample import engine
    from cockpit_fast.per_sample.capture import Capture

    model, batch, losses_of = build("hf_t5", torch.float32)
    x, _ = batch(N, torch.Generator().manual_seed(1))
    kept, alive_at_passes = [], []
    keep, arm = engine._SumsOnTheWay.keep, Capture.arm

    def recording_keep(self, call, grad, index):
        if grad is not None and call.rule is not None and set(call.params) <= call.direct and len(call.output_shapes) == 1:
            kept.append(weakref.ref(grad))
        return keep(self, call, grad, index)

    def checking_arm(self, keep=None):
        alive_at_passes.append(sum(ref() is not None for ref in kept))
        return arm(self, keep)

    monkeypatch.setattr(engine._SumsOnTheWay, "keep", recording_keep)
    monkeypatch.setattr(Capture, "arm", checking_arm)
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with _collector_off():
        training_step(model, None, (x, None), lambda out, _: losses_of(lambda _: out, x, None), cockpit=cockpit)
    assert len(kept) > 20 and len(alive_at_passes) >= 5  # two checks, their proofs, the user's pass
    assert alive_at_passes == [0] * len(alive_at_passes), alive_at_passes


def _gpt2_steps(cockpit, model, batch, losses_of, steps, inside=lambda: None):
    for step in range(steps):
        x, _ = batch(N, torch.Generator().manual_seed(step))
        losses = losses_of(model, x, None)
        model.zero_grad()
        with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
            inside()


def test_a_step_lets_go_of_each_calls_output_gradient_once_its_parameters_gradients_are_final(monkeypatch):
    """A step of one backward pass computes each parameter's statistics as its gradient arrives:
    its calls' output gradients are not held to the end of the pass (with the calls' inputs, they
    took a tracked step's memory to 1.4x a plain one's: BERT, benchmarks/RESULTS.md), on the first
    step too. The numbers are those of statistics computed after the pass, bit for bit."""
    from cockpit_fast.per_sample.capture import Capture

    model, batch, losses_of = build("hf_gpt2", torch.float32)
    fired, alive = [], []
    fire = Capture._fire

    def recording_fire(self, call, grads, broadcast=False):
        if self.armed and self._keep is None:  # the user's pass
            fired.extend(weakref.ref(g) for g in grads if g is not None)
        return fire(self, call, grads, broadcast)

    def count():
        alive.append((sum(ref() is not None for ref in fired), len(fired)))
        fired.clear()

    monkeypatch.setattr(Capture, "_fire", recording_fire)
    streamed = Cockpit(list(model.parameters()), quantities=configuration("economy", track_schedule=EVERY))
    with _collector_off():
        _gpt2_steps(streamed, model, batch, losses_of, 3, inside=count)
    assert [n for n, _ in alive] == [0, 0, 0] and min(total for _, total in alive) >= 10, alive
    monkeypatch.setattr("cockpit_fast.per_sample.engine.Engine.take", lambda *args: None)  # (all after the pass)
    after = Cockpit(list(model.parameters()), quantities=configuration("economy", track_schedule=EVERY))
    model.load_state_dict(build("hf_gpt2", torch.float32)[0].state_dict())
    _gpt2_steps(after, model, batch, losses_of, 3)
    assert repr(streamed.get_output()) == repr(after.get_output())


class _QueryReusedT5(nn.Module):
    def __init__(self, t5):
        super().__init__()
        self.t5 = t5

    def forward(self, ids):
        query = self.t5.model.encoder.block[0].layer[0].SelfAttention.q.weight
        spread = torch.linspace(-1, 1, self.t5.model.config.vocab_size, dtype=query.dtype)
        return self.t5(ids) + 0.1 * query.sum() * spread


def test_a_parameter_upstream_of_a_shared_call_taking_the_whole_graph_leaves_its_broadcast_alone():
    """T5 whose encoder query weight is read again outside its module (the whole graph for it
    alone): that pass goes through the broadcast of the shared position bias, whose hook read
    gradients the pass does not compute (TypeError)."""
    t5, batch, losses_of = build("hf_t5", torch.float64)
    model = _QueryReusedT5(t5)
    x, _ = batch(N, torch.Generator().manual_seed(1))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with pytest.warns(RuntimeWarning, match="q.weight"):
        training_step(model, None, (x, None), lambda out, _: losses_of(lambda _: out, x, None), cockpit=cockpit)
    routes = cockpit.routes()
    assert routes["t5.model.encoder.block.0.layer.0.SelfAttention.q.weight"] == "whole graph"
    assert routes["t5.model.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] == "module-local: Embedding rule"
    g = flat(oracle_grads(model, list(model.parameters()), losses_of, x, None))
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-7)


def test_only_parameters_upstream_of_a_training_batch_norm_take_the_whole_graph():
    model, batch, _ = build("batch_norm_training", torch.float64)
    x, y = batch(N, torch.Generator().manual_seed(1))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with pytest.warns(RuntimeWarning, match=r"\(lin.weight, lin.bias\) take the whole-graph route .*upstream"):
        training_step(model, None, (x, y), lambda out, labels: F.cross_entropy(out, labels, reduction="none"), cockpit=cockpit)
    routes = cockpit.routes()
    assert routes == {
        "lin.weight": "whole graph", "lin.bias": "whole graph", "bn.weight": "module-local: BatchNorm1d rule",
        "bn.bias": "module-local: BatchNorm1d rule", "head.weight": "module-local: Linear rule",
        "head.bias": "module-local: Linear rule",
    }


def test_the_whole_graphs_passes_hold_a_chunk_bounded_by_the_activations_and_stay_exact(monkeypatch):
    """A batched backward pass holds every activation's gradient once per sample of its chunk:
    where the activations are large the whole graph takes one sample a pass (a batch-norm CNN's
    32 samples at once took 8x a plain step's memory), with the same numbers."""
    from cockpit_fast.per_sample import grads as forms

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, track_running_stats=False), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 3)
    ).double()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 3, 16, 16, generator=gen, dtype=torch.float64), torch.randint(0, 3, (N,), generator=gen)
    # Room for every sample's parameters at once, for one sample's activations (N * 8 * 16 * 16 values each).
    monkeypatch.setattr(forms, "CHUNK_VALUES", N * 300 + 2 * N * 8 * 16 * 16)
    rows = []
    grad = torch.autograd.grad

    def recording(outputs, inputs, grad_outputs=None, is_grads_batched=False, **kwargs):
        if sys._getframe(1).f_code.co_name == "whole_graph_grads":  # the samples of each of its passes
            rows.append(grad_outputs.shape[0] if is_grads_batched else 1)
        return grad(outputs, inputs, grad_outputs, is_grads_batched=is_grads_batched, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", recording)
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with pytest.warns(RuntimeWarning, match="whole-graph route"):
        training_step(model, None, (x, y), lambda out, labels: F.cross_entropy(out, labels, reduction="none"), cockpit=cockpit)
    assert cockpit.routes()["0.weight"] == "whole graph"
    assert rows == [1] * N
    g = _oracle(model, x, y)
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-7)


class _NumpyTanh(torch.autograd.Function):
    """tanh whose backward runs in NumPy, as a user's own op may: vmap cannot batch it (as it
    cannot cuDNN's recurrent backward, which a GPU's GRU and LSTM run)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return torch.from_numpy(grad.detach().numpy() * (1 - y.detach().numpy() ** 2))


class _KeepsItsOutput(nn.Module):
    """No rule: replayed. Keeps its last output for logging (as attention maps are kept),
    computed with ``tanh`` (torch's, or a user's op that torch.func cannot transform)."""

    def __init__(self, tanh):
        super().__init__()
        self.weight, self.last, self.tanh = nn.Parameter(torch.randn(5, 6, dtype=torch.float64)), None, tanh
        self.register_buffer("last_mean", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.last = y = self.tanh(x @ self.weight)
        self.last_mean = y.detach().mean()  # (a buffer: held apart from the attributes)
        return y


@pytest.mark.parametrize("tanh", [torch.tanh, _NumpyTanh.apply], ids=["torch", "no_setup_context"])
def test_a_replayed_call_leaves_its_modules_attributes_and_runs_ops_torch_func_cannot(tanh):
    """A replay ran the module's forward again, which set its attribute (and, in eval mode, its
    buffer) to a tensor escaped from vmap: the user's model.last raised when read after a
    tracked step. And an op torch.func
    cannot transform sent the module to the whole graph: one sample at a time, autograd runs it."""
    torch.manual_seed(0)
    model = nn.Sequential(_KeepsItsOutput(tanh), nn.Linear(6, 3)).double().eval()  # (eval: the replay copies no buffer)
    params = [model[0].weight]
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(N, 5, generator=gen, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # (no whole graph's notice)
            warnings.filterwarnings("ignore", "There is a performance drop", UserWarning)  # (vmap's, falling back)
            _step_against_the_oracle(model, params, cockpit, GradientMetricCollector([gm.PNorm(params[0], p=2)]), step, x)
        torch.testing.assert_close(model[0].last, torch.tanh(x @ model[0].weight), rtol=0, atol=0)
        torch.testing.assert_close(model[0].last_mean, torch.tanh(x @ model[0].weight).mean(), rtol=0, atol=0)
    by = "with torch.func" if tanh is torch.tanh else "one sample at a time by autograd"
    assert cockpit.routes()["0.weight"] == f"module-local: _KeepsItsOutput replayed {by}"


def test_the_whole_graph_through_an_op_vmap_cannot_batch_takes_one_sample_a_pass():
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn, self.head = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.bn(_NumpyTanh.apply(self.lin(x))))

    model = Model().double()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (N,), generator=gen)
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with pytest.warns(RuntimeWarning, match=r"\(lin.weight, lin.bias\) take the whole-graph route"):
        training_step(model, None, (x, y), lambda out, labels: F.cross_entropy(out, labels, reduction="none"), cockpit=cockpit)
    assert cockpit.routes()["lin.weight"] == "whole graph"
    twin = copy.deepcopy(model)  # the oracle: one backward pass per sample through the batch's forward pass
    losses = F.cross_entropy(twin(x), y, reduction="none")
    g = one_pass_per_sample(losses, list(twin.parameters()))
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-10)


def test_lora_tracks_the_trainable_parameters_and_says_so_once():
    peft = pytest.importorskip("peft")
    model, batch, losses_of = build("hf_gpt2", torch.float64)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    trainable = [p for p in lora.parameters() if p.requires_grad]
    with pytest.warns(UserWarning, match=f"of the {len(list(lora.parameters()))} parameters given are frozen"):
        cockpit = Cockpit(lora.parameters(), quantities=[quantities.NormTest(EVERY), quantities.GradNorm(EVERY)])
    assert cockpit.params == trainable
    x, _ = batch(N, torch.Generator().manual_seed(1))
    training_step(lora, None, (x, None), lambda out, _: losses_of(lambda _: out, x, None), cockpit=cockpit)
    assert set(cockpit.routes().values()) == {"module-local: Linear rule"}
    g = flat(oracle_grads(lora, trainable, losses_of, x, None))
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-7)


def test_a_parameter_frozen_after_the_cockpit_was_made_is_a_clear_error():
    model = _mlp()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"tracked parameters \[0\] were frozen \(requires_grad=False\) after"):
        cockpit(0, info={})


class _PositionsFirst(nn.Module):
    """Positions looked up before the tokens, as ``pos(torch.arange(T))``: the first call's output
    is (T, E), no batch; with as many classes as positions every later call showed T along the
    dimension after the samples (and was taken as time-first until the model's input told N)."""

    def __init__(self, width=N, classes=3):
        super().__init__()
        self.pos, self.tok = nn.Embedding(8, width), nn.Embedding(11, width)
        self.mlp, self.head = nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, ids):
        h = self.pos(torch.arange(ids.shape[1])) + self.tok(ids)
        return self.head(torch.tanh(self.mlp(h)).mean(1))


def test_positions_looked_up_before_the_tokens_keep_the_models_samples_and_rules():
    torch.manual_seed(0)
    model = _PositionsFirst().double()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    losses_of = lambda m, a, b: F.cross_entropy(m(a), b, reduction="none")  # noqa: E731
    for step, tokens in enumerate([3, 4, 3]):  # 3 = the classes
        ids, y = torch.randint(0, 11, (N, tokens)), torch.randint(0, 3, (N,))
        model.zero_grad(set_to_none=True)
        losses = losses_of(model, ids, y)
        with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
        expected = gradient_tests(flat(oracle_grads(model, list(model.parameters()), losses_of, ids, y)))["NormTest"]
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected, rel=1e-10), step
    assert all(route.startswith("module-local") for route in cockpit.routes().values()), cockpit.routes()


class _TimeFirstInside(nn.Module):
    """Batch first outside, time first inside (as XLNet transposes its input): (T, N, E) tensors
    whose positions mix (a running mean over time), modules that say nothing of it."""

    def __init__(self, width=5, classes=3):
        super().__init__()
        self.inp, self.mix, self.head = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, x):  # x: (N, T, E)
        h = torch.tanh(self.inp(x.transpose(0, 1)))  # (T, N, E)
        steps = torch.arange(1, h.shape[0] + 1, dtype=h.dtype).view(-1, 1, 1)
        h = torch.tanh(self.mix(h.cumsum(0) / steps))  # each position reads the earlier ones
        return self.head(h.mean(0))


class _CalledBothWays(nn.Module):
    """One Linear called on time-first (T, N, E) tensors and again on batch-first (N, T, E) ones."""

    def __init__(self, width=5, classes=3):
        super().__init__()
        self.mix, self.head = nn.Linear(width, width), nn.Linear(width, classes)

    def forward(self, x):  # x: (N, T, E)
        h = torch.tanh(self.mix(x.transpose(0, 1)))
        steps = torch.arange(1, h.shape[0] + 1, dtype=h.dtype).view(-1, 1, 1)
        return self.head(torch.tanh(self.mix((h.cumsum(0) / steps).transpose(0, 1))).mean(1))


class _TimeFirstBlock(nn.Module):
    """A block with a parameter of its own that runs its child batch first, then mixes positions
    time first: its calls hold samples along dimension 1, its child's along 0."""

    def __init__(self, width=5):
        super().__init__()
        self.pre, self.scale = nn.Linear(width, width), nn.Parameter(torch.randn(width))

    def forward(self, x):  # x: (N, T, E)
        h = torch.tanh(self.pre(x)).transpose(0, 1) * self.scale
        steps = torch.arange(1, h.shape[0] + 1, dtype=h.dtype).view(-1, 1, 1)
        return h.cumsum(0) / steps


class _WithTimeFirstBlock(nn.Module):
    def __init__(self, width=5, classes=3):
        super().__init__()
        self.block, self.head = _TimeFirstBlock(width), nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.block(x).mean(0))


def _steps_against_the_oracle(model, lengths, reader):
    """Steps of ``(N, T, 5)`` inputs, T from ``lengths``, each checked against the float64
    oracle (the cockpit's NormTest or the collector's per-sample norms); each step's routes."""
    params = list(model.parameters())
    losses_of = lambda m, a, b: F.cross_entropy(m(a), b, reduction="none")  # noqa: E731
    if reader == "cockpit":
        watching = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    else:
        watching = GradientMetricCollector([gm.PNorm(p, p=2) for p in params])
    routes = []
    for step, length in enumerate(lengths):
        x, y = torch.randn(N, length, 5, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the whole graph's notice)
            losses = losses_of(model, x, y)
            if reader == "cockpit":
                with watching(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
                    losses.mean().backward()
            else:
                rows = watching(losses)  # (N, parameters): each sample's norm of each
        oracle = oracle_grads(model, params, losses_of, x, y)
        if reader == "cockpit":
            got, expected = watching.get_output()[step]["NormTest"], gradient_tests(flat(oracle))["NormTest"]
            assert got == pytest.approx(expected, rel=1e-10), (step, length)
        else:
            expected = torch.stack([g.flatten(1).norm(dim=1) for g in oracle], 1)
            torch.testing.assert_close(rows.double(), expected, rtol=1e-10, atol=0, msg=f"step {step}, T = {length}")
        routes.append((watching if reader == "cockpit" else watching._engine).routes())
    return routes


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
@pytest.mark.parametrize("lengths", [(N, N, N), (N + 2, N, N)], ids=["T_eq_N_first", "T_eq_N_later"])
def test_time_first_inside_with_as_many_positions_as_samples_stays_module_local(reader, lengths):
    """T == N: the sizes cannot tell positions from samples; where the proof (or, at T != N, the
    sizes) found a module's samples along dimension 1, its calls stay there on later steps."""
    torch.manual_seed(0)
    for step, routes in enumerate(_steps_against_the_oracle(_TimeFirstInside().double(), lengths, reader)):
        assert all(route.startswith("module-local") for route in routes.values()), (step, routes)


@pytest.mark.parametrize("keywords", [False, True])
def test_hf_xlnet_time_first_inside_with_as_many_positions_as_samples(keywords):
    """Hugging Face XLNet transposes its batch-first input and runs time first; at T == N its
    calls raised (KeyError) or took the whole graph. Called with keywords alone
    (``model(input_ids=ids)``), torch's global pre-hooks see no input: the samples came from
    its first call's time-first output, T, and at T != N every call took the whole graph."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=13, d_model=8, n_layer=1, n_head=2, d_inner=16, dropout=0.0, mem_len=None)
    xlnet = transformers.XLNetLMHeadModel(config).double()
    unused = ("mask_emb", "r_s_bias", "seg_embed")  # (no masked tokens, no segments)
    params = [p for name, p in xlnet.named_parameters() if not name.endswith(unused)]

    def losses_of(model, ids, _, keywords=False):
        logits = (model(input_ids=ids) if keywords else model(ids)).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)

    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step, length in enumerate([N + 1, N, N] if keywords else [N, N, N + 1]):
        ids = torch.randint(1, 13, (N, length), generator=gen)
        xlnet.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no whole-graph notice
            losses = losses_of(xlnet, ids, None, keywords)
            with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward()
        expected = gradient_tests(flat(oracle_grads(xlnet, params, losses_of, ids, None)))["NormTest"]
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected, rel=1e-10), step
    assert all(route.startswith("module-local") for route in cockpit.routes().values()), cockpit.routes()


def test_a_guess_where_sizes_cannot_tell_is_proven_at_the_next_step_with_individual_losses():
    """A first step at T == N without individual losses takes the calls batch first (a guess,
    wrong here: README); the guess is neither remembered nor taken as checked, so the next step
    with losses proves where the samples are, and later steps without them keep it."""
    torch.manual_seed(0)
    model = _TimeFirstInside().double()
    params = list(model.parameters())
    losses_of = lambda m, a, b: F.cross_entropy(m(a), b, reduction="none")  # noqa: E731
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    for step, given in enumerate([False, True, False]):
        x, y = torch.randn(N, N, 5, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad(set_to_none=True)
        losses = losses_of(model, x, y)
        info = {"batch_size": N, "loss": losses.mean(), **({"individual_losses": losses} if given else {})}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with cockpit(step, info=info):
                losses.mean().backward()
        # The guess is said (it was silent: wrong numbers, no word), once; a proven layout is no guess.
        guessed = [str(w.message) for w in caught if "as many positions as samples" in str(w.message)]
        assert len(guessed) == (step == 0), (step, guessed)
        assert not guessed or "4 tracked parameters (inp.weight, inp.bias, mix.weight, mix.bias)" in guessed[0], guessed
        if step:
            expected = gradient_tests(flat(oracle_grads(model, params, losses_of, x, y)))["NormTest"]
            assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected, rel=1e-10), step
    assert all(route.startswith("module-local") for route in cockpit.routes().values()), cockpit.routes()


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
def test_a_module_called_time_first_and_batch_first_is_exact_where_sizes_cannot_tell(reader):
    torch.manual_seed(0)
    routes = _steps_against_the_oracle(_CalledBothWays().double(), (N, N, N + 2), reader)
    assert routes[0]["mix.weight"].startswith("module-local")  # the proof told each call's samples
    assert routes[1]["mix.weight"] == "whole graph"  # no proof at the second step: sizes alone
    assert routes[2]["mix.weight"].startswith("module-local")  # sizes tell


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
def test_the_children_of_a_module_found_time_first_keep_their_own_samples(reader):
    torch.manual_seed(0)
    routes = _steps_against_the_oracle(_WithTimeFirstBlock().double(), (N, N, N + 2, N), reader)
    assert all(r["block.pre.weight"].startswith("module-local") for r in routes), routes


@pytest.mark.parametrize("reader", ["cockpit", "collector"])
def test_a_sparse_embedding_is_a_clear_error_in_the_forward_pass(reader):
    model = nn.Sequential(nn.Embedding(9, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3))
    if reader == "cockpit":  # (held in a name: its hooks live as long as it does)
        watching = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    else:
        watching = GradientMetricCollector([gm.PNorm(model, p=2)])
    with pytest.raises(ValueError, match=r"Embedding\(sparse=True\) gives its weight a sparse gradient.*sparse=False"):
        model(torch.randint(0, 9, (N, 3)))


def _key_biases_alone(family):
    """A model whose key projections' biases get a gradient zero in exact arithmetic (softmax
    ignores a shift every key shares), their parameters, and its samples' losses."""
    torch.manual_seed(0)
    if family == "bert":
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
        )
        model = transformers.BertForSequenceClassification(config)
        params = [p for name, p in model.named_parameters() if name.endswith("key.bias")]
        return params, lambda ids, y: F.cross_entropy(model(ids).logits, y, reduction="none")
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    embedding, head = nn.Embedding(50, 16), nn.Linear(16, 3)
    return [attention.in_proj_bias], lambda ids, y: F.cross_entropy(head(attention(*[embedding(ids)] * 3)[0].mean(1)), y, reduction="none")


@pytest.mark.parametrize("family", ["bert", "multihead_attention"])
def test_tracking_only_gradients_zero_in_exact_arithmetic_is_no_false_alarm(family):
    """Biases summed over positions to rounding noise were checked against that noise (their
    own magnitude): tracked alone, with no other parameter's scale to go by, HF BERT's key
    biases took the whole graph and the first step said backward() ran on another loss. The
    magnitude is now that of the terms summed (a bias's output gradients)."""
    params, losses_of = _key_biases_alone(family)
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        ids, y = torch.randint(0, 50, (N, 7), generator=gen), torch.randint(0, 3, (N,), generator=gen)
        for p in params:
            p.grad = None
        losses = losses_of(ids, y)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward()
    assert all(route.startswith("module-local") for route in cockpit.routes().values()), cockpit.routes()


@pytest.mark.parametrize("backward, warned", [("sum", True), ("mean", False), ("mean_plus_decay", True), ("mean_bf16", False)])
def test_a_first_step_whose_backward_ran_on_another_loss_is_warned_of(backward, warned):
    model = _mlp()
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=backward.endswith("bf16")):
        losses = F.cross_entropy(model(x).float(), y, reduction="none")
    ran_on = {
        "sum": losses.sum(), "mean": losses.mean(), "mean_bf16": losses.mean(),
        "mean_plus_decay": losses.mean() + sum(p.square().sum() for p in model.parameters()),
    }[backward]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            ran_on.backward()
    said = [str(w.message) for w in caught if "backward() ran on another loss" in str(w.message)]
    assert len(said) == warned, said
    if backward == "sum":
        assert said[0].startswith(f"the backward pass's gradient is {1 - 1 / N:.3g} of its norm away")


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.first(t)), x, use_reentrant=False)
        return self.second(h)


def test_routes_name_the_models_parameters_under_activation_checkpointing():
    # The backward pass recomputes `first` alone: its call is not the model, whose names count.
    torch.manual_seed(0)
    model = _Checkpointed()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    for step in range(2):
        model.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
        assert list(cockpit.routes()) == [name for name, _ in model.named_parameters()], step
    unchecked = nn.Sequential(model.first, nn.Tanh(), model.second)  # the same function (torch.func refuses checkpoints)
    assert cockpit.get_output()[1]["NormTest"] == pytest.approx(gradient_tests(_oracle(unchecked, x, y))["NormTest"], rel=1e-4)


def test_a_composable_checkpoint_is_a_clear_error_where_the_step_needs_passes_of_its_own():
    """torch.distributed._composable.checkpoint recomputes its module in a context made once per
    forward pass: a second backward pass through it raised an AttributeError from contextlib
    inside the checks' pass. Now the checks say which module and what to use instead; steps
    that need no pass of their own (without individual losses) keep the oracle's numbers."""
    from torch.distributed._composable import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)).double()
    checkpoint(model[1])
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    x, y = torch.randn(N, 5, dtype=torch.float64), torch.randint(0, 3, (N,))
    losses = F.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(ValueError, match=r"^1 is checkpointed with torch\.distributed\._composable\.checkpoint.*use_reentrant=False"):
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    unchecked = nn.Sequential(model[0], model[1][0], model[1][1], model[2])  # (torch.func refuses checkpoints)
    for step in (1, 2):
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with cockpit(step, info={"batch_size": N, "loss": loss}):
            loss.backward()
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(_oracle(unchecked, x, y))["NormTest"], rel=1e-9), step


def test_a_replayed_calls_per_sample_gradients_carry_no_graph():
    # GPTLike's own call is replayed for its positions: through its blocks' parameters, read as
    # they are, the per-sample gradients carried their graph (torch warned on reading them).
    from any_models import GPTLike, token_losses

    torch.manual_seed(0)
    model = GPTLike(width=16, tokens=6, layers=1)
    ids = torch.randint(0, 13, (N, 6), generator=torch.Generator().manual_seed(1))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    losses = token_losses(model(ids), ids)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Converting a tensor with requires_grad=True")
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    assert "replayed with torch.func" in cockpit.routes()["position"]
    assert cockpit.get_output()[0]["NormTest"] > 0


def test_two_cockpits_on_one_model_each_get_the_oracles_numbers():
    model = _mlp()
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    first = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    second = Cockpit(list(model[2].parameters()), quantities=[quantities.NormTest(EVERY)])
    expected = _oracle(model, x, y)
    for cockpit, g in ((first, expected), (second, expected[:, -(16 * 3 + 3):])):
        model.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
        assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-4)


def test_two_cockpits_around_one_backward_pass_each_get_the_oracles_numbers():
    # Each keeps the step's gradient with a hook on the parameters: the other's per-sample
    # gradients must not pass through it (they were added to its gradient, as a second pass).
    model = _mlp()
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    outer = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    inner = Cockpit(list(model.parameters()), quantities=[quantities.InnerTest(EVERY), quantities.GradNorm(EVERY)])
    g = _oracle(model, x, y)
    losses = F.cross_entropy(model(x), y, reduction="none")
    info = {"batch_size": N, "individual_losses": losses, "loss": losses.mean()}
    with outer(0, info=info), inner(0, info=dict(info)):
        losses.mean().backward()
    assert outer.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-4)
    norms = [float(part.mean(0).norm()) for part in g.split([p.numel() for p in model.parameters()], 1)]
    assert inner.get_output()[0]["GradNorm"] == pytest.approx(norms, rel=1e-4)


def test_a_head_a_step_skips_after_the_checks_saw_it_is_unused_not_sent_to_the_whole_graph():
    """Heads used at steps 0 and 2 and at step 1 only: at step 2 no call and no path of the graph
    reaches the second. It took the whole graph (a pass for nothing, a warning that it was used
    outside any module), and its zero form, with no gradient, raised KeyError (a review's
    .scratch/review39/unused_param.py)."""
    torch.manual_seed(0)
    trunk, heads = nn.Linear(5, 16), [nn.Linear(16, 3), nn.Linear(16, 3)]
    params = [*trunk.parameters(), *heads[0].parameters(), *heads[1].parameters()]
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(2)
    for step, head in enumerate([0, 1, 0]):
        model = nn.Sequential(trunk, nn.Tanh(), heads[head])
        x, y = torch.randn(N, 5, generator=gen), torch.randint(0, 3, (N,), generator=gen)
        losses = F.cross_entropy(model(x), y, reduction="none")
        for p in params:
            p.grad = None
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward()
        assert not [w for w in said if "whole-graph route" in str(w.message)], step
        # (the head the step skips: every sample's gradient zero, which adds nothing to NormTest)
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(_oracle(model, x, y))["NormTest"], rel=1e-4)


def test_statistics_that_raise_in_the_backward_pass_raise_when_the_step_ends(monkeypatch):
    """Statistics computed as gradients arrive raise nothing inside the backward pass (autograd
    would carry the error out of backward() half done): the step raises it on exit, as it did
    when they were computed after the pass."""
    from cockpit_fast import statistics

    model = _mlp()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    compute = statistics.compute_statistics

    def failing(index, *args, **kwargs):
        if index == 1:
            raise ArithmeticError("statistics of parameter 1")
        return compute(index, *args, **kwargs)

    for step in range(2):
        x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
        losses = F.cross_entropy(model(x), y, reduction="none")
        model.zero_grad()
        if step:
            monkeypatch.setattr(statistics, "compute_statistics", failing)
        finished = []
        with contextlib.ExitStack() as raised:
            if step:
                raised.enter_context(pytest.raises(ArithmeticError, match="statistics of parameter 1"))
            with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward()
                finished.append(all(p.grad is not None for p in model.parameters()))
        assert finished == [True]  # the pass ran to its end


def test_two_cockpits_around_one_backward_pass_with_the_whole_graph_get_a_lone_cockpits_numbers():
    """A batch norm sends the parameters upstream of it to the whole graph: one cockpit's batched
    passes of the whole graph are no part of the other's step (counted as backward passes of its
    step, they refused it: "10 backward passes ran for one step")."""
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    outer = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    inner = Cockpit(list(model.parameters()), quantities=[quantities.InnerTest(EVERY)])
    alone = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY), quantities.InnerTest(EVERY)])
    for step in range(2):
        x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
        for cockpits in ((outer, inner), (alone,)):
            model.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            with contextlib.ExitStack() as stack:
                for cockpit in cockpits:
                    stack.enter_context(cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}))
                losses.mean().backward()
    for step in range(2):
        assert outer.get_output()[step]["NormTest"] == alone.get_output()[step]["NormTest"]
        assert inner.get_output()[step]["InnerTest"] == alone.get_output()[step]["InnerTest"]


def test_a_hook_with_a_side_effect_runs_once_per_sample_in_the_collector_as_in_gradient_metrics():
    model = _mlp()
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(1))
    collector = GradientMetricCollector([gm.PNorm(model[0].weight, p=2)])
    collector(F.cross_entropy(model(torch.randn(5, 5)), torch.randint(0, 3, (5,)), reduction="none"))
    assert len(calls) == 5


def test_the_collectors_first_call_ends_its_step_as_its_later_calls_do():
    """The first call forms from the checks' own pass; it still ends the step as later calls do:
    the forward pass's calls are spent (the next call plans for its own forward pass). Taken
    again from the same graph, the per-sample gradients take the whole graph, and say why."""
    model = _mlp()
    collector = GradientMetricCollector([gm.PNorm(model, p=2)])
    losses = F.cross_entropy(model(torch.randn(N, 5)), torch.randint(0, 3, (N,)), reduction="none")
    first = collector(losses, retain_graph=True)
    assert collector._engine.capture.calls() == []
    with pytest.warns(RuntimeWarning, match="gone through by an earlier tracked backward pass"):
        torch.testing.assert_close(collector(losses), first)


def test_a_nan_in_one_samples_input_leaves_the_other_samples_metrics_alone():
    model = _mlp()
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    x[2, 1] = float("nan")
    collector = GradientMetricCollector([gm.PNorm(model, p=2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no slower route taken
        values = collector(F.cross_entropy(model(x), y, reduction="none"))[:, 0]
    clean = torch.arange(N) != 2
    assert values[2].isnan() and not values[clean].isnan().any()
    expected = _oracle(model, x[clean], y[clean]).norm(dim=1)
    torch.testing.assert_close(values[clean].double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("made", ["before", "after"])
def test_a_compiled_model_matches_the_eager_one_with_the_cockpit_made_before_or_after_it_ran(made):
    eager = _mlp()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model)
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))

    def cockpit_of(m):
        return Cockpit(list(m.parameters()), quantities=[quantities.NormTest(EVERY), quantities.GradNorm(EVERY)])

    cockpit = cockpit_of(model) if made == "before" else None
    F.cross_entropy(compiled(x), y).backward()  # compiled and run once, its backward with donated buffers
    cockpit = cockpit or cockpit_of(model)
    outputs = []
    for m, c in ((compiled, cockpit), (eager, cockpit_of(eager))):
        m.zero_grad()
        losses = F.cross_entropy(m(x), y, reduction="none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notice of global hooks under torch.compile
            with c(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward()
        outputs.append(c.get_output()[0])
    assert outputs[0]["NormTest"] == pytest.approx(outputs[1]["NormTest"], rel=1e-5)
    assert outputs[0]["GradNorm"] == pytest.approx(outputs[1]["GradNorm"], rel=1e-5)


@pytest.mark.parametrize(
    "info, message",
    [
        (lambda losses: {"batch_size": 2 * N, "individual_losses": losses, "loss": losses.mean()},
         rf"info\['individual_losses'\] holds {N} losses but info\['batch_size'\] is {2 * N}"),
        (lambda losses: {"batch_size": N // 2, "individual_losses": losses[: N // 2], "loss": losses[: N // 2].mean()},
         rf"info\['batch_size'\] tells {N // 2} samples, but the forward pass .* had {N}"),
        (lambda losses: {"individual_losses": losses[:-1], "loss": losses[:-1].mean()},
         rf"info\['individual_losses'\] tells {N - 1} samples, but the forward pass .* had {N}"),
        (lambda losses: {"batch_size": 2 * N, "loss": losses.mean()},
         rf"info\['batch_size'\] tells {2 * N} samples, but the forward pass .* had {N}"),
    ],
)
def test_info_that_disagrees_with_the_forward_pass_is_a_clear_error(info, message):
    model = _mlp()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY), quantities.Alpha(EVERY)])
    losses = F.cross_entropy(model(torch.randn(N, 5)), torch.randint(0, 3, (N,)), reduction="none")
    with pytest.raises(ValueError, match=message):
        with cockpit(0, info=info(losses)):
            raise AssertionError("the backward pass must not start")


def _accumulation_steps(model, cockpit, micro_batches, first_outside=False):
    model.zero_grad()
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)) for n in micro_batches]
    if first_outside:
        x, y = batches.pop(0)
        F.cross_entropy(model(x), y).backward()
    total = sum(micro_batches)
    with cockpit(0, info={"batch_size": total}):
        for x, y in batches:
            (F.cross_entropy(model(x), y, reduction="sum") / total).backward()


@pytest.mark.parametrize("first_outside", [False, True])
def test_gradient_accumulation_is_a_clear_error_not_wrong_numbers(first_outside):
    model = _mlp()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.GradHist1d(EVERY)])
    match = "hold gradients from before" if first_outside else "2 backward passes ran for one step"
    with pytest.raises(ValueError, match=match):
        _accumulation_steps(model, cockpit, [4, 3], first_outside)


def test_no_backward_pass_inside_the_block_is_a_clear_error():
    model = _mlp()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    losses = F.cross_entropy(model(torch.randn(N, 5)), torch.randint(0, 3, (N,)), reduction="none")
    with pytest.raises(ValueError, match=r"no backward pass reached the tracked parameters inside `with cockpit"):
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            pass


def test_a_grad_scalers_scale_is_divided_out():
    model = _mlp()
    twin = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(16, 5, generator=gen), torch.randint(0, 3, (16,), generator=gen)) for _ in range(2)]
    outputs = []
    for m, scale in ((model, scaler), (twin, None)):
        tracked = [quantities.NormTest(EVERY), quantities.InnerTest(EVERY), quantities.GradNorm(EVERY),
                   quantities.GradHist1d(EVERY, bins=9, range=(-0.5, 0.5))]
        cockpit = Cockpit(list(m.parameters()), quantities=tracked)
        for step, (x, y) in enumerate(batches):  # step 0 checks from the losses, step 1 from the backward pass
            m.zero_grad()
            losses = F.cross_entropy(m(x), y, reduction="none")
            info = {"batch_size": 16, "individual_losses": losses, "loss": losses.mean()}
            if scale is not None:
                info["grad_scaler"] = scale
            with cockpit(step, info=info):
                (losses.mean() if scale is None else scale.scale(losses.mean())).backward()
        outputs.append(cockpit.get_output())
    for step in range(2):
        scaled, plain = outputs[0][step], outputs[1][step]
        for key in ("NormTest", "InnerTest", "GradNorm"):
            assert scaled[key] == pytest.approx(plain[key], rel=1e-5), (step, key)
        assert numpy.array_equal(scaled["GradHist1d"]["hist"], plain["GradHist1d"]["hist"])


@pytest.mark.parametrize("change", ["clip", "unscale", "zero"])
def test_a_gradient_changed_in_place_inside_the_block_is_refused_and_after_it_is_not(change):
    """Clipping or unscaling ``param.grad`` inside the block changed the tensor the cockpit kept
    (autograd hands it on as ``param.grad`` where that was None): the statistics of the step
    were read from two different gradients, OrthoTest NaN and InnerTest 100x off (a review's
    scripts in .scratch/review39). Refused, naming the fix; after the block the numbers are
    those of a step without it."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 5, generator=gen), torch.randint(0, 3, (N,), generator=gen)
    outputs = {}
    for where in ("nowhere", "after", "inside"):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        changes = {
            "clip": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3),
            "unscale": lambda: scaler.unscale_(opt),
            "zero": lambda: opt.zero_grad(set_to_none=False),
        }
        cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy", track_schedule=EVERY))
        losses = F.cross_entropy(model(x), y, reduction="none")
        info = {"batch_size": N, "individual_losses": losses, "loss": losses.mean(), "optimizer": opt, "grad_scaler": scaler}
        with pytest.raises(ValueError, match=r"\[Step 0\] the gradient of 4 tracked parameters \(0.weight, 0.bias, 2.weight, 2.bias\) was changed in place inside `with cockpit.*after the `with` block") if where == "inside" else contextlib.nullcontext():
            with cockpit(0, info=info):
                scaler.scale(losses.mean()).backward()
                if where == "inside":
                    changes[change]()
        if where == "after":
            changes[change]()
        outputs[where] = cockpit.get_output()
    assert repr(outputs["after"]) == repr(outputs["nowhere"]) and "NormTest" in outputs["after"][0]


def _steps(model, cockpit, steps, gen, hand_in_losses=True):
    for step in steps:
        model.zero_grad()
        x, y = torch.randn(N, 5, generator=gen), torch.randint(0, 3, (N,), generator=gen)
        losses = F.cross_entropy(model(x), y, reduction="none")
        info = {"batch_size": N, "loss": losses.mean(), **({"individual_losses": losses} if hand_in_losses else {})}
        with cockpit(step, info=info):
            losses.mean().backward()
    return x, y


def test_the_forward_pass_of_a_step_no_quantity_tracks_is_not_watched():
    model = _mlp()
    every_other = lambda step: step % 2 == 0  # noqa: E731
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(every_other)])
    gen = torch.Generator().manual_seed(0)
    _steps(model, cockpit, [0, 1], gen)
    assert cockpit._engine.watching  # step 2 is tracked
    _steps(model, cockpit, [2], gen)
    assert not cockpit._engine.watching  # step 3 is not: its forward pass costs nothing more
    outputs = model(torch.randn(N, 5))
    assert cockpit._engine.capture.calls() == []
    del outputs
    x, y = _steps(model, cockpit, [3, 4], gen)
    assert sorted(cockpit.get_output()) == [0, 2, 4]
    assert set(cockpit.routes().values()) == {"module-local: Linear rule"}
    assert cockpit.get_output()[4]["NormTest"] == pytest.approx(gradient_tests(_oracle(model, x, y))["NormTest"], rel=1e-4)


def test_a_step_number_that_skips_ahead_to_a_tracked_step_takes_the_whole_graph_and_says_why():
    model = _mlp()
    every_other = lambda step: step % 2 == 0  # noqa: E731
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(every_other)])
    gen = torch.Generator().manual_seed(1)
    _steps(model, cockpit, [0, 1, 2], gen)  # step 3 untracked: not watched
    with pytest.warns(RuntimeWarning, match="forward pass ran while the cockpit was not watching"):
        x, y = _steps(model, cockpit, [6], gen)  # its forward pass was not watched: exact all the same
    assert cockpit.get_output()[6]["NormTest"] == pytest.approx(gradient_tests(_oracle(model, x, y))["NormTest"], rel=1e-4)
    x, y = _steps(model, cockpit, [8], gen)  # watched again
    assert set(cockpit.routes().values()) == {"module-local: Linear rule"}
    _steps(model, cockpit, [9, 10], gen)
    cockpit.expect(14)  # a loop that opens the step after its forward pass says which comes
    _steps(model, cockpit, [14], gen, hand_in_losses=False)
    assert set(cockpit.routes().values()) == {"module-local: Linear rule"}
    _steps(model, cockpit, [15, 16], gen)
    with pytest.raises(ValueError, match="not watching"):
        _steps(model, cockpit, [20], gen, hand_in_losses=False)


def test_the_calls_of_a_step_and_their_graph_are_let_go_after_it():
    import gc

    from cockpit_fast.per_sample.capture import Call

    model = _mlp()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(N, 7, 5, generator=gen), torch.randint(0, 3, (N,), generator=gen)
        model.zero_grad()
        losses = F.cross_entropy(model(x).mean(1), y, reduction="none")
        with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
        del losses
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, Call) and o.module in list(model.modules())], step


@pytest.mark.parametrize("modes", [("eval", "train", "train"), ("eval", "eval", "train")])
def test_a_batch_norm_put_in_training_mode_after_the_checks_sends_the_calls_upstream_to_the_whole_graph(modes):
    """The checks of an eval-mode step found every call module-local; a later step in training
    mode mixes the samples of the calls upstream of the batch norm: checked again, not taken as
    checked (the first layer's statistics were wrong with no word, in both layers)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()
    weight = model[0].weight
    cockpit = Cockpit([weight], quantities=[quantities.NormTest(EVERY)])
    collector = GradientMetricCollector([gm.PNorm(weight, p=2)])
    for step, mode in enumerate(modes):
        model.train(mode == "train")
        _step_against_the_oracle(model, [weight], cockpit, collector, step, torch.randn(8, 10, dtype=torch.float64))


def _step_against_the_oracle(model, params, cockpit, collector, step, x):
    """A step of the ``cockpit`` and a call of the ``collector`` (the PNorm of each of ``params``)
    on ``x`` and random labels, each checked against a backward pass per sample."""
    y = torch.randint(0, 3, (x.shape[0],))
    model.zero_grad()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the whole graph's notice)
        with cockpit(step, info={"batch_size": x.shape[0], "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward(retain_graph=True)
        g = one_pass_per_sample(losses, params)
        norms = collector(F.cross_entropy(model(x), y, reduction="none"))  # (a batch norm: the same batch statistics)
    assert cockpit.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-9), step
    expected = torch.stack([gp.flatten(1).norm(dim=1) for gp in _per_parameter(g, params)], 1)
    torch.testing.assert_close(norms.double().reshape(expected.shape), expected, rtol=1e-9, atol=0, msg=f"step {step}")


@pytest.mark.parametrize("layer", ["instance_norm", "legacy_spectral_norm"])
def test_a_replay_in_training_mode_leaves_the_models_buffers_as_a_plain_step_does(layer):
    """A call replayed with torch.func (or tried, on the checks' step) runs its module again: an
    instance norm's running statistics, a legacy spectral norm's power iteration were updated
    once more each time, and the model trained on differed from an untracked one."""
    torch.manual_seed(0)
    if layer == "instance_norm":
        model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4, affine=True, track_running_stats=True), nn.Flatten(), nn.Linear(24, 3))
        x = torch.randn(N, 2, 8, dtype=torch.float64)
    else:
        model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(5, 8)), nn.Tanh(), nn.Linear(8, 3))
        x = torch.randn(N, 5, dtype=torch.float64)
    model = model.double().train()
    plain = copy.deepcopy(model)
    y = torch.randint(0, 3, (N,))
    losses_of = lambda m: F.cross_entropy(m(x), y, reduction="none")  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the whole graph's notice)
        _steps_of_norm_test(list(model.parameters()), lambda step: losses_of(model), steps=2)
        GradientMetricCollector([gm.PNorm(model, p=2)])(losses_of(model))
    for _ in range(3):  # the same forward passes, untracked
        losses_of(plain)
    for (name, tracked), untracked in zip(model.named_buffers(), plain.buffers()):
        assert torch.equal(tracked, untracked), name



def _prune(layer):
    prune.l1_unstructured(layer, "weight", amount=0.5)


class _Doubled(nn.Module):
    def forward(self, weight):
        return 2 * torch.tanh(weight)


# change -> (what the model has from the start, what changes it after the first step)
def _center_the_batch(module):
    module.register_forward_hook(lambda m, a, out: out - 0.5 * out.mean(0))


class _ReadsItsChild(nn.Module):
    """Reads ``lin``'s parameters without calling it, as nn.MultiheadAttention reads its out_proj."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(6, 7), nn.Linear(7, 3)

    def forward(self, x):
        return self.out(torch.tanh(F.linear(x, self.lin.weight * 1.0, self.lin.bias)))


# change -> (the model, a change made before the first step or None, one made after it)
_SET_UP_OTHERWISE = {
    "pruned": (None, lambda model: _prune(model[0])),
    "pruning_removed": (lambda model: _prune(model[0]), lambda model: prune.remove(model[0], "weight")),
    "parametrized": (None, lambda model: parametrize.register_parametrization(model[0], "weight", _Doubled())),
    "hooked_to_mix_the_samples": (None, lambda model: _center_the_batch(model[0])),
    "activation_hooked_to_mix_the_samples": (None, lambda model: _center_the_batch(model[1])),
    "model_hooked_to_mix_the_samples": (None, _center_the_batch),
    "unused_child_parametrized": (None, lambda model: parametrize.register_parametrization(model.lin, "weight", _Doubled())),
}


@pytest.mark.parametrize("change", list(_SET_UP_OTHERWISE))
def test_a_module_set_up_otherwise_after_the_checks_is_checked_again(change):
    """A module pruned, unpruned, parametrized or given a forward hook after the first step (a
    layer, an activation without parameters, the model; a submodule whose parent reads its
    parameters without calling it): its calls kept the route the first step had checked (a
    pruned weight's rule ignored the mask, a hook mixing the samples went unseen), and the
    statistics were wrong with no word, in both layers (NormTest 1.2586 for 1.0950)."""
    torch.manual_seed(0)
    if change.startswith("unused_child"):
        model = _ReadsItsChild().double()
    else:
        model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    before, after = _SET_UP_OTHERWISE[change]
    if before is not None:
        before(model)
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    collector = GradientMetricCollector([gm.PNorm(p, p=2) for p in params])
    for step in range(3):
        if step == 1:
            after(model)
        _step_against_the_oracle(model, params, cockpit, collector, step, torch.randn(8, 6, dtype=torch.float64))


def _per_parameter(flat_grads, params):
    """``(N, D)`` flattened gradients of ``params`` split into ``[(N, *shape)]``."""
    sizes = [p.numel() for p in params]
    return [part.reshape(-1, *p.shape) for part, p in zip(flat_grads.split(sizes, dim=1), params)]


@pytest.mark.parametrize("late", [False, True], ids=["from_the_start", "after_the_first_step"])
def test_a_parameter_hook_that_is_not_linear_is_warned_of(late):
    """A clip hooked on a parameter applies to each sample's gradient and to the mini-batch
    gradient apart: the one does not add up to the other, and the statistics set one against
    the other (NormTest 2.28 where the hooked samples' own mean gives 0.98) with no word. A
    linear hook (a mask, a scale) is not warned of. A hook registered after the first step is
    a setup checked again."""
    torch.manual_seed(0)
    for hook, warned in [(lambda g: g * 3, False), (lambda g: g.clamp(-0.01, 0.01), True)]:
        model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)).double()
        cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
        said = []
        for step in range(2 if late else 1):
            if step == int(late):
                model[0].weight.register_hook(hook)
            model.zero_grad()
            x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
            losses = F.cross_entropy(model(x), y, reduction="none")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with cockpit(step, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
                    losses.mean().backward()
                GradientMetricCollector([gm.PNorm(model, p=2)])(F.cross_entropy(model(x), y, reduction="none"))
            said += [str(w.message) for w in caught if "are not linear" in str(w.message)]
        assert said == ([said[0]] if warned else []), said
        if warned:
            assert "the hooks on 1 tracked parameter (0.weight) are not linear" in said[0]


def test_a_module_that_changes_its_parameters_data_in_its_forward_pass_is_replayed_on_copies():
    """A learnable fake quantizer clamps its scale's data in place in its forward pass; its
    replay (the checks', the statistics') ran on the parameter itself, and the user's backward
    pass then refused the step ("modified by an inplace operation"). Its numbers are checked
    against the oracle in float32: torch's fake quantization takes no float64."""
    from torch.ao.quantization import MovingAverageMinMaxObserver
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

    torch.manual_seed(0)
    quantize = _LearnableFakeQuantize(MovingAverageMinMaxObserver, quant_min=0, quant_max=255, scale=0.05, zero_point=128.0)
    quantize.enable_param_learning()
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), quantize, nn.Linear(7, 3))
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    for step in range(2):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        model.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch's notice of a batching rule it lacks)
            with cockpit(step, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward(retain_graph=True)
        g = one_pass_per_sample(losses, params).double()
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-5), step


def test_a_scripted_submodule_takes_the_whole_graph():
    """A torch.jit.script-ed submodule: an AttributeError in the forward pass (its module dict
    has no get), in both layers; now its parameters take the whole graph, which says so."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (torch's: jit is deprecated)
        model = nn.Sequential(torch.jit.script(nn.Sequential(nn.Linear(6, 7), nn.Tanh())), nn.Linear(7, 3)).double()
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    losses = F.cross_entropy(model(x), y, reduction="none")
    with pytest.warns(RuntimeWarning, match=r"0\.0\.weight, 0\.0\.bias\) take the whole-graph route"):
        with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward(retain_graph=True)
    g = one_pass_per_sample(losses, params)
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the whole graph's notice)
        norms = GradientMetricCollector([gm.PNorm(model, p=2)])(F.cross_entropy(model(x), y, reduction="none"))
    torch.testing.assert_close(torch.as_tensor(norms).flatten().double(), g.norm(dim=1), rtol=1e-9, atol=0)

class _TwoLayersOneWeight(nn.Module):
    """No rule: replayed with torch.func. Reads its two children's tied weight, calling neither."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x):
        return F.linear(torch.sin(F.linear(x, self.a.weight, self.a.bias)), self.b.weight, self.b.bias)


class _OwnWeightTiedToItsChilds(nn.Module):
    """Uses its child's weight once through the child's call, once under a name of its own."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(6, 6)
        self.w = self.child.weight

    def forward(self, x):
        return torch.sin(F.linear(torch.tanh(self.child(x)), self.w))


@pytest.mark.parametrize("hand_in_losses", [True, False])
@pytest.mark.parametrize("block", [_TwoLayersOneWeight, _OwnWeightTiedToItsChilds])
def test_a_replayed_call_using_one_weight_under_two_names_stays_module_local(block, hand_in_losses):
    """A replay was handed every name of a tied weight, which torch.func refuses (the first
    block), or replayed the child's use as well as its own, counted twice (the second): without
    individual losses both layers raised, with them the weight took the whole graph."""
    torch.manual_seed(0)
    model = nn.Sequential(block(), nn.Tanh(), nn.Linear(6, 3)).double()
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        x, y = torch.randn(8, 6, dtype=torch.float64, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        model.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        info = {"batch_size": 8, "loss": losses.mean()} | ({"individual_losses": losses} if hand_in_losses else {})
        with cockpit(step, info=info):
            losses.mean().backward(retain_graph=True)
        g = one_pass_per_sample(losses, params)
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-9), step
    assert all(route.startswith("module-local") for route in cockpit.routes().values()), cockpit.routes()
    norms = GradientMetricCollector([gm.PNorm(model, p=2)])(F.cross_entropy(model(x), y, reduction="none"))
    torch.testing.assert_close(torch.as_tensor(norms).flatten().double(), g.norm(dim=1), rtol=1e-9, atol=0)


class _CalledPerSample(nn.Module):
    """Layers called on one sample's unbatched input at a time, in a loop over the batch."""

    def __init__(self, width):
        super().__init__()
        self.lin, self.norm, self.conv, self.head = nn.Linear(width, width), nn.LayerNorm(width), nn.Conv1d(1, 2, 3), nn.Linear(2 * (width - 2), 3)

    def forward(self, x):
        rows = [self.conv(self.norm(torch.tanh(self.lin(row))).unsqueeze(0)) for row in x]  # (width,) -> (2, width - 2)
        return self.head(torch.stack(rows).flatten(1))


@pytest.mark.parametrize("width", [8, N])
def test_layers_called_on_each_samples_unbatched_input_match_the_oracle(width):
    """Their rules read dimension 0 as the samples: a Linear or LayerNorm on a 1-D input, a
    convolution on an unbatched one crashed the backward pass; they take the generic route,
    whose proof finds that a call holds one sample (also with as many features as samples)."""
    torch.manual_seed(0)
    model = _CalledPerSample(width).double()
    x, y = torch.randn(N, width, dtype=torch.float64), torch.randint(0, 3, (N,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the whole graph's notice)
        cockpit = _steps_of_norm_test(list(model.parameters()), lambda step: F.cross_entropy(model(x), y, reduction="none"))
        norms = GradientMetricCollector([gm.PNorm(p, p=2) for p in model.parameters()])(F.cross_entropy(model(x), y, reduction="none"))
    assert cockpit.routes()["head.weight"] == "module-local: Linear rule"
    g = _oracle(model, x, y)
    sizes = [p.numel() for p in model.parameters()]
    expected = torch.stack([part.norm(dim=1) for part in g.split(sizes, dim=1)], 1)  # (N, metrics)
    torch.testing.assert_close(norms, expected, rtol=1e-9, atol=1e-12)
