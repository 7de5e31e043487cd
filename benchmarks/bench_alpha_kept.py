"""What ``Alpha`` costs with an optimizer other than plain SGD: a tracked ``economy`` step over a
plain step, time and peak memory, on an MLP 784-256-10 with N = 128 (``--optimizer adam``, the
default, or ``sgd``), each step one backward pass or accumulated over ``--micro-batches`` K.

With Adam, Alpha keeps each tracked step's individual gradients until the next step, when the
update is known; with plain SGD it keeps nothing. Time: 40 interleaved pairs of steps after 5
warm-up steps, one thread, the medians and their ratio. Memory: each variant in a fresh process
with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``, as in
``bench_families.py``), the peak RSS growth of building the model and running 5 steps.

Usage: ``python benchmarks/bench_alpha_kept.py [--optimizer adam|sgd] [--micro-batches K]``
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
from bench_ghost import _status_kib, next_forward_starts  # noqa: E402

N, STEPS = 128, 5


def stepper(optimizer, tracked, micro_batches=1):
    """``step(i)`` of a fresh MLP on one fixed batch (over ``micro_batches`` backward passes),
    tracked by an ``economy`` cockpit or plain."""
    from cockpit_fast.cockpit import Cockpit
    from cockpit_fast.utils.configuration import configuration
    from cockpit_fast.utils.training import training_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer == "adam" else torch.optim.SGD(model.parameters(), lr=1e-2)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy")) if tracked else None
    data = torch.Generator().manual_seed(1)
    batch = torch.randn(N, 784, generator=data), torch.randint(0, 10, (N,), generator=data)
    losses = torch.nn.CrossEntropyLoss(reduction="none")
    if micro_batches == 1:

        def step(i):
            training_step(model, opt, batch, losses, cockpit=cockpit, step=i)
            next_forward_starts()

        return step
    parts = list(zip(*(part.chunk(micro_batches) for part in batch)))

    def accumulated(i):
        opt.zero_grad()
        if cockpit is None:
            for x, y in parts:
                (losses(model(x), y).mean() / micro_batches).backward()
        else:
            with cockpit(i, info={"batch_size": N, "optimizer": opt}) as micro:
                for x, y in parts:
                    individual = losses(model(x), y)
                    loss = individual.mean() / micro_batches
                    micro.micro_batch(individual_losses=individual, loss=loss)
                    loss.backward()
        opt.step()
        next_forward_starts()

    return accumulated


def peak_growth_here(optimizer, variant, micro_batches):
    """Prints the peak RSS growth (MiB) of ``variant``'s first steps; run in a fresh process."""
    stepper(optimizer, tracked=True)  # a throwaway build: what it imports lazily is not counted
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak (VmHWM) to the current resident size
    before = _status_kib("VmRSS")
    step = stepper(optimizer, variant == "tracked", micro_batches)
    for i in range(STEPS):
        step(i)
    print((_status_kib("VmHWM") - before) / 1024)


def peak_growth(optimizer, variant, micro_batches):
    child = subprocess.run(
        [sys.executable, __file__, "--optimizer", optimizer, "--micro-batches", str(micro_batches), "--memory-of", variant],
        capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}, check=True,
    )
    return float(child.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--micro-batches", type=int, default=1, help="backward passes a step (default 1)")
    parser.add_argument("--memory-of", choices=("plain", "tracked"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if args.memory_of:
        return peak_growth_here(args.optimizer, args.memory_of, args.micro_batches)
    steps = {variant: stepper(args.optimizer, variant == "tracked", args.micro_batches) for variant in ("plain", "tracked")}
    for i in range(STEPS):
        for step in steps.values():
            step(i)
    times = {name: [] for name in steps}
    for i in range(STEPS, STEPS + 40):
        for name, step in steps.items() if i % 2 else reversed(steps.items()):
            start = time.perf_counter()
            step(i)
            times[name].append(time.perf_counter() - start)
    plain, tracked = statistics.median(times["plain"]), statistics.median(times["tracked"])
    memory = {variant: peak_growth(args.optimizer, variant, args.micro_batches) for variant in ("plain", "tracked")}
    print(
        f"MLP 784-256-10, N = {N} in {args.micro_batches} micro-batches, {args.optimizer}, economy: time plain {plain * 1e3:.2f} ms, tracked "
        f"{tracked * 1e3:.2f} ms ({tracked / plain:.2f}x); peak RSS growth plain {memory['plain']:.1f} MiB, "
        f"tracked {memory['tracked']:.1f} MiB ({memory['tracked'] / memory['plain']:.2f}x)"
    )


if __name__ == "__main__":
    main()
