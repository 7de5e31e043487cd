"""Tracked steps on a GPU: no host synchronisation inside the step, and the same numbers as on the CPU."""

from contextlib import contextmanager

import pytest
import torch
from backpack import extend

from cockpit_fast.cockpit import Cockpit
from cockpit_fast.quantities import GradHist2d
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
