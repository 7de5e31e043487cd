"""The gradient-metrics collector of this tree against another checkout's, side by side.

Each round runs one fresh process per tree (the other tree first on odd rounds), each timing the
collector's call on ``bench_gradient_metrics.py``'s MLP (784-256-10, cross-entropy per sample,
Max, Min, Mean, MeanStd and PNorm(p=2) over all parameters): the median of 30 calls after 5
warm-up calls, one thread. Printed: every round's pair and the median of the rounds.

The other checkout needs its extension built in place:

    git worktree add /tmp/old 182ed87
    (cd /tmp/old && FORCE_ONLY_CPU=1 python setup.py build_ext --inplace)
    python benchmarks/bench_collector_trees.py /tmp/old [--n 128] [--rounds 5]
"""

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

TIMER = r"""
import statistics, time, torch
import cockpit_fast
from cockpit_fast.gradient_metrics import GradientMetricCollector
from cockpit_fast.gradient_metrics import metrics as gm
torch.set_num_threads(1)
torch.manual_seed(0)
N = {n}
model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
collector = GradientMetricCollector([gm.Max(model), gm.Min(model), gm.Mean(model), gm.MeanStd(model), gm.PNorm(model, p=2)])
x, y = torch.randn(N, 784), torch.randint(0, 10, (N,))
times = []
for call in range(35):
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    start = time.perf_counter()
    collector(loss)
    times.append(time.perf_counter() - start)
assert cockpit_fast.has_extension()
print(statistics.median(times[5:]))
"""


def time_tree(tree, n):
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", TIMER.format(n=n)], cwd=tree, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="the other checkout, its extension built in place")
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    print(f"collector call, MLP 784-256-10, N = {args.n}, one thread; load average {os.getloadavg()}")
    print(f"{'round':>5} {'other [ms]':>11} {'this tree [ms]':>15} {'this / other':>13}")
    ratios = []
    for round_ in range(args.rounds):
        order = [args.other, here] if round_ % 2 else [here, args.other]
        times = {tree: time_tree(tree, args.n) for tree in order}
        ratios.append(times[here] / times[args.other])
        print(f"{round_:>5} {1e3 * times[args.other]:>11.2f} {1e3 * times[here]:>15.2f} {ratios[-1]:>13.2f}")
    print(f"median this / other: {statistics.median(ratios):.2f}; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
