"""Tracked steps on a GPU: no host synchronisation inside the step, and the same numbers as on the CPU."""

import copy
from contextlib import contextmanager

import pytest
import torch
from backpack import extend

from any_models import gradient_tests
from cockpit_fast.cockpit import Cockpit
from cockpit_fast.quantities import GradHist2d, NormTest
from cockpit_fast.utils.configuration import configuration
from cockpit_fast.utils.training import training_step
from test_cockpit_core import assert_same_output

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextmanager
def sync_debug(mode):
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def step_sync_debug(step, mode="error"):
    """Sync-debug ``mode`` around tracked step ``step``, except the first: it reads on the host,
    once (how the model's calls treat the samples, that info's loss is a mean); later ones must not."""
    return sync_debug(mode if step > 0 else "default")


# economy without bin adaptation (adapting bins needs the range on the host by design), and the
# 2D histogram, the statistic with the most kernel work per value.
QUANTITIES = {
    "economy": lambda: configuration("economy"),
    "GradHist2d": lambda: [GradHist2d(lambda step: True)],
}


def tracked_run(device, sync_debug_mode, quantities, steps=4, batch_size=16):
    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)).to(device))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model.parameters(), quantities=QUANTITIES[quantities]())
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        inputs = torch.randn(batch_size, 20, generator=data).to(device)
        labels = torch.randint(0, 5, (batch_size,), generator=data).to(device)
        training_step(
            model,
            opt,
            (inputs, labels),
            individual_loss_fn,
            loss_fn=loss_fn,
            cockpit=cockpit,
            step=step,
            backward_context=step_sync_debug(step, sync_debug_mode),
        )
    return cockpit.get_output()


@pytest.mark.parametrize("quantities", sorted(QUANTITIES))
def test_tracked_steps_do_not_synchronise_and_match_the_cpu(quantities):
    on_gpu = tracked_run("cuda", "error", quantities)
    on_cpu = tracked_run("cpu", "default", quantities)
    assert_same_output(on_gpu, on_cpu, rtol=1e-3, atol=1e-5, max_count_diff=3)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16_autocast"])
def test_a_language_models_tracked_steps_do_not_synchronise(bf16):
    """GPT-2 (a small config) under economy, in float32 and under bf16 autocast."""
    from any_models import TOKENS, VOCAB, hf_gpt2, token_losses

    torch.manual_seed(0)
    model = hf_gpt2(layers=2, width=32, heads=2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16)
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (4, TOKENS), device="cuda")
        with autocast:
            training_step(
                model, opt, (tokens, tokens), token_losses, cockpit=cockpit, step=step,
                backward_context=step_sync_debug(step),
            )
    output = cockpit.get_output()
    assert sorted(output) == [0, 1, 2] and all(row["NormTest"] > 0 for row in output.values())
    # bf16's rounding inside a layer is no sign of a use outside it (every Conv1D bias took the whole graph on an H200).
    assert not [name for name, route in cockpit.routes().items() if "whole" in route]


class _GRUClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gru, self.head = torch.nn.GRU(8, 16, batch_first=True), torch.nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


TF32_MODELS = {  # (model, input shape); TF32 as PyTorch leaves it (cuDNN's on), or matrix products' "high"
    "conv": (lambda: torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 5)
    ), (3, 16, 16)),
    "gru": (_GRUClassifier, (12, 8)),
    "linear_high": (lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5)), (64,)),
}


@pytest.mark.parametrize("family", sorted(TF32_MODELS))
def test_layers_computing_in_tf32_keep_their_rules_and_match_the_oracle(family):
    """cuDNN's convolutions and recurrent layers multiply float32 in TF32 by default: their
    parameters' gradients are rounded to 2^-10, which the sum check read as a use outside the
    layer (the first convolution of a CNN and of ViT, and GRUs, took the whole graph on an H200)."""
    import torch.nn.functional as F
    from any_models import flat, oracle_grads

    make, shape = TF32_MODELS[family]
    torch.manual_seed(0)
    model = make()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, *shape, generator=gen), torch.randint(0, 5, (16,), generator=gen)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if family == "linear_high" else "highest")
    try:
        gpu = model.cuda()
        cockpit = Cockpit(gpu.parameters(), quantities=[NormTest(lambda step: True)])
        losses = F.cross_entropy(gpu(x.cuda()), y.cuda(), reduction="none")
        with cockpit(0, info={"batch_size": 16, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    finally:
        torch.set_float32_matmul_precision(before)
    assert not [name for name, route in cockpit.routes().items() if "whole" in route]
    twin = copy.deepcopy(model).cpu().double()
    g = flat(oracle_grads(twin, list(twin.parameters()), lambda m, a, b: F.cross_entropy(m(a), b, reduction="none"), x.double(), y))
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(gradient_tests(g)["NormTest"], rel=1e-2)


def test_a_recurrent_layer_called_on_the_cpu_then_tracked_on_the_gpu_keeps_its_rule():
    """What a module's own nodes compute in is read once per device: a GRU's call on the CPU
    (a forward pass the cockpit watches, say a shape check) has none of cuDNN's nodes, its
    calls on the GPU do (TF32); read once per module, the GPU's check missed TF32."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = _GRUClassifier()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(lambda step: True)])
    gen = torch.Generator().manual_seed(1)
    model(torch.randn(16, 12, 8, generator=gen))  # on the CPU, before training
    model.cuda()
    x, y = torch.randn(16, 12, 8, generator=gen).cuda(), torch.randint(0, 5, (16,), generator=gen).cuda()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, info={"batch_size": 16, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    assert not [name for name, route in cockpit.routes().items() if "whole" in route]
