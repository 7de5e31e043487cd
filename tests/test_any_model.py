"""Every first-order quantity and every gradient metric on models BackPACK does not know, against
float64 per-sample gradients from torch.func (tests/any_models.py), with each quantity's formula
applied to them here."""

import copy
import threading
import warnings

import pytest
import torch

from any_models import MODELS, assert_counts_close, build, flat, gradient_tests, one_pass_per_sample, oracle_grads
from cockpit_fast import Cockpit, quantities
from cockpit_fast.gradient_metrics import GradientMetricCollector
from cockpit_fast.gradient_metrics import metrics as gm
from cockpit_fast.quantities.alpha import _alpha
from cockpit_fast.utils.training import training_step

N = 5
EVERY = staticmethod(lambda step: True)
RTOL = {torch.float64: 1e-7, torch.float32: 2e-3}


def _variant(model, variant):
    """Tracked parameters of ``model`` after applying ``variant``: frozen parameters, a hook."""
    params = list(model.parameters())
    if variant == "frozen":
        params[0].requires_grad_(False)
    if variant == "hooked":
        weight = next(p for p in params if p.dim() == 2)
        mask = (torch.arange(weight.numel()) % 3 != 0).reshape(weight.shape).to(weight.dtype)
        weight.register_hook(lambda g: g * mask)
        return [p for p in params if p.requires_grad], {id(weight): mask}
    return [p for p in params if p.requires_grad], {}


def _oracle(model, params, losses_of, x, y, masks):
    """float64 per-sample gradients (N, *shape) of ``params``, hooks applied to each sample."""
    twin = copy.deepcopy(model).double()
    by_name = {id(p): name for name, p in model.named_parameters()}
    twin_params = dict(twin.named_parameters())
    twin_x = x.double() if x.is_floating_point() else x
    grads = oracle_grads(twin, [twin_params[by_name[id(p)]] for p in params], losses_of, twin_x, y)
    return [g * masks[id(p)].double() if id(p) in masks else g for g, p in zip(grads, params)]


def _hist1d_expected(values, lo, hi, bins):
    index = ((values.clamp(lo, hi) - lo) * bins / (hi - lo)).floor().long().clamp(max=bins - 1)
    return torch.bincount(index, minlength=bins)


def _step(model, losses_of, x, y, cockpit, step=0, opt=None, **kwargs):
    """One tracked step of the shared harness (an optimizer step with ``opt``), the loss the mean
    of ``losses_of`` (here given the outputs instead of calling the model). Returns the losses
    and the loss in float64."""

    def individual(outputs, labels):
        return losses_of(lambda _: outputs, x, labels)

    _, loss, losses = training_step(model, opt, (x, y), individual, cockpit=cockpit, step=step, **kwargs)
    return losses.detach().double(), loss.detach().double()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(MODELS))
def test_quantities_match_the_oracle(name, dtype):
    _check_quantities(name, dtype, "plain")


@pytest.mark.parametrize("variant", ["frozen", "hooked"])
@pytest.mark.parametrize("name", ["gpt_like", "residual_cnn"])
def test_quantities_with_frozen_or_hooked_parameters(name, variant):
    _check_quantities(name, torch.float64, variant)


def _check_quantities(name, dtype, variant):
    model, batch, losses_of = build(name, dtype)
    params, masks = _variant(model, variant)
    x, y = batch(N, torch.Generator().manual_seed(1))
    expected_grads = _oracle(model, params, losses_of, x, y, masks)
    g = flat(expected_grads)  # (N, D): ∇ℓ_n of every tracked parameter
    mean = g.mean(0)
    largest = float(g.abs().max())
    hist_range = (-0.5 * largest, 0.4 * largest)
    tracked = [
        quantities.GradHist1d(EVERY, bins=17, range=hist_range),
        quantities.MeanGSNR(EVERY),
        quantities.NormTest(EVERY),
        quantities.InnerTest(EVERY),
        quantities.OrthoTest(EVERY),
        quantities.CABS(EVERY),
        quantities.EarlyStopping(EVERY),
        quantities.GradNorm(EVERY),
    ]
    opt = torch.optim.SGD(params, lr=0.1)
    cockpit = Cockpit(params, quantities=tracked)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's notices of ops it batches by a loop
        losses, loss = _step(model, losses_of, x, y, cockpit, 0, opt)
        output = cockpit.get_output()[0]

    rtol = RTOL[dtype]
    g_sq, mean_sq = (g**2).sum(1), (mean**2).sum()
    projections = g @ mean
    expected = {
        "NormTest": ((g_sq.sum() - N * mean_sq) / (N - 1) / (N * mean_sq)).sqrt(),
        "InnerTest": (projections.var() / (N * mean_sq**2)).sqrt(),
        "OrthoTest": (((g_sq - projections**2 / mean_sq).sum() / (N - 1)) / (N * mean_sq)).sqrt(),
        "MeanGSNR": (mean**2 / ((g**2).mean(0) - mean**2 + 1e-5)).mean(),
        "CABS": 0.1 * ((g**2).sum(0) - N * mean**2).sum() / (N * loss),
        "EarlyStopping": 1 - N * (mean**2 / (((g**2).sum(0) - N * mean**2) / (N - 1) + 1e-5)).mean(),
    }
    for key, value in expected.items():
        assert output[key] == pytest.approx(float(value), rel=rtol, abs=1e-9), key
    norms = [float(e.mean(0).norm()) for e in expected_grads]
    assert output["GradNorm"] == pytest.approx(norms, rel=rtol, abs=1e-9 if dtype == torch.float64 else 1e-6 * max(norms))
    hist = output["GradHist1d"]
    counts = _hist1d_expected(g.flatten(), *hist_range, 17)
    assert_counts_close(hist["hist"], counts, [g.flatten()], [hist["edges"]], slack=0 if dtype == torch.float64 else 1)


