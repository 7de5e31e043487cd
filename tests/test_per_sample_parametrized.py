"""Parametrized layers (torch.nn.utils.parametrize, parametrizations.weight_norm / spectral_norm /
orthogonal, custom and stacked parametrizations, the legacy torch.nn.utils.weight_norm): per-sample
gradients of the parameters behind them, chained through the parametrization from the layer's rule,
against float64 per-sample gradients from torch.func (tests/any_models.py), in the engine, the
cockpit and the collector."""

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.nn.utils import weight_norm as legacy_weight_norm

from any_models import assert_counts_close, flat, gradient_tests, oracle_grads
from cockpit_fast import Cockpit, per_sample, quantities
from cockpit_fast.gradient_metrics import GradientMetricCollector
from cockpit_fast.gradient_metrics import metrics as gm
from cockpit_fast.per_sample import Capture, ConvGrads, DenseGrads, FactoredGrads
from cockpit_fast.per_sample.parametrized import ChainedGrads
from cockpit_fast.utils.training import training_step

N = 5
EVERY = staticmethod(lambda step: True)


class Symmetric(nn.Module):
    """A symmetric matrix (of the last two dimensions) from its upper triangle."""

    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


class PositiveExp(nn.Module):
    def forward(self, x):
        return x.exp()


class Scaled(nn.Module):
    """A parametrization with a parameter of its own: a scale per output channel."""

    def __init__(self, shape):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, shape[0]).reshape(-1, *[1] * (len(shape) - 1)))

    def forward(self, x):
        return x * self.scale


def _stacked(layer):
    parametrizations.weight_norm(layer)
    parametrizations.spectral_norm(layer)


def _stacked_custom(layer):
    parametrize.register_parametrization(layer, "weight", Symmetric())
    parametrize.register_parametrization(layer, "weight", PositiveExp())


PARAMETRIZE = {
    "weight_norm": parametrizations.weight_norm,
    "weight_norm_dim1": lambda layer: parametrizations.weight_norm(layer, dim=1),
    "weight_norm_whole": lambda layer: parametrizations.weight_norm(layer, dim=None),
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
    "symmetric": lambda layer: parametrize.register_parametrization(layer, "weight", Symmetric()),
    "positive_bias": lambda layer: parametrize.register_parametrization(layer, "bias", PositiveExp()),
    "own_parameter": lambda layer: parametrize.register_parametrization(layer, "weight", Scaled(layer.weight.shape)),
    "weight_and_spectral_norm": _stacked,
    "symmetric_and_exp": _stacked_custom,
    "legacy_weight_norm": legacy_weight_norm,
    "legacy_weight_norm_last_dim": lambda layer: legacy_weight_norm(layer, dim=-2 if layer.weight.dim() == 2 else 3),
    "legacy_weight_norm_whole": lambda layer: legacy_weight_norm(layer, dim=None),
}


def _model(layer, kind, dtype, seed=0):
    """A parametrized layer (square weights: symmetric ones need them) and a head, in ``dtype``,
    and a batch for it."""
    torch.manual_seed(seed)
    if layer == "linear":
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
        x = torch.randn(N, 4)
    else:
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3))
        x = torch.randn(N, 2, 4, 4)
    PARAMETRIZE[kind](model[0])
    return model.to(dtype), x.to(dtype), torch.randint(0, 3, (N,))


