"""Where a tracked step's time goes: torch.profiler over a few steps of bench_step.py's problems.

    python benchmarks/profile_step.py --model cnn --case economy [--device cuda] [--bf16] [--gpt2-size 124m]

Prints the wall time per step, the device's busy time per step (CUDA: the kernels' summed time;
far below the wall time means the step waits on the host: Python, launches, syncs) and the ops
that take the most time on the device and on the host.
"""

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import bench_step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_step.add_problem_arguments(parser, model="cnn", cases=bench_step.CASES + ["plain"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    bench_step.use_problem(args)

    from cockpit_fast import quantities
    from cockpit_fast.cockpit import Cockpit
    from cockpit_fast.utils import configuration, schedules

    factory = None
    if args.case != "plain":
        make = bench_step.make_quantities
        factory = lambda params: Cockpit(params, make(args.case, quantities, configuration, schedules))  # noqa: E731
    cockpit, step = bench_step.tracked_problem(args.model, factory)
    for i in range(2):  # warm-up
        step(i)
    bench_step.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(2, 2 + args.steps):
            step(i)
        if cockpit is not None:
            cockpit.get_output()
        bench_step.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    events = prof.key_averages()
    print(f"{args.model} {args.case} on {args.device} (bf16 autocast: {args.bf16}): {1e3 * wall:.2f} ms per step (profiled)")
    if args.device == "cuda":
        # The kernels' own rows only: an op's row also holds its kernels' time.
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
        print(f"device busy {busy:.2f} ms per step ({100 * busy / (1e3 * wall):.0f}% of the wall time)")
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