@pytest.mark.parametrize("name", ["gpt_like", "hf_gpt2", "residual_cnn", "lstm", "batch_norm_training"])
def test_alpha_and_two_step_quantities_match_the_oracle(name):
    model, batch, losses_of = build(name, torch.float64)
    params = list(model.parameters())
    lr = 0.1
    opt = torch.optim.SGD(params, lr=lr)
    tracked = [quantities.Alpha(EVERY), quantities.Distance(EVERY), quantities.UpdateSize(EVERY)]
    cockpit = Cockpit(params, quantities=tracked)
    gen = torch.Generator().manual_seed(1)
    observed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            x, y = batch(N, gen)
            g = flat(_oracle(model, params, losses_of, x, y, {}))
            losses, loss = _step(model, losses_of, x, y, cockpit, step, opt)
            observed.append((g, losses, loss))
        output = cockpit.get_output()
    update = -lr * observed[0][0].mean(0)
    size = update.norm()
    projected = [gn @ update / size for gn, _, _ in observed]
    dfs, df_vars = [p.mean() for p in projected], [p.var() for p in projected]
    expected = _alpha(float(size), [float(o[2]) for o in observed], [float(d) for d in dfs],
                      [float(o[1].var()) for o in observed], [float(v) for v in df_vars])
    assert output[0]["Alpha"] == pytest.approx(expected, rel=1e-6)
    # The first update, parameter by parameter: UpdateSize at step 0, Distance from the start at step 1.
    first_update = (lr * observed[0][0].mean(0)).split([p.numel() for p in params])
    moved = [float(u.norm()) for u in first_update]
    assert output[0]["UpdateSize"] == pytest.approx(moved, rel=1e-6)
    assert output[1]["Distance"] == pytest.approx(moved, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(MODELS))