def _losses(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def _oracle(model, twin, x, y):
    """float64 per-sample gradients ``∇ℓ_n`` (N, *shape) of every parameter of ``model`` by name,
    from torch.func through the parametrizations (``functional_call`` with the names of the
    originals), taken before the model's own forward pass: ``twin`` (a model of the same make,
    given ``model``'s state) runs that forward pass first (a spectral norm's power iteration moves
    its u and v), then, in eval mode, is differentiated with u and v fixed, as autograd treats them."""
    twin.load_state_dict(model.state_dict())
    twin.double()
    x = x.double()
    with torch.no_grad():
        twin(x)
    twin.eval()
    names = [name for name, _ in twin.named_parameters()]
    return dict(zip(names, oracle_grads(twin, list(twin.parameters()), _losses, x, y)))


def _tolerance(expected, dtype):
    """What rounding explains at the gradients' scale: a few eps of the dtype for each step of the
    chain (the layer's backward pass, the parametrization's, and its evaluation)."""
    return 16 * torch.finfo(dtype).eps * float(expected.abs().max())


def _tracked_forms(model, x, y):
    """``{name: form}`` from one backward pass of the mean loss with a capture armed, and the
    model's buffers as that forward pass left them."""
    params = dict(model.named_parameters())
    capture = Capture(list(params.values()))
    loss = _losses(model, x, y).mean()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    capture.arm()
    loss.backward()
    forms, _ = capture.disarm()
    return {name: forms[id(p)] for name, p in params.items()}, buffers


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layer", ["linear", "conv2d"])
@pytest.mark.parametrize("kind", list(PARAMETRIZE))
def test_per_sample_gradients_behind_a_parametrization_match_the_oracle(kind, layer, dtype):
    model, x, y = _model(layer, kind, dtype)
    expected = _oracle(model, _model(layer, kind, dtype)[0], x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's notices of ops it batches by a loop
        forms, buffers = _tracked_forms(model, x, y)
        for name, p in model.named_parameters():
            form = forms[name]
            behind = ".parametrizations." in name or name in ("0.weight_g", "0.weight_v")  # legacy weight_norm's
            assert isinstance(form, ChainedGrads if behind else (FactoredGrads, ConvGrads, DenseGrads)), name
            # The forms are in the units of the backward pass: ∇ℓ_n / N for a mean loss.
            want = expected[name] / N
            tolerance = _tolerance(want, dtype)
            torch.testing.assert_close(form.dense().double(), want, rtol=0, atol=tolerance, msg=name)
            # A sum of N gradients: to the rounding of the sum of their sizes (one thread's order
            # differs from two threads' by 2.2e-8 for a weight norm's g, 1.6x the rounding of one).
            torch.testing.assert_close(form.grad, p.grad, rtol=0, atol=_tolerance(want.abs().sum(0), dtype), msg=name)
            direction = torch.randn(p.shape, dtype=torch.float64)
            dots = form.dot(direction.to(dtype))
            if dots is not None:  # the closed form <G_n, J d> against the formed gradients'
                scale = float(want.reshape(N, -1).abs().sum(1).max() * direction.abs().max())
                torch.testing.assert_close(dots.double(), want.reshape(N, -1) @ direction.flatten(), rtol=0,
                                           atol=16 * torch.finfo(dtype).eps * scale, msg=name)
    for name, b in model.named_buffers():  # the engine evaluated the parametrizations without side effects
        assert torch.equal(b, buffers[name]), name


@pytest.mark.parametrize("cached", [False, True])
def test_a_spectral_norm_read_twice_in_training_mode_chains_each_read_by_its_own_u_and_v(cached):
    """Each read runs a power iteration (but under parametrize.cached): autograd differentiates
    each use with the u and v of its read. The oracle here: autograd itself, one batched backward
    pass of every sample's loss through the graph that forward pass built."""
    torch.manual_seed(0)
    layer = parametrizations.spectral_norm(nn.Linear(4, 4)).double()
    head = nn.Linear(4, 3).double()
    x, y = torch.randn(N, 4, dtype=torch.float64), torch.randint(0, 3, (N,))
    params = list(layer.parameters()) + list(head.parameters())
    capture = Capture(params)
    with parametrize.cached() if cached else contextlib.nullcontext():
        losses = nn.functional.cross_entropy(head(torch.tanh(layer(torch.tanh(layer(x))))), y, reduction="none")
    expected = torch.autograd.grad(losses, params, torch.eye(N, dtype=torch.float64), is_grads_batched=True, retain_graph=True)
    capture.arm()
    losses.mean().backward()
    forms, _ = capture.disarm()
    for p, want in zip(params, expected):
        torch.testing.assert_close(forms[id(p)].dense(), want / N, rtol=0, atol=_tolerance(want, torch.float64))


def _mlp(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    # Norms of columns: g's gradients are read from each chunk formed (_cnn's Linear: of rows, in closed form).
    parametrizations.weight_norm(model[0], dim=1)
    parametrizations.spectral_norm(model[2])
    parametrize.register_parametrization(model[4], "weight", Scaled(model[4].weight.shape))
    return model.to(dtype), (6,)


def _cnn(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 3 * 3, 3)
    )
    _stacked(model[0])
    parametrizations.orthogonal(model[2])
    legacy_weight_norm(model[5])
    return model.to(dtype), (2, 5, 5)


# Most values formed at once: the default; one sample's; two samples' of _mlp's weight-normed
# layer (its weight's 48 values and those of the Jacobian's parameters, 48 + 6): what g's chunks
# form of v is kept for v's turn, so not in the memory the next chunk takes.
CHUNKS = {"one chunk": None, "chunks of a sample": 1, "chunks of two samples": 2 * (48 + 54)}


class _Twice(nn.Module):
    """A weight-normed layer (each kind) applied twice: its chained forms are summed."""

    def __init__(self):
        super().__init__()
        self.new, self.legacy = parametrizations.weight_norm(nn.Linear(6, 6)), legacy_weight_norm(nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.legacy(torch.tanh(self.legacy(torch.tanh(self.new(torch.tanh(self.new(x)))))))))


def _twice(dtype):
    torch.manual_seed(0)
    return _Twice().to(dtype), (6,)


@pytest.mark.parametrize("chunks", list(CHUNKS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("make", [_mlp, _cnn, _twice])
def test_cockpit_quantities_over_steps_match_the_oracle_and_leave_the_training_alone(make, dtype, chunks, monkeypatch):
    """Also where the gradients are formed a few samples at a time, each chunk in the memory of
    the one before."""
    if CHUNKS[chunks] is not None:
        monkeypatch.setattr(per_sample.grads, "CHUNK_VALUES", CHUNKS[chunks])
    model, shape = make(dtype)
    untracked = make(dtype)[0]
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    tracked = [
        quantities.GradHist1d(EVERY, bins=17, range=(-0.2, 0.15)),
        quantities.NormTest(EVERY),
        quantities.InnerTest(EVERY),
        quantities.GradNorm(EVERY),
    ]
    cockpit = Cockpit(params, quantities=tracked)
    opt, untracked_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(untracked.parameters(), lr=0.1)
    individual = lambda outputs, labels: nn.functional.cross_entropy(outputs, labels, reduction="none")  # noqa: E731
    rtol = 1e-7 if dtype == torch.float64 else 2e-3
    for step in range(3):
        x, y = torch.randn(N, *shape, generator=gen).to(dtype), torch.randint(0, 3, (N,), generator=gen)
        expected = _oracle(model, make(dtype)[0], x, y)
        g = flat([expected[name] for name, _ in model.named_parameters()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            training_step(model, opt, (x, y), individual, cockpit=cockpit, step=step)
            training_step(untracked, untracked_opt, (x, y), individual)
        output = cockpit.get_output()[step]
        tests = gradient_tests(g)
        assert output["NormTest"] == pytest.approx(tests["NormTest"], rel=rtol)
        assert output["InnerTest"] == pytest.approx(tests["InnerTest"], rel=rtol)
        norms = [float(expected[name].mean(0).norm()) for name, _ in model.named_parameters()]
        assert output["GradNorm"] == pytest.approx(norms, rel=rtol, abs=1e-6 * max(norms))
        values = g.flatten()
        index = ((values.clamp(-0.2, 0.15) + 0.2) * 17 / 0.35).floor().long().clamp(max=16)
        assert_counts_close(output["GradHist1d"]["hist"], torch.bincount(index, minlength=17), [values],
                            [output["GradHist1d"]["edges"]], slack=0 if dtype == torch.float64 else 1)
        # The chained route, module-local: not the whole graph.
        routes = cockpit.routes()
        assert all(route.startswith("module-local") for route in routes.values()), routes
    # The same training as without a cockpit: parameters and the spectral norms' u and v.
    for (name, a), b in zip([*model.named_parameters(), *model.named_buffers()], [*untracked.parameters(), *untracked.buffers()]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("make", [_mlp, _cnn])
def test_gradient_metrics_match_the_oracle(make, dtype):
    model, shape = make(dtype)
    metrics = [gm.Max(model), gm.Min(model), gm.Mean(model), gm.PNorm(model, p=2)]
    collector = GradientMetricCollector(metrics)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, *shape, generator=gen).to(dtype), torch.randint(0, 3, (N,), generator=gen)
    expected = _oracle(model, make(dtype)[0], x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = collector(_losses(model, x, y)).double()
    g = flat([expected[name] for name, _ in model.named_parameters()])
    torch.testing.assert_close(values, torch.stack([g.amax(1), g.amin(1), g.mean(1), g.norm(dim=1)], 1),
                               rtol=1e-7 if dtype == torch.float64 else 2e-3, atol=0)
