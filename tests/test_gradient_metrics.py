"""cockpit_fast.gradient_metrics side by side with gradient-metrics 0.5.0, the package it stands in for."""

import warnings

import pytest
import torch
import torch.nn as nn

from cockpit_fast.gradient_metrics import GradientMetricCollector
from cockpit_fast.gradient_metrics import metrics as fast
from cockpit_fast.gradient_metrics import collector as collector_module
from cockpit_fast.per_sample import Engine, FactoredGrads

original = pytest.importorskip("gradient_metrics")
from gradient_metrics import metrics as orig  # noqa: E402  (after the importorskip)

DTYPES = [torch.float32, torch.float64]
N = 12


class CustomFunction(torch.autograd.Function):
    """Doubles its input; its backward reads a Python number, which vmap cannot batch."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return grad * (2.0 + 0.0 * grad.sum().item())


class Setup:
    """A model, its per-sample losses, and named targets for the metrics."""

    def __init__(self, name, dtype, device="cpu", seed=0):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        labels = torch.randint(0, 4, (N,), generator=gen).to(device)

        def randn(*shape, requires_grad=False):
            t = torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
            return t.requires_grad_(requires_grad)

        if name == "mlp":
            self.model = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 4))
            self.targets = {"all": [self.model], "first": [self.model[0]], "last_weight": [self.model[2].weight]}
            forward = self.model
            x = randn(N, 10)
        elif name == "cnn":
            self.model = nn.Sequential(
                nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4)
            )
            self.targets = {"all": [self.model], "first": [self.model[0]], "last_weight": [self.model[3].weight]}
            forward = self.model
            x = randn(N, 2, 6, 6)
        elif name == "mixed":  # modules and raw tensors: a tensor that is no module's parameter
            self.model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
            gain = randn(4, requires_grad=True)
            self.targets = {"all": [self.model, gain], "first": [self.model[0].bias, gain],
                            "last_weight": [self.model[2].weight]}

            def forward(x):
                return self.model(x) * gain

            x = randn(N, 10)
        elif name == "coupled":  # batch norm mixes the samples: per-sample gradients are dense
            self.model = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
            self.targets = {"all": [self.model], "first": [self.model[0]], "last_weight": [self.model[3].weight]}
            forward = self.model
            x = randn(N, 10)
        elif name == "batch_centred":  # samples interact between two Linear layers, no parameter
            self.model = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 4))
            self.targets = {"all": [self.model], "first": [self.model[0]], "last_weight": [self.model[2].weight]}

            def forward(x):
                hidden = self.model[1](self.model[0](x))
                return self.model[2](hidden - hidden.mean(0))

            x = randn(N, 10)
        elif name == "sequence":  # a Linear layer over (N, T, features): no outer products
            self.model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Flatten(), nn.Linear(15, 4))
            self.targets = {"all": [self.model], "first": [self.model[0]], "last_weight": [self.model[3].weight]}
            forward = self.model
            x = randn(N, 3, 6)
        elif name == "custom_function":  # the batched backward fails: one pass per sample
            self.model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 4))
            self.targets = {"all": [self.model], "first": [self.model[0]], "last_weight": [self.model[2].weight]}

            def forward(x):
                return CustomFunction.apply(self.model(x))

            x = randn(N, 10)
        self.model.to(device=device, dtype=dtype)
        self.forward = lambda: nn.functional.cross_entropy(forward(x), labels, reduction="none")


def make_metrics(module, mix, targets):
    """The same metric list built from gradient-metrics (``orig``) or from cockpit_fast (``fast``).

    Targets are lists, so that ``first + last`` spans both.
    """
    all_, first, last = targets["all"], targets["first"], targets["last_weight"]
    if mix == "all_kinds":
        return [module.Max(all_), module.Min(first), module.Mean(all_), module.MeanStd(all_),
                module.PNorm(last, p=2)]
    if mix == "pnorms":
        return [module.PNorm(all_, p=p) for p in (1, 2, 3.5, float("inf"), "inf")] + [
            module.PNorm(first, p=0.5), module.PNorm(first + last, p=3.5)]
    if mix == "std_only":
        return [module.MeanStd(first, return_mean=False), module.MeanStd(last, eps=1e-3),
                module.MeanStd(all_ + last)]  # a parameter listed twice counts twice
    if mix == "transforms":
        return [module.Max(all_, grad_transform=torch.abs), module.PNorm(all_, grad_transform=torch.abs),
                module.MeanStd(all_, grad_transform=normalised),
                module.Min(first, grad_transform=centred), module.Mean(last, grad_transform=centred),
                module.PNorm(first, grad_transform=normalised, p=3.5)]
    if mix == "repeated":  # one metric instance listed twice is fed every gradient twice
        std, pnorm = module.MeanStd(all_), module.PNorm(first, p=3)
        return [std, module.Max(last), std, pnorm, pnorm]
    raise AssertionError(mix)


def normalised(g):
    return g / g.norm()


def centred(g):
    return g - g.mean()


def assert_matches(ours, theirs, dtype):
    """Equal to rtol 1e-5; atol at the rounding of the values' scale (means of ~0 cancel)."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and ours.device == theirs.device
    scale = theirs.abs().max().item()
    atol = scale * (1e-6 if dtype == torch.float32 else 1e-13)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=atol)