def test_gradient_metrics_match_the_oracle(name, dtype):
    model, batch, losses_of = build(name, dtype)
    params = list(model.parameters())
    metrics = [gm.Max(model), gm.Min(model), gm.Mean(model), gm.MeanStd(model), gm.PNorm(model, p=2),
               gm.PNorm(model, p=float("inf"))]
    collector = GradientMetricCollector(metrics)
    x, y = batch(N, torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = collector(losses_of(model, x, y)).double()
    g = flat(_oracle(model, params, losses_of, x, y, {}))
    expected = torch.stack(
        [g.amax(1), g.amin(1), g.mean(1), g.mean(1), (g.var(1) + 1e-32).sqrt(), g.norm(dim=1), g.abs().amax(1)], 1
    )
    torch.testing.assert_close(values, expected, rtol=RTOL[dtype], atol=1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("name", ["gpt_like", "residual_cnn"])
def test_one_sample(name):
    model, batch, losses_of = build(name, torch.float64)
    params = list(model.parameters())
    x, y = batch(1, torch.Generator().manual_seed(1))
    g = flat(_oracle(model, params, losses_of, x, y, {}))
    hist_range = (-float(g.abs().max()), float(g.abs().max()))
    cockpit = Cockpit(params, quantities=[quantities.GradHist1d(EVERY, bins=9, range=hist_range), quantities.MeanGSNR(EVERY)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(model, losses_of, x, y, cockpit, 0, torch.optim.SGD(params, lr=0.1))
    output = cockpit.get_output()[0]
    assert_counts_close(output["GradHist1d"]["hist"], _hist1d_expected(g.flatten(), *hist_range, 9), [g.flatten()],
                        [output["GradHist1d"]["edges"]])
    mean = g.mean(0)
    assert output["MeanGSNR"] == pytest.approx(float((mean**2 / ((g**2).mean(0) - mean**2 + 1e-5)).mean()), rel=1e-7)


class RawUse(torch.nn.Module):
    """A tracked weight used once by its module and once functionally by its parent."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) + torch.nn.functional.linear(x, self.lin.weight)


class DropoutParent(torch.nn.Module):
    """A raw parameter whose call (the whole model) draws random numbers: replaying it per
    sample would draw others, so it takes the whole graph."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(6))
        self.lin = torch.nn.Linear(6, 3)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.lin(self.drop(x * self.scale))


def _cross_entropy(reduction):
    return lambda outputs, labels: torch.nn.functional.cross_entropy(outputs, labels, reduction=reduction)


def _tracked_step(model, x, y, quantities_, info_losses=True, reduction="mean", **kwargs):
    """The output of one tracked step (no optimizer) whose loss is the ``reduction`` of the
    samples' cross entropies; ``info_losses``: ``info`` holds them too."""
    cockpit = Cockpit(list(model.parameters()), quantities=quantities_, **kwargs)
    training_step(
        model,
        None,
        (x, y),
        _cross_entropy("none"),
        loss_fn=_cross_entropy(reduction),
        cockpit=cockpit,
        drop_info=() if info_losses else ("individual_losses",),
    )
    return cockpit.get_output()[0]


class _SkippedSubmodule(torch.nn.Module):
    """A block that holds a layer it never runs (as a decoder-only model keeps its cross-attention)."""

    def __init__(self):
        super().__init__()
        self.used, self.never_run, self.head = torch.nn.Linear(4, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.used(x)))


@pytest.mark.parametrize("with_losses", [True, False])
def test_parameters_of_a_submodule_never_run_have_zero_gradients_said_once(with_losses):
    torch.manual_seed(0)
    model = _SkippedSubmodule().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    losses_of = lambda m, a, b: torch.nn.functional.cross_entropy(m(a), b, reduction="none")  # noqa: E731
    drop = () if with_losses else ("individual_losses",)
    params = list(model.parameters())
    tracked = [quantities.NormTest(EVERY), quantities.InnerTest(EVERY), quantities.GradNorm(EVERY)]
    cockpit = Cockpit(params, quantities=tracked)
    with pytest.warns(RuntimeWarning, match=r"2 tracked parameters \(never_run.weight, never_run.bias\) got no gradient"):
        _step(model, losses_of, x, y, cockpit, drop_info=drop)
    assert cockpit.routes()["never_run.weight"] == "not reached"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        _step(model, losses_of, x, y, cockpit, step=1, drop_info=drop)
    expected_grads = _oracle(model, params, losses_of, x, y, {})  # zeros for never_run's
    expected = gradient_tests(flat(expected_grads))
    output = cockpit.get_output()[1]
    assert output["NormTest"] == pytest.approx(expected["NormTest"], rel=1e-9)
    assert output["InnerTest"] == pytest.approx(expected["InnerTest"], rel=1e-9)
    assert output["GradNorm"] == pytest.approx([float(e.mean(0).norm()) for e in expected_grads], rel=1e-9, abs=1e-12)
    assert output["GradNorm"][2:4] == [0.0, 0.0]


class _UsedInTrainingOnly(torch.nn.Module):
    """As Hubert's encoder in eval mode: a parameter only training reads, and two outputs, one
    made from the other (its own parameters take the whole graph)."""

    def __init__(self):
        super().__init__()
        self.masked_embed = torch.nn.Parameter(torch.randn(5))
        self.proj = torch.nn.Linear(5, 5)

    def forward(self, x):
        h = self.proj(x + self.masked_embed if self.training else x)
        return h, h.relu()


def test_a_parameter_the_whole_graph_finds_unused_has_zero_gradients():
    # The whole graph gave it per-sample gradients, the backward pass no gradient: KeyError.
    torch.manual_seed(0)
    model = torch.nn.Sequential(_UsedInTrainingOnly(), _Second(), torch.nn.Linear(5, 3)).double().eval()
    x, y = torch.randn(N, 5, dtype=torch.float64), torch.randint(0, 3, (N,))
    losses_of = lambda m, a, b: torch.nn.functional.cross_entropy(m(a), b, reduction="none")  # noqa: E731
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY), quantities.GradNorm(EVERY)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the whole-graph route and the unreached parameter, said)
        _step(model, losses_of, x, y, cockpit)
    g = flat(_oracle(model, params, losses_of, x, y, {}))
    output = cockpit.get_output()[0]
    assert output["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-9)
    assert output["GradNorm"][0] == 0.0 and output["GradNorm"][1] > 0


class _Second(torch.nn.Module):
    def forward(self, outputs):
        return outputs[1]


class _Recomputed(torch.autograd.Function):
    """As Reformer's reversible layers: the layer runs without a graph, its backward recomputes
    it and runs a backward pass of its own, which gives the layer's parameters their gradient."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            torch.autograd.backward(ctx.layer(x), grad_out)
        return x.grad, None


class _Reversible(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.inner, self.head = torch.nn.Linear(5, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.head(_Recomputed.apply(self.first(x), self.inner))


@pytest.mark.parametrize("info_losses", [True, False])
def test_a_backward_pass_run_inside_a_backward_node_is_a_clear_error(info_losses):
    # The collector gave the inner layer zero per-sample gradients with no word; the cockpit
    # blamed gradient accumulation.
    torch.manual_seed(0)
    model = _Reversible().double()
    x, y = torch.randn(N, 5, dtype=torch.float64), torch.randint(0, 3, (N,))
    message = r"\(inner.weight, inner.bias\) cannot be computed: .* a custom autograd.Function's backward runs a backward pass"
    if not info_losses:
        message = "backward passes ran for one step: .* A custom autograd.Function whose backward runs one of its own"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the inner layer's call cannot be replayed: the whole graph)
        with pytest.raises(ValueError, match=message):
            _tracked_step(model, x, y, [quantities.NormTest(EVERY)], info_losses=info_losses)
        if info_losses:
            collector = GradientMetricCollector([gm.PNorm(model, p=2)])
            with pytest.raises(ValueError, match=message):
                collector(torch.nn.functional.cross_entropy(model(x), y, reduction="none"))


class _ChannelsFoldedIntoRows(torch.nn.Module):
    """As PatchTST: each sample's C channels folded into the rows, (N, C, L, 2) -> (N * C, L, D),
    then a channel-first layer on (N * C, D, L)."""

    def __init__(self, layer):
        super().__init__()
        self.embed = torch.nn.Linear(2, 8)
        self.layer = layer
        self.head = torch.nn.Linear(3 * 5 * 8, 3)

    def forward(self, x):
        h = self.embed(x).reshape(-1, 5, 8)
        h = self.layer(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h.reshape(x.shape[0], -1))


@pytest.mark.parametrize("layer", ["batch_norm_eval", "group_norm", "conv"])
def test_a_channel_first_layer_on_rows_that_fold_each_samples_channels_matches_the_oracle(layer):
    # The engine regroups the rows as (N, C, ...): the layer's rule took C for its channels (a crash).
    torch.manual_seed(0)
    made = {
        "batch_norm_eval": lambda: torch.nn.BatchNorm1d(8),
        "group_norm": lambda: torch.nn.GroupNorm(4, 8),
        "conv": lambda: torch.nn.Conv1d(8, 8, 3, padding=1),
    }[layer]()
    model = _ChannelsFoldedIntoRows(made).double().eval()
    if layer == "batch_norm_eval":
        model.layer.running_mean.normal_()
        model.layer.running_var.uniform_(0.5, 2)
    x, y = torch.randn(N, 3, 5, 2, dtype=torch.float64), torch.randint(0, 3, (N,))
    losses_of = lambda m, a, b: torch.nn.functional.cross_entropy(m(a), b, reduction="none")  # noqa: E731
    (got,), (expected,) = _norm_test_against_oracle(model, x, y, losses_of)
    assert got == pytest.approx(expected, rel=1e-10)


class _ChannelRowsGathered(torch.nn.Module):
    """Each sample's 3 channels as rows, some left out by ``mask`` (unequal rows per sample),
    a channel-first layer on the rows, summed back to the samples."""

    def __init__(self, layer):
        super().__init__()
        self.embed, self.layer, self.head = torch.nn.Linear(12, 3 * 8 * 6), layer, torch.nn.Linear(8, 3)
        self.mask = None

    def forward(self, x):
        n = x.shape[0]
        h = self.embed(x.reshape(n, -1)).reshape(n * 3, 8, 6)
        sample = torch.arange(n).repeat_interleave(3)
        if self.mask is not None:
            h, sample = h[self.mask], sample[self.mask]
        h = self.layer(h).mean(-1)
        return self.head(torch.tanh(h.new_zeros(n, 8).index_add(0, sample, h)))


@pytest.mark.parametrize("layer", ["batch_norm_train", "batch_norm_eval", "group_norm", "conv"])
def test_a_channel_first_layer_on_rows_of_unequal_counts_after_a_first_step_of_equal_ones(layer):
    # Step 0's rows prove the route; later steps pad some samples' rows with zeros, which a batch
    # norm in training mode took into its statistics (wrong numbers, with no word).
    torch.manual_seed(0)
    made = {
        "batch_norm_train": lambda: torch.nn.BatchNorm1d(8),
        "batch_norm_eval": lambda: torch.nn.BatchNorm1d(8).eval(),
        "group_norm": lambda: torch.nn.GroupNorm(4, 8),
        "conv": lambda: torch.nn.Conv1d(8, 8, 3, padding=1),
    }[layer]()
    model = _ChannelRowsGathered(made).double()
    x, y = torch.randn(N, 2, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
    losses_of = lambda m, a, b: torch.nn.functional.cross_entropy(m(a), b, reduction="none")  # noqa: E731
    masks = [None, torch.tensor([1, 1, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 1, 1, 0], dtype=torch.bool)]
    masks.append(masks[1].roll(4))

    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    for step, mask in enumerate(masks):
        model.mask = mask
        model.zero_grad(set_to_none=True)
        losses = losses_of(model, x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(step, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward(retain_graph=True)
        # Each loss's gradient in the batched forward pass (a batch norm in training mode mixes
        # the samples: their per-sample gradients are these, as BackPACK's).
        expected = gradient_tests(one_pass_per_sample(losses, params))["NormTest"]
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected, rel=1e-10), f"step {step}"


def test_a_replayed_call_handed_a_cache_it_fills_is_a_clear_error():
    from any_models import VOCAB, hf_mamba, token_losses

    torch.manual_seed(0)
    model = hf_mamba(use_cache=True).double().eval()  # eval: Mamba then makes a cache in its forward pass
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    losses_of = lambda m, a, b: token_losses(m(a), a)  # noqa: E731
    said = r"in MambaMixer come from replaying its call, which was handed a \w*Cache that it fills as it runs.*use_cache = False"
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with pytest.raises(RuntimeError, match=said):  # without the losses no other route is exact
        _step(model, losses_of, tokens, None, cockpit, drop_info=("individual_losses",))
    model.zero_grad()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with pytest.warns(RuntimeWarning, match=said):  # with them its parameters take the whole graph
        _step(model, losses_of, tokens, None, cockpit)
    assert cockpit.get_output()[0]["NormTest"] > 0


_FUSED_EXPERTS = {  # name -> (config class, model class, its MoE settings)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)),
    # Its router flattens the tokens inside its call, (N, T, D) to (N * T, D).
    "deepseek_v3": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        dict(num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=0,
             n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4),
    ),
}


@pytest.mark.parametrize("hand_in_losses", [True, False])
@pytest.mark.parametrize("implementation, dtype", [("grouped_mm", torch.float32), ("eager", torch.float64)])
@pytest.mark.parametrize("name", list(_FUSED_EXPERTS))
def test_hf_fused_experts_and_their_routers_stay_module_local_and_match_a_pass_per_sample(name, implementation, dtype, hand_in_losses):
    """Hugging Face's experts hold every expert's weights in one 3-D parameter and index the
    token rows routed to each: the replay handed each sample's rows as a batch of one, which
    they index out of bounds, and a router's weights (an output computed from its logits) were
    counted twice: both took the whole graph (9x a plain step). Now a routed call's replay
    takes each sample's rows as rows, and an output computed from another alone is left out.
    DeepSeek-V3's router, flattening the tokens inside its call, needs the individual losses
    that prove its rows' samples."""
    import transformers

    from any_models import VOCAB, _LogitsOnly, token_losses

    config_class, model_class, moe = _FUSED_EXPERTS[name]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, **moe,
    )
    config._experts_implementation = implementation  # (grouped products take no float64)
    torch.manual_seed(0)
    model = _LogitsOnly(getattr(transformers, model_class)(config)).to(dtype)
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        tokens = torch.randint(0, VOCAB, (4, 6), generator=gen)
        model.zero_grad()
        losses = token_losses(model(tokens), tokens)
        info = {"batch_size": 4, "loss": losses.mean()} | ({"individual_losses": losses} if hand_in_losses else {})
        if name == "deepseek_v3" and not hand_in_losses:
            with pytest.raises(ValueError, match=r"\(model\.model\.layers\.0\.mlp\.gate\.weight\) need every sample's own loss"):
                with cockpit(step, info=info):
                    losses.mean().backward()
            return
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # (no whole graph's notice)
            with cockpit(step, info=info):
                losses.mean().backward(retain_graph=True)
        expected = gradient_tests(one_pass_per_sample(losses, params).double())["NormTest"]
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected, rel=1e-4 if dtype == torch.float32 else 1e-8), step
    assert all(route.startswith("module-local") for route in cockpit.routes().values()), cockpit.routes()
    # (Eager experts loop over the experts each row picks, which vmap cannot batch.)
    by = "with torch.func" if implementation == "grouped_mm" else "one sample at a time by autograd"
    assert f"module-local: MixtralExperts replayed {by}, rows regrouped by sample" in cockpit.routes().values() or name != "mixtral"


