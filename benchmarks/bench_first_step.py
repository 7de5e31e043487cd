"""Time of the first tracked step (the checked one) against a plain step and a later tracked step.

The first step that reads per-sample gradients proves how the model's calls treat the samples
(two more backward passes) and checks that ``backward()`` ran on the loss handed in (each
parameter's per-sample gradients summed once). Each column is the best of ``--repeats`` fresh
runs, the variants interleaved: ``plain`` a first step without a cockpit, ``first`` the first
tracked step, ``first, no loss check`` the same with that check switched off, ``later`` a tracked
step after it. Problems and cockpits as in ``bench_step.py`` (``economy``, every step).

Usage: ``python benchmarks/bench_first_step.py [--model mlp|cnn|gpt2] [--repeats R]``
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import fast_configuration, fast_quantities, fast_schedules, make_quantities, tracked_problem  # noqa: E402
from cockpit_fast.cockpit import Cockpit  # noqa: E402
from cockpit_fast.per_sample.engine import Engine  # noqa: E402


def economy(params):
    return Cockpit(params, make_quantities("economy", fast_quantities, fast_configuration, fast_schedules))


def first_and_later(model_name, factory, loss_check=True):
    """Seconds of the first step and of the second under the cockpit ``factory`` makes."""
    checked = Engine._warn_if_another_loss
    if not loss_check:
        Engine._warn_if_another_loss = lambda self, sums, grads: None
    try:
        _, step = tracked_problem(model_name, factory)
        times = []
        for i in range(2):
            start = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - start)
    finally:
        Engine._warn_if_another_loss = checked
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn", "gpt2"], action="append", help="problem(s); default all")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"best of {args.repeats} fresh runs; ms\n")
    print(f"{'model':5} {'plain':>8} {'first':>8} {'first, no loss check':>21} {'later':>8} {'check/plain':>12}")
    for model_name in args.model or ["mlp", "cnn", "gpt2"]:
        best = [float("inf")] * 4
        for _ in range(args.repeats):
            plain = first_and_later(model_name, None)[0]
            first, later = first_and_later(model_name, economy)
            unchecked = first_and_later(model_name, economy, loss_check=False)[0]
            best = [min(b, t) for b, t in zip(best, (plain, first, unchecked, later))]
        plain, first, unchecked, later = (1e3 * t for t in best)
        print(f"{model_name:5} {plain:8.1f} {first:8.1f} {unchecked:21.1f} {later:8.1f} {(first - unchecked) / plain:12.2f}", flush=True)


if __name__ == "__main__":
    main()
