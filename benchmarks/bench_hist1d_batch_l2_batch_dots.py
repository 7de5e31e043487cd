"""hist1d_batch_l2_batch_dots against the separate hist1d, batch_l2 and 2 x batch_dot, side by side.

    python benchmarks/bench_hist1d_batch_l2_batch_dots.py [--repeats 21] [--calls 20] [--threads 1]

A tracked step reads each parameter's chunk of per-sample gradients g once per statistic: the
histogram, the per-sample squared norms and the projections on two directions (four passes).
The fused op reads it once. For float32 chunks of real layer shapes, each repeat times ``--calls``
calls of the fused op and of the four separate calls, in alternating order; printed are the
medians over the repeats (ms per call) and the median of the per-repeat ratios separate / fused,
with hist1d alone for scale. Inputs as Cockpit sees them: g ~ 1 / N, binned at scale N into 100
bins over (-2, 2).
"""

import argparse
import os
import statistics
import time

import torch

import cockpit_fast
from cockpit_fast import ops

CHUNKS = [(32, 128, 512), (32, 512, 128), (32, 1024, 128), (10, 256, 784)]
BINS, RANGE = 100, (-2.0, 2.0)


def seconds_per_call(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def time_chunk(shape, repeats, calls):
    """Median seconds per call of (fused, separate, hist1d alone) and median ratio separate / fused."""
    gen = torch.Generator().manual_seed(0)
    n = shape[0]
    g = torch.randn(shape, generator=gen) / n
    directions = torch.randn((2, *shape[1:]), generator=gen)

    def fused():
        return ops.hist1d_batch_l2_batch_dots(g, directions, BINS, RANGE, hist_scale=n)

    def separate():
        return (
            ops.hist1d(g, BINS, RANGE, scale=n),
            ops.batch_l2(g),
            ops.batch_dot(g, directions[0]),
            ops.batch_dot(g, directions[1]),
        )

    def hist_only():
        return ops.hist1d(g, BINS, RANGE, scale=n)

    # The fused op must give the separate ops' results before it is worth timing.
    got, expected = fused(), separate()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(got[2], torch.stack(expected[2:], 1))
    times = {"fused": [], "separate": [], "hist1d": []}
    ratios = []
    cases = [("fused", fused), ("separate", separate), ("hist1d", hist_only)]
    for fn in (fused, separate, hist_only):  # warm-up
        seconds_per_call(fn, calls)
    for repeat in range(repeats):
        for name, fn in cases if repeat % 2 == 0 else cases[::-1]:
            times[name].append(seconds_per_call(fn, calls))
        ratios.append(times["separate"][-1] / times["fused"][-1])
    return {name: statistics.median(t) for name, t in times.items()}, statistics.median(ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="interleaved repeats per chunk")
    parser.add_argument("--calls", type=int, default=20, help="calls timed per repeat")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not cockpit_fast.has_extension():
        raise SystemExit("cockpit_fast._C is not built: the benchmark would time the reference ops")
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32, {BINS} bins, "
        f"2 directions; load average {os.getloadavg()}"
    )
    print(f"median of {args.repeats} interleaved repeats of {args.calls} calls; ms per call")
    print(f"{'chunk (N, *param)':20} {'MB':>6} {'fused':>8} {'separate':>9} {'hist1d':>8} {'separate / fused':>17}")
    for shape in CHUNKS:
        medians, ratio = time_chunk(shape, args.repeats, args.calls)
        megabytes = torch.Size(shape).numel() * 4 / 2**20
        print(
            f"{str(shape):20} {megabytes:>6.1f} {1e3 * medians['fused']:>8.3f} {1e3 * medians['separate']:>9.3f} "
            f"{1e3 * medians['hist1d']:>8.3f} {ratio:>16.2f}x"
        )
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