def test_a_functional_use_outside_the_owning_module_takes_the_whole_graph_and_says_so():
    model, batch, _ = build("raw_use", torch.float64)
    x, y = batch(N, torch.Generator().manual_seed(1))
    cockpit_ = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    with pytest.warns(RuntimeWarning, match=r"\(lin.weight\) takes the whole-graph route .* used outside its module"):
        training_step(model, None, (x, y), _cross_entropy("none"), cockpit=cockpit_)
    routes = cockpit_.routes()
    assert routes["lin.weight"] == "whole graph"
    assert routes["lin.bias"] == routes["head.weight"] == "module-local: Linear rule"


def test_a_functional_use_outside_the_owning_module_without_individual_losses_is_a_clear_error():
    with pytest.raises(ValueError, match=r"1 tracked parameter \(lin.weight\) do not add up to their gradient: they are used outside"):
        _tracked_step(RawUse(), torch.randn(N, 4), torch.randint(0, 3, (N,)), [quantities.NormTest(EVERY)], info_losses=False)


def test_a_loss_that_is_not_the_mean_of_the_individual_losses_is_a_clear_error():
    with pytest.raises(ValueError, match="is not the mean of info\\['individual_losses'\\]"):
        _tracked_step(RawUse().lin, torch.randn(N, 4), torch.randint(0, 3, (N,)), [quantities.NormTest(EVERY)], reduction="sum")


