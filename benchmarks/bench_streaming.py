"""A tracked step with its statistics computed as each gradient arrives (streaming, the default on
one process) against the same step with them computed after the backward pass, side by side.

The fourth GPU run found GPT-2 124M under bf16 autocast 80-90 ms a step slower than the third
(benchmarks/RESULTS.md); streaming came between the two. ``Engine.take`` handing back no form is
what a step that cannot stream does: every statistic waits for the end of the pass. The variants
run interleaved (best of ``--repeats`` runs of ``--steps`` steps, ms per step), as bench_step.py
times them, with a plain step beside them.

    python benchmarks/bench_streaming.py [--device cuda] [--gpt2-size 124m] [--bf16] [--model gpt2] [--case economy]
"""

import argparse
import contextlib
import warnings

import torch

import bench_step
from cockpit_fast import quantities
from cockpit_fast.cockpit import Cockpit
from cockpit_fast.per_sample.engine import Engine
from cockpit_fast.utils import configuration, schedules


@contextlib.contextmanager
def statistics_after_the_pass():
    take = Engine.take
    Engine.take = lambda *args, **kwargs: None
    try:
        yield
    finally:
        Engine.take = take


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_step.add_problem_arguments(parser, model="gpt2", cases=bench_step.CASES)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    bench_step.use_problem(args)
    warnings.simplefilter("ignore")

    def tracked(p):
        return Cockpit(p, bench_step.make_quantities(args.case, quantities, configuration, schedules))

    variants = {"plain": (None, contextlib.nullcontext), "streaming": (tracked, contextlib.nullcontext),
                "after the pass": (tracked, statistics_after_the_pass)}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.repeats):
        for name, (factory, context) in variants.items():
            with context():
                best[name] = min(best[name], bench_step.time_run(args.model, factory, args.steps))
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"{args.model} {args.case} on {where}, bf16 autocast: {args.bf16}; best of {args.repeats} runs of {args.steps} steps")
    for name, seconds in best.items():
        print(f"{name:15} {1e3 * seconds:9.2f} ms   {seconds / best['plain']:5.2f}x plain")


if __name__ == "__main__":
    main()