def run_both(setup_name, mix, dtype, device="cpu"):
    """Outputs of the original and of cockpit_fast on the same fresh model, data and metrics."""
    outputs = []
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        setup = Setup(setup_name, dtype, device)
        collector = collector_class(make_metrics(module, mix, setup.targets))
        outputs.append(collector(setup.forward()))
    return outputs


def fallback_warnings(caught):
    return [str(w.message) for w in caught if "GradientMetricCollector" in str(w.message)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mix", ["all_kinds", "pnorms", "std_only", "transforms", "repeated"])
@pytest.mark.parametrize("setup_name", ["mlp", "cnn", "mixed", "coupled", "batch_centred", "sequence"])
def test_same_values_as_gradient_metrics(setup_name, mix, dtype, monkeypatch):
    monkeypatch.setattr(collector_module, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs, ours = run_both(setup_name, mix, dtype)
    assert fallback_warnings(caught) == []  # all served by the batched route
    assert_matches(ours, theirs, dtype)


def per_sample_reference(setup_name, params_of):
    """Gradients of a few samples, one backward pass each, on a fresh copy of the same setup."""
    setup = Setup(setup_name, torch.float64)
    loss = setup.forward()
    return {n: torch.autograd.grad(loss[n], params_of(setup.model), retain_graph=True) for n in (0, 5, N - 1)}


@pytest.mark.parametrize(
    "setup_name, linear_only, factored",
    [
        ("mlp", True, [True, True]),  # the weighted pass finds independent samples
        # Samples interact between the layers: the first layer takes the whole graph, the second,
        # downstream of where they interact, its rule (its output gradients are each sample's own).
        ("batch_centred", True, [False, True]),
        ("coupled", True, [False, True]),  # batch norm in training mode, likewise
        ("coupled", False, [False, True]),  # batch norm's own parameters too
    ],
)
def test_per_sample_gradients_of_each_route(setup_name, linear_only, factored):
    def params_of(model):
        layers = [m for m in model if isinstance(m, nn.Linear)] if linear_only else [model]
        return [p for layer in layers for p in layer.parameters()]

    setup = Setup(setup_name, torch.float64)
    params = params_of(setup.model)
    grads = Engine(params).per_sample(setup.forward())
    weights = [m.weight for m in setup.model if isinstance(m, nn.Linear)]
    assert [isinstance(grads[id(w)], FactoredGrads) for w in weights] == factored
    for n, expected in per_sample_reference(setup_name, params_of).items():
        for param, e in zip(params, expected):
            torch.testing.assert_close(grads[id(param)].dense()[n], e, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES)
def test_failing_batched_backward_falls_back_to_one_pass_per_sample(dtype, monkeypatch):
    # A collector made after the forward pass watched no module call: the batched route, which
    # the custom autograd Function breaks, then one pass per sample.
    monkeypatch.setattr(collector_module, "_warned", set())
    outputs = []
    with pytest.warns(RuntimeWarning, match="batched backward pass failed"):
        for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
            setup = Setup("custom_function", dtype)
            loss = setup.forward()
            outputs.append(collector_class(make_metrics(module, "all_kinds", setup.targets))(loss))
    assert_matches(outputs[1], outputs[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_module_calls_serve_a_graph_the_batched_backward_cannot_take(dtype, monkeypatch):
    monkeypatch.setattr(collector_module, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs, ours = run_both("custom_function", "all_kinds", dtype)
    assert fallback_warnings(caught) == []
    assert_matches(ours, theirs, dtype)


def test_transform_vmap_cannot_batch_runs_sample_by_sample(monkeypatch):
    monkeypatch.setattr(collector_module, "_warned", set())

    def scaled_by_python_number(g):
        return g / g.abs().max().item()

    outputs = []
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        setup = Setup("mlp", torch.float64)
        metrics = [module.MeanStd(setup.model, grad_transform=scaled_by_python_number), module.Max(setup.model)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's notice: tested below
            outputs.append(collector_class(metrics)(setup.forward()))
    assert_matches(outputs[1], outputs[0], torch.float64)


def test_transform_with_outputs_of_different_lengths_runs_sample_by_sample(monkeypatch):
    monkeypatch.setattr(collector_module, "_warned", set())

    def large_entries(g):  # how many entries pass depends on the sample
        return g[g.abs() > 0.05]

    outputs = []
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        setup = Setup("mlp", torch.float64)
        metrics = [module.PNorm(setup.model, grad_transform=large_entries), module.Max(setup.model)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs.append(collector_class(metrics)(setup.forward()))
    assert any("different shapes" in message for message in fallback_warnings(caught))
    assert_matches(outputs[1], outputs[0], torch.float64)


def test_large_p_norms_of_factored_gradients_do_not_overflow():
    # 255^16 summed over inputs overflows float32, the per-sample gradient's 16th powers do not.
    outputs = []
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        torch.manual_seed(0)
        layer = nn.Linear(784, 10)
        x, labels = torch.randint(0, 256, (4, 784)).float(), torch.randint(0, 10, (4,))
        loss = nn.functional.cross_entropy(layer(x), labels, reduction="none") / 100
        outputs.append(collector_class([module.PNorm(layer.weight, p=16)])(loss))
    assert outputs[1].isfinite().all()
    assert_matches(outputs[1], outputs[0], torch.float32)


def test_transform_vmap_cannot_batch_warns_why(monkeypatch):
    monkeypatch.setattr(collector_module, "_warned", set())
    setup = Setup("mlp", torch.float64)
    metric = fast.Max(setup.model, grad_transform=lambda g: g / g.abs().max().item())
    with pytest.warns(RuntimeWarning, match="cannot be batched with torch.vmap.*item"):
        GradientMetricCollector(metric)(setup.forward())


def custom_metric_class(base):
    """A metric that counts entries above 0.01 and subclasses ``base``'s GradientMetric."""

    class AboveThreshold(base.GradientMetric):
        def __init__(self, target_layers, grad_transform=None):
            super().__init__(target_layers, grad_transform)
            self.reset()

        def _collect(self, grad):
            self._count = self._count + (grad > 0.01).sum()

        def _get_metric(self):
            return self._count.double()

        def reset(self):
            self._count = torch.tensor(0)

    return AboveThreshold


def max_of_abs_class(base):
    """A Max that overrides _collect: the batched Max formula no longer applies."""

    class MaxOfAbs(base.Max):
        def _collect(self, grad):
            super()._collect(grad.abs())

    return MaxOfAbs


def test_custom_metrics_fed_sample_by_sample(monkeypatch):
    monkeypatch.setattr(collector_module, "_warned", set())
    outputs = []
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        setup = Setup("mlp", torch.float32)
        metrics = [module.Max(setup.model), custom_metric_class(module)(setup.model),
                   max_of_abs_class(module)(setup.model[0]), module.Mean(setup.model)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs.append(collector_class(metrics)(setup.forward()))
    messages = fallback_warnings(caught)
    assert len(messages) == 2 and all("one sample at a time" in m for m in messages)
    assert_matches(outputs[1], outputs[0], torch.float32)


def test_metrics_fed_one_gradient_at_a_time():
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(shape, generator=gen) for shape in ((4, 3), (7,), (1,))]
    for name, kwargs in [("Max", {}), ("Min", {}), ("Mean", {}), ("MeanStd", {}),
                         ("MeanStd", {"return_mean": False}), ("PNorm", {"p": 3.5}), ("PNorm", {"p": "inf"})]:
        ours, theirs = getattr(fast, name)([], **kwargs), getattr(orig, name)([], **kwargs)
        torch.testing.assert_close(ours.data, theirs.data)  # the reset values
        for g in grads:
            ours(g), theirs(g)
            torch.testing.assert_close(ours.data, theirs.data, rtol=1e-5, atol=1e-7)
        ours.reset()
        torch.testing.assert_close(ours.data, getattr(orig, name)([], **kwargs).data)


def test_data_dim_reset_and_targets_like_the_original():
    setup = Setup("mixed", torch.float32)
    mixes = [make_metrics(module, "all_kinds", setup.targets) for module in (orig, fast)]
    theirs, ours = original.GradientMetricCollector(mixes[0]), GradientMetricCollector(mixes[1])
    assert ours.dim == theirs.dim == 6
    for a, b in zip(mixes[0], mixes[1]):
        assert [id(p) for p in a.target_parameters] == [id(p) for p in b.target_parameters]
        assert a.target_layers == b.target_layers
    ours(setup.forward())
    torch.testing.assert_close(ours.data, theirs.data)  # reset after the call
    empty = [fast.Max([]), fast.MeanStd([]), fast.PNorm(setup.model[0])]
    values = GradientMetricCollector(empty)(setup.forward())
    assert values.shape == (N, 4)
    assert (values[:, 0] == float("-inf")).all() and (values[:, 1] == 0).all()
    assert (values[:, 2] == 1e-16).all()


def test_output_dtype_follows_the_original():
    theirs, ours = run_both("mlp", "all_kinds", torch.float64)
    assert ours.dtype == theirs.dtype == torch.float64


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda m: m.PNorm([], p=0), ValueError),
        (lambda m: m.PNorm([], p=-1.5), ValueError),
        (lambda m: m.PNorm([], p="-inf"), ValueError),
        (lambda m: m.PNorm([], p="one"), ValueError),
        (lambda m: m.PNorm([], p=None), TypeError),
        (lambda m: m.MeanStd([], eps=0), ValueError),
        (lambda m: m.MeanStd([], eps=-1e-3), ValueError),
        (lambda m: m.PNorm(42, p=0), TypeError),  # the targets are checked first
        (lambda m: m.MeanStd(42, eps=0), TypeError),
    ],
)
def test_metric_errors_like_the_original(make, error):
    messages = []
    for module in (orig, fast):
        with pytest.raises(error) as caught:
            make(module)
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_pnorm_of_nan_p_is_nan_like_the_original():
    setup = Setup("mlp", torch.float32)
    theirs = original.GradientMetricCollector(orig.PNorm(setup.model, p=float("nan")))(setup.forward())
    setup = Setup("mlp", torch.float32)
    ours = GradientMetricCollector(fast.PNorm(setup.model, p=float("nan")))(setup.forward())
    assert ours.shape == theirs.shape and ours.isnan().all() and theirs.isnan().all()
    for module in (orig, fast):
        metric = module.PNorm([], p=float("nan"))
        assert metric.data.tolist() == [0.0]  # before any gradient
        metric(torch.ones(3))
        assert metric.data.isnan().all()


def test_integer_transform_outputs_are_reduced_like_the_original():
    """A grad_transform that rounds to integers (a quantisation, say): the original's float
    buffers promote them; so do the stats, through the collector and sample by sample."""

    def quantised(grad):
        return (grad * 100).round().to(torch.int64)

    outputs = []
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        setup = Setup("mlp", torch.float32)
        metrics = [cls(setup.model, grad_transform=quantised) for cls in (module.Max, module.Mean, module.MeanStd)]
        metrics.append(module.PNorm(setup.model, grad_transform=quantised, p=2))
        outputs.append(collector_class(metrics)(setup.forward()))
    torch.testing.assert_close(outputs[1], outputs[0])
    for module in (orig, fast):
        metric = module.Mean([], grad_transform=quantised)
        metric(torch.tensor([0.014, 0.026]))
        assert metric.data.dtype == torch.float32 and metric.data.tolist() == [2.0]


def test_version_and_general_module_like_the_original():
    import cockpit_fast.gradient_metrics as ours
    from cockpit_fast.gradient_metrics.general import GradientMetricCollector as from_general

    assert ours.__version__ == original.__version__
    assert from_general is GradientMetricCollector


@pytest.mark.parametrize("metrics", [[], [1], "Max", [None], 3])
def test_collector_rejects_what_the_original_rejects(metrics):
    for collector_class in (original.GradientMetricCollector, GradientMetricCollector):
        with pytest.raises(ValueError):
            collector_class(metrics)


@pytest.mark.parametrize("bad", ["no_grad", "two_dims", "scalar"])
def test_call_rejects_bad_losses_like_the_original(bad):
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        setup = Setup("mlp", torch.float32)
        loss = setup.forward()
        loss = {"no_grad": loss.detach(), "two_dims": loss.reshape(3, 4), "scalar": loss.sum()}[bad]
        with pytest.raises(ValueError, match="'loss' should"):
            collector_class(module.Max(setup.model))(loss)


def test_unused_target_raises_like_the_original(monkeypatch):
    monkeypatch.setattr(collector_module, "_warned", set())
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        setup = Setup("mlp", torch.float32)
        unused = torch.randn(3, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="not have been used in the graph"):
                collector_class(module.Max([setup.model, unused]))(setup.forward())


def test_frozen_target_raises_like_the_original():
    # Before: "appears to not have been used in the graph", where it is a parameter that does not require grad.
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        setup = Setup("mlp", torch.float32)
        frozen = next(setup.model.parameters()).requires_grad_(False)
        with pytest.raises(RuntimeError, match="does not require grad"):
            collector_class(module.Max(setup.model))(setup.forward())
        frozen.requires_grad_(True)


def test_base_metric_is_abstract_like_the_original():
    for module, collector_class in ((orig, original.GradientMetricCollector), (fast, GradientMetricCollector)):
        setup = Setup("mlp", torch.float32)
        with pytest.raises(NotImplementedError):
            collector_class(module.GradientMetric(setup.model))(setup.forward())


def test_retain_graph_and_grad_fields():
    setup = Setup("mlp", torch.float32)
    sentinel = [torch.full_like(p, 7.0) for p in setup.model.parameters()]
    for p, s in zip(setup.model.parameters(), sentinel):
        p.grad = s.clone()
    setup.model[0].bias.grad = None
    collector = GradientMetricCollector(make_metrics(fast, "all_kinds", setup.targets))
    loss = setup.forward()
    collector(loss, retain_graph=True)
    collector(loss, retain_graph=True)  # the graph is still there
    assert setup.model[0].bias.grad is None
    for name, p in setup.model.named_parameters():
        if name != "0.bias":
            assert torch.equal(p.grad, sentinel[list(dict(setup.model.named_parameters())).index(name)])
    loss.sum().backward()  # and so is it for the user
    assert setup.model[0].bias.grad is not None

    setup = Setup("mlp", torch.float32)
    loss = setup.forward()
    GradientMetricCollector(make_metrics(fast, "all_kinds", setup.targets))(loss)
    # retain_graph=False frees it, like the original
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.sum().backward()


@pytest.mark.parametrize("setup_name", ["mlp", "cnn"])
def test_a_loss_built_with_gradients_is_collected_under_no_grad_or_inference_mode(setup_name):
    # (The original raises there: "element 0 of tensors does not require grad".)
    setup = Setup(setup_name, torch.float64)
    collector = GradientMetricCollector(make_metrics(fast, "all_kinds", setup.targets))
    expected = collector(setup.forward())
    for without_grad in (torch.no_grad, torch.inference_mode):
        loss = setup.forward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback to one pass per sample
            with without_grad():
                rows = collector(loss)
        torch.testing.assert_close(rows, expected, rtol=1e-12, atol=0)


def test_hooks_are_left_alone():
    setup = Setup("mlp", torch.float32)
    hooks = [dict(m._forward_hooks) | dict(m._backward_hooks) for m in setup.model.modules()]
    GradientMetricCollector(make_metrics(fast, "all_kinds", setup.targets))(setup.forward())
    assert hooks == [dict(m._forward_hooks) | dict(m._backward_hooks) for m in setup.model.modules()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("setup_name", ["mlp", "cnn", "mixed"])
def test_cuda_same_values_as_gradient_metrics(setup_name):
    theirs, ours = run_both(setup_name, "all_kinds", torch.float32, device="cuda")
    assert ours.is_cuda
    assert_matches(ours, theirs, torch.float32)


@pytest.mark.parametrize("module_name", ["general", "metrics"])
def test_every_public_name_of_the_original_s_modules_is_here(module_name):
    # (gradient_metrics.general re-exports GradientMetric, which ours lacked.)
    import importlib

    theirs = importlib.import_module(f"gradient_metrics.{module_name}")
    ours = importlib.import_module(f"cockpit_fast.gradient_metrics.{module_name}")
    public = {name for name, value in vars(theirs).items() if not name.startswith("_") and getattr(value, "__module__", "").startswith("gradient_metrics")}
    assert public and public <= set(dir(ours)), public - set(dir(ours))