def test_interacting_samples_without_individual_losses_is_a_clear_error():
    model, batch, _ = build("batch_norm_training", torch.float32)
    x, y = batch(N, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"samples interact \(BatchNorm1d in training mode\) need every sample's own loss"):
        _tracked_step(model, x, y, [quantities.NormTest(EVERY)], info_losses=False)


@pytest.mark.parametrize("name", ["gpt_like", "hf_gpt2", "lstm"])
def test_curvature_on_layers_backpack_cannot_handle_is_a_clear_error_before_the_backward_pass(name):
    model, batch, losses_of = build(name, torch.float32)
    x, y = batch(N, torch.Generator().manual_seed(1))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.HessTrace(EVERY), quantities.TICDiag(EVERY)])
    losses = losses_of(model, x, y)
    with pytest.raises(ValueError, match="HessTrace, TICDiag need BackPACK's DiagHessian, which does not support"):
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            raise AssertionError("the backward pass must not start")


def test_a_call_that_draws_random_numbers_takes_the_whole_graph():
    torch.manual_seed(0)
    model = DropoutParent().double()
    x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
    params = list(model.parameters())
    losses_of = lambda m, inputs, labels: torch.nn.functional.cross_entropy(m(inputs), labels, reduction="none")  # noqa: E731
    torch.manual_seed(5)  # one dropout mask for the oracle's forward pass and the tracked one
    g = flat(_oracle(model, params, losses_of, x, y, {}))
    torch.manual_seed(5)
    output = _tracked_step(model, x, y, [quantities.NormTest(EVERY)])
    assert output["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-7)
    with pytest.raises(ValueError, match="need every sample's own loss .*draws random numbers"):
        _tracked_step(model, x, y, [quantities.NormTest(EVERY)], info_losses=False)


def test_hessian_max_eigenvalue_on_a_model_backpack_cannot_handle():
    model, batch, losses_of = build("residual_cnn", torch.float64)
    x, y = batch(N, torch.Generator().manual_seed(1))
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.HessMaxEV(EVERY)])
    _step(model, losses_of, x, y, cockpit)
    names = [name for name, _ in model.named_parameters()]
    values = {name: p.detach() for name, p in model.named_parameters()}
    sizes = [p.numel() for p in params]

    def mean_loss(flat_params):
        chunks = dict(zip(names, (c.reshape(p.shape) for c, p in zip(flat_params.split(sizes), params))))
        return losses_of(lambda inputs: torch.func.functional_call(model, chunks, (inputs,)), x, y).mean()

    hessian = torch.func.hessian(mean_loss)(torch.cat([values[n].flatten() for n in names]))
    largest = float(torch.linalg.eigvalsh(hessian)[-1])
    assert cockpit.get_output()[0]["HessMaxEV"] == pytest.approx(largest, rel=1e-2)


