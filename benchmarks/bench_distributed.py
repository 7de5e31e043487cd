"""Cockpit under torch.distributed: bytes communicated per tracked step, and step time.

Two processes (gloo on loopback, one thread each) train bench_step.py's MLP 784-256-10 wrapped
in DistributedDataParallel on a global batch of 128 (64 per process), plain and under
cockpit_fast's Cockpit tracking every step. Per case: ms per step (the best of ``--repeats``
runs of ``--steps`` steps, cases interleaved), what DDP itself all-reduces per step (every
gradient once), and what the cockpit adds per tracked step: its collectives and the bytes one
process contributes to them (counted by wrapping torch.distributed's functions).

Usage: ``python benchmarks/bench_distributed.py [--quick]``
"""

import argparse
import datetime
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_step import build, make_quantities, training_step  # noqa: E402

CASES = ["plain", "GradNorm", "MeanGSNR", "NormTest", "GradHist1d", "GradHist2d", "economy"]
WORLD = 2


class CollectiveCounter:
    """Counts calls of collectives and the bytes this process contributes to them.

    Args:
        contributed (dict): ``(module, name)`` of each collective to count -> the position of
            the argument holding what this process contributes. Defaults to torch.distributed's
            all_reduce, all_gather and broadcast (the cockpit's).
    """

    COCKPIT = {(dist, "all_reduce"): 0, (dist, "all_gather"): 1, (dist, "broadcast"): 0}

    def __init__(self, contributed=None):
        self.calls = self.bytes = 0
        for (module, name), position in (contributed or self.COCKPIT).items():
            setattr(module, name, self._counted(getattr(module, name), position))

    def _counted(self, collective, position):
        def counted(*args, **kwargs):
            self.calls += 1
            tensor = args[position] if len(args) > position else None
            if isinstance(tensor, torch.Tensor):
                self.bytes += tensor.numel() * tensor.element_size()
            return collective(*args, **kwargs)

        return counted


def run_case(case, model, steps, counter):
    """ms per step and the cockpit's (collectives, bytes) per tracked step for ``case``."""
    from cockpit_fast import quantities
    from cockpit_fast.cockpit import Cockpit
    from cockpit_fast.utils import configuration, schedules

    inner, input_shape, global_n = model
    params = list(inner.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(inner)
    local_n = global_n // WORLD
    cockpit = None
    if case != "plain":
        cockpit = Cockpit(params, make_quantities(case, quantities, configuration, schedules))
    data = torch.Generator().manual_seed(dist.get_rank())
    inputs = torch.randn(local_n, *input_shape, generator=data)
    labels = torch.randint(0, 10, (local_n,), generator=data)
    step = training_step(ddp, params, cockpit, lambda i: (inputs, labels))

    step(0)
    calls, sent = counter.calls, counter.bytes
    dist.barrier()
    start = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    if cockpit is not None:
        cockpit.get_output()
    seconds = (time.perf_counter() - start) / steps
    return seconds, (counter.calls - calls) / steps, (counter.bytes - sent) / steps


def rank_main(rank, store, steps, repeats):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    from backpack import extend

    counter = CollectiveCounter()
    try:
        best = {case: (float("inf"), 0, 0) for case in CASES}
        for _ in range(repeats):
            for case in CASES:
                torch.manual_seed(0)
                model, input_shape, n = build("mlp")
                result = run_case(case, (extend(model), input_shape, n), steps, counter)
                best[case] = min(best[case], result)
        if rank == 0:
            grad_bytes = sum(p.numel() * p.element_size() for p in build("mlp")[0].parameters())
            print(f"torch {torch.__version__}, {WORLD} processes (gloo, loopback, 1 thread each)")
            print(f"MLP 784-256-10, global batch {n} ({n // WORLD} per process), DDP; {steps} steps, best of {repeats}")
            print(f"DDP all-reduces {grad_bytes / 1024:.0f} KiB of gradients per step\n")
            header = f"{'case':11} {'ms/step':>8} {'x plain':>8} {'collectives':>12} {'KiB sent':>9} {'x DDP':>6}"
            print(header)
            print("-" * len(header))
            plain = best["plain"][0]
            for case, (seconds, calls, sent) in best.items():
                print(
                    f"{case:11} {1e3 * seconds:8.2f} {seconds / plain:8.2f} {calls:12.0f}"
                    f" {sent / 1024:9.1f} {sent / grad_bytes:6.2f}",
                    flush=True,
                )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    args = parser.parse_args()
    steps, repeats = (3, 1) if args.quick else (10, 3)
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(rank_main, args=(f"{workdir}/store", steps, repeats), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
