"""Tracked steps on a GPU: no host synchronisation inside the step, and the same numbers as on the CPU."""

from contextlib import contextmanager

import pytest
import torch
from backpack import extend

from cockpit_fast.cockpit import Cockpit
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


def tracked_run(device, sync_debug_mode, steps=4, batch_size=16):
    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)).to(device))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # economy without bin adaptation: adapting bins needs the range on the host by design.
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
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
            backward_context=sync_debug(sync_debug_mode),  # the tracked backward pass must not sync
        )
    return cockpit.get_output()


def test_tracked_steps_do_not_synchronise_and_match_the_cpu():
    on_gpu = tracked_run("cuda", sync_debug_mode="error")
    on_cpu = tracked_run("cpu", sync_debug_mode="default")
    assert_same_output(on_gpu, on_cpu, rtol=1e-3, atol=1e-5, max_count_diff=3)