def test_a_parameter_hook_applies_to_every_samples_gradient_in_the_metrics():
    model, batch, losses_of = build("twice_applied", torch.float64)
    weight = model.shared.weight
    weight.register_hook(lambda g: torch.zeros_like(g))
    collector = GradientMetricCollector([gm.Max(weight), gm.Min(weight), gm.PNorm(model, p=2)])
    x, y = batch(N, torch.Generator().manual_seed(1))
    values = collector(losses_of(model, x, y))
    assert torch.equal(values[:, :2], torch.zeros(N, 2, dtype=values.dtype))
    params = [p for p in model.parameters() if p is not weight]
    g = flat(oracle_grads(model, params, losses_of, x, y))
    torch.testing.assert_close(values[:, 2], g.norm(dim=1))


@pytest.mark.parametrize("route", ["auto", "factors", "grad_batch"])
def test_a_batch_of_no_samples_gives_empty_histograms_as_cockpit_does(route):
    model, batch, _ = build("twice_applied", torch.float32)
    tracked = [quantities.GradHist1d(EVERY, bins=7), quantities.GradHist2d(EVERY, bins=(3, 4))]
    cockpit = Cockpit(list(model.parameters()), quantities=tracked, per_sample_route=route)
    x, y = batch(0, torch.Generator().manual_seed(1))
    training_step(model, None, (x, y), _cross_entropy("none"), cockpit=cockpit, drop_info=("individual_losses",))
    output = cockpit.get_output()[0]
    assert output["GradHist1d"]["hist"].shape == (7,) and output["GradHist1d"]["hist"].sum() == 0
    assert output["GradHist2d"]["hist"].shape == (3, 4) and output["GradHist2d"]["hist"].sum() == 0


class NanoGPTPositions(torch.nn.Module):
    """Positions looked up as ``arange(T)`` (no sample dimension), broadcast over the samples."""

    def __init__(self, vocab=11, width=6, tokens=N):
        super().__init__()
        self.tokens, self.positions = torch.nn.Embedding(vocab, width), torch.nn.Embedding(tokens, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))))


class AttentionPool(torch.nn.Module):
    """A learned query looked up once (ids of shape (1,)), a Linear subclass with its own forward."""

    def __init__(self):
        super().__init__()
        self.query = torch.nn.Embedding(1, 6)
        self.lin = MaskedLinear(6, 3)

    def forward(self, x):
        q = self.query(torch.zeros(1, dtype=torch.long))  # (1, 6), whatever the batch
        weights = torch.softmax(x @ q.squeeze(0), dim=1)  # (N, T)
        return self.lin((weights.unsqueeze(2) * x).sum(1))


class MaskedLinear(torch.nn.Linear):
    """A Linear subclass computing something else than a Linear: it has no Linear rule."""

    def __init__(self, *args):
        super().__init__(*args)
        self.register_buffer("mask", torch.ones_like(self.weight))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight * self.mask, self.bias)


def _norm_test_against_oracle(model, x, y, losses_of, steps=1, before_step=None):
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    expected = []
    for step in range(steps):
        if before_step:
            before_step(step)
        expected.append(gradient_tests(flat(_oracle(model, params, losses_of, x, y, {})))["NormTest"])
        _step(model, losses_of, x, y, cockpit, step)
    output = cockpit.get_output()
    return [output[s]["NormTest"] for s in range(steps)], expected


def test_positions_looked_up_once_match_the_oracle_and_keep_output_shapes():
    torch.manual_seed(0)
    model = NanoGPTPositions().double()
    ids = torch.randint(0, 11, (N, N))  # T == N: sizes alone cannot tell positions from samples
    losses_of = lambda m, x, y: torch.nn.functional.cross_entropy(m(x).transpose(1, 2), x, reduction="none").mean(1)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual, expected = _norm_test_against_oracle(model, ids, None, losses_of)
    assert actual == pytest.approx(expected, rel=1e-7)
    assert model(ids[:1]).shape == (1, N, 11)  # a batch of one stays one


def test_a_linear_subclass_with_its_own_forward_and_a_query_looked_up_once():
    torch.manual_seed(0)
    model = AttentionPool().double()
    x, y = torch.randn(N, 4, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
    losses_of = lambda m, inputs, labels: torch.nn.functional.cross_entropy(m(inputs), labels, reduction="none")  # noqa: E731

    def prune(step):  # the mask changes after the first step: a Linear rule would miss it
        if step == 1:
            model.lin.mask[0] = 0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual, expected = _norm_test_against_oracle(model, x, y, losses_of, steps=2, before_step=prune)
    assert actual == pytest.approx(expected, rel=1e-7)
    assert model(x).shape == (N, 3)


def test_a_compiled_model_runs_under_a_cockpit():
    model, batch, losses_of = build("twice_applied", torch.float32)
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])  # noqa: F841
    compiled = torch.compile(model, backend="eager")
    x, _ = batch(N, torch.Generator().manual_seed(1))
    torch.testing.assert_close(compiled(x), model(x))


def test_nothing_of_a_tracked_step_is_kept_after_it():
    import weakref

    model, batch, losses_of = build("twice_applied", torch.float32)
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    x, y = batch(N, torch.Generator().manual_seed(1))
    _step(model, losses_of, x, y, cockpit)
    watched = weakref.ref(x)
    del x
    assert watched() is None  # no call, no fired gradient holds the step's input


def test_a_batch_norm_elsewhere_and_a_failed_forward_leave_other_models_alone():
    model, batch, losses_of = build("twice_applied", torch.float32)
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    other(torch.randn(6, 3)).sum().backward()  # its graph is gone: it mixes nothing now
    attention = torch.nn.MultiheadAttention(8, 2)  # time first
    with pytest.raises(Exception):
        attention(torch.randn(2, 3, 5), torch.randn(2, 3, 5), torch.randn(2, 3, 5))  # wrong width: raises inside
    x, y = batch(N, torch.Generator().manual_seed(1))
    _step(model, losses_of, x, y, cockpit, drop_info=("individual_losses",))  # none needed
    assert cockpit.get_output()[0]["NormTest"] > 0


def test_the_engines_own_backward_passes_keep_what_backpack_stored():
    # The first step's proof runs backward passes before the user's: BackPACK's stored inputs
    # and outputs must survive them for its curvature extensions.
    from backpack import extend

    _, batch, _ = build("twice_applied", torch.float64)
    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)).double())
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[quantities.HessTrace(EVERY), quantities.NormTest(EVERY)])
    x, y = batch(N, torch.Generator().manual_seed(1))
    training_step(model, None, (x, y), _cross_entropy("none"), loss_fn=loss_fn, cockpit=cockpit)
    output = cockpit.get_output()[0]
    assert output["NormTest"] > 0 and all(v > 0 for v in output["HessTrace"])


@pytest.mark.parametrize("dropout", [False, True])
def test_reentrant_activation_checkpointing_is_a_clear_error(dropout):
    # Its backward pass runs one of its own: a batched backward pass gets nothing for the
    # parameters inside (once silently zero), and torch.func cannot replay it.
    model, batch, losses_of = build("checkpointed", torch.float32)
    model.use_reentrant = True
    if dropout:
        model.blocks[0].append(torch.nn.Dropout(0.2))
    x, y = batch(N, torch.Generator().manual_seed(1))
    x.requires_grad_()  # or the blocks' parameters get no gradient at all
    message = "activation checkpointing with use_reentrant=True cannot be computed"
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    losses = losses_of(model, x, y)
    with pytest.raises(ValueError, match=message):
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    collector = GradientMetricCollector([gm.Max(model)])
    with pytest.raises(ValueError, match=message):
        collector(losses_of(model, x, y))


class _Opaque(torch.autograd.Function):  # no setup_context: torch.func cannot transform it
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, grad * x


class _Scaled(torch.nn.Module):
    """Scales its input with a user's op (``fixed_batch``: reshaped to the batch size it was
    made for, so that no call on fewer samples runs)."""

    def __init__(self, fixed_batch=None):
        super().__init__()
        self.scale, self.head, self.fixed_batch = torch.nn.Parameter(torch.ones(4)), torch.nn.Linear(4, 3), fixed_batch

    def forward(self, x):
        scaled = _Opaque.apply(x, self.scale)
        return self.head(scaled if self.fixed_batch is None else scaled.view(self.fixed_batch, 4))


def _norm_test_of_a_pass_per_sample(model, x, y):
    losses = _cross_entropy("none")(model(x), y)
    return gradient_tests(one_pass_per_sample(losses, list(model.parameters())))["NormTest"]


@pytest.mark.parametrize("info_losses", [True, False])
def test_a_call_through_an_op_torch_func_cannot_transform_is_replayed_by_autograd(info_losses):
    """A custom autograd.Function without setup_context: torch.func cannot replay the call, which
    took the whole graph (or, without individual losses, was an error); autograd replays it one
    sample at a time."""
    torch.manual_seed(0)
    model = _Scaled().double()
    x, y = torch.randn(N, 4, dtype=torch.float64), torch.randint(0, 3, (N,))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    drop_info = () if info_losses else ("individual_losses",)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (no whole graph's notice)
        for step in range(2):  # (the second knows vmap fails and goes to autograd at once)
            training_step(model, None, (x, y), _cross_entropy("none"), cockpit=cockpit, step=step, drop_info=drop_info)
            assert cockpit.get_output()[step]["NormTest"] == pytest.approx(_norm_test_of_a_pass_per_sample(model, x, y), rel=1e-9)
    assert cockpit.routes()["scale"] == "module-local: _Scaled replayed one sample at a time by autograd"
    assert cockpit.routes()["head.weight"] == "module-local: Linear rule"


class _DropsOut(torch.nn.Module):
    """Dropout (no Dropout module tells of it) before or after an op torch.func cannot transform,
    or none; from torch's generator or a generator of its own."""

    def __init__(self, where, own_generator=False):
        super().__init__()
        self.scale, self.head, self.where = torch.nn.Parameter(torch.ones(4)), torch.nn.Linear(4, 3), where
        self.generator = torch.Generator().manual_seed(3) if own_generator else None

    def drop(self, x):
        return x * torch.bernoulli(torch.full_like(x, 0.5), generator=self.generator) * 2

    def forward(self, x):
        x = self.drop(x) if self.where == "before" else x
        scaled = x * self.scale if self.where == "plain" else _Opaque.apply(x, self.scale)
        return self.head(self.drop(scaled) if self.where in ("plain", "after") else scaled)


@pytest.mark.parametrize("own_generator", [False, True])
@pytest.mark.parametrize("where", ["plain", "before", "after"])
def test_a_call_drawing_random_numbers_found_by_its_replay_takes_the_whole_graph(where, own_generator):
    """vmap refuses to draw random numbers: the replay's error told the user to hand in the
    individual losses, and raised when they had. Autograd, replaying where vmap cannot
    transform an op, drew new ones (a dropout mask the step did not use)."""
    torch.manual_seed(0)
    model = _DropsOut(where, own_generator).double()
    x, y = torch.randn(N, 4, dtype=torch.float64), torch.randint(0, 3, (N,))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(EVERY)])
    losses = _cross_entropy("none")(model(x), y)
    with pytest.warns(RuntimeWarning, match=r"\(scale\) takes the whole-graph route .*draws random numbers"):
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward(retain_graph=True)
    expected = gradient_tests(one_pass_per_sample(losses, list(model.parameters())))["NormTest"]
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="_DropsOut draws random numbers in its forward pass"):
        _tracked_step(model, x, y, [quantities.NormTest(EVERY)], info_losses=False)


def test_a_replay_by_autograd_is_not_confused_by_another_thread_drawing_random_numbers():
    """A replay that compared torch's generator's state before and after took another thread's
    draws for its call's (and rewound that thread's generator)."""
    torch.manual_seed(0)
    model = _Scaled().double()
    x, y = torch.randn(N, 4, dtype=torch.float64), torch.randint(0, 3, (N,))
    stop = threading.Event()
    drawing = threading.Thread(target=lambda: [torch.rand(1) for _ in iter(lambda: stop.is_set(), True)])
    drawing.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # (no whole graph's notice)
            for _ in range(5):
                output = _tracked_step(model, x, y, [quantities.NormTest(EVERY)], info_losses=False)
    finally:
        stop.set()
        drawing.join()
    assert output["NormTest"] == pytest.approx(_norm_test_of_a_pass_per_sample(model, x, y), rel=1e-9)


def test_a_call_that_cannot_be_replayed_takes_the_whole_graph_or_is_a_clear_error():
    torch.manual_seed(0)
    model = _Scaled(fixed_batch=N).double()
    x, y = torch.randn(N, 4, dtype=torch.float64), torch.randint(0, 3, (N,))
    # Without the individual losses there is no other exact route: the replay's error, naming it.
    with pytest.raises(RuntimeError, match="scale in _Scaled come from replaying its call with torch.func, which fails"):
        _tracked_step(model, x, y, [quantities.NormTest(EVERY)], info_losses=False)
    # With them the first step's checks send its parameters to the whole graph, saying why.
    model.zero_grad()
    with pytest.warns(RuntimeWarning, match=r"\(scale\) takes the whole-graph route .* its call cannot be replayed sample by sample"):
        output = _tracked_step(model, x, y, [quantities.NormTest(EVERY)])
    assert output["NormTest"] == pytest.approx(_norm_test_of_a_pass_per_sample(model, x, y), rel=1e-9)


def test_hf_patchtst_in_training_mode_matches_a_pass_per_sample():
    """PatchTST folds each sample's channels into rows that the graph does not tell: they are
    taken sample-major, a guess its batch norm in training mode refutes, and the guess is taken
    back. The checks' pass had kept those rows' gradients regrouped, and forming them on the call
    taken back raised (a size mismatch in the batch norm's rule)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.PatchTSTConfig(
        num_input_channels=3, context_length=32, prediction_length=8, patch_length=8, patch_stride=8, d_model=16,
        num_attention_heads=2, num_hidden_layers=1, ffn_dim=32, dropout=0.0, attention_dropout=0.0, ff_dropout=0.0,
        positional_dropout=0.0, path_dropout=0.0, head_dropout=0.0,
    )
    torch.manual_seed(0)
    model = transformers.PatchTSTForPrediction(config).double().train()
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1)
    past, future = torch.randn(N, 32, 3, generator=gen, dtype=torch.float64), torch.randn(N, 8, 3, generator=gen, dtype=torch.float64)
    cockpit = Cockpit(params, quantities=[quantities.NormTest(EVERY)])
    losses = (model(past_values=past).prediction_outputs - future).square().mean((1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the whole graph's notice: upstream of its batch norms)
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward(retain_graph=True)
    expected = gradient_tests(one_pass_per_sample(losses, params, materialize_grads=True))["NormTest"]
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(expected, rel=1e-9)
