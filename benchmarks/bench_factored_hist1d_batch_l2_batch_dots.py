"""factored_hist1d_batch_l2_batch_dots against bmm + hist1d_batch_l2_batch_dots, side by side.

    python benchmarks/bench_factored_hist1d_batch_l2_batch_dots.py [--repeats 15] [--calls 10] [--threads 1]

A tracked step forms each chunk of per-sample weight gradients G[n] = left[n]^T right[n] with one
bmm, written to memory, then reads it once with hist1d_batch_l2_batch_dots. The factored op forms
each G[n] a row block at a time into a buffer that stays in cache and reads it there. For float32
factors (N, T, p) and (N, T, q) of real layer shapes and 2 directions, each repeat times
``--calls`` calls of the factored op and of the formed route, in alternating order; printed are
the medians over the repeats (ms per call), bmm alone for scale, and the median of the
per-repeat ratios formed / factored. Inputs as Cockpit sees them: G ~ 1 / N, binned at scale N
into 100 bins over (-2, 2).
"""

import argparse
import os
import statistics
import time

import torch

import cockpit_fast
from cockpit_fast import ops

SHAPES = [(32, 32, 128, 384), (32, 32, 128, 512), (32, 32, 512, 128), (32, 64, 128, 128), (16, 1, 256, 784)]
BINS, RANGE = 100, (-2.0, 2.0)


def seconds_per_call(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def time_shape(shape, repeats, calls):
    """Median seconds per call of (factored, formed, bmm alone) and median ratio formed / factored."""
    gen = torch.Generator().manual_seed(0)
    n, t, p, q = shape
    left = torch.randn((n, t, p), generator=gen) / (n * t) ** 0.5
    right = torch.randn((n, t, q), generator=gen) / t**0.5
    directions = torch.randn((2, p, q), generator=gen)

    def factored():
        return ops.factored_hist1d_batch_l2_batch_dots(left, right, directions, BINS, RANGE, hist_scale=n)

    def formed():
        g = torch.bmm(left.transpose(1, 2), right)
        return ops.hist1d_batch_l2_batch_dots(g, directions, BINS, RANGE, hist_scale=n)

    def bmm_only():
        return torch.bmm(left.transpose(1, 2), right)

    # The two routes must agree before they are worth timing.
    got, expected = factored(), formed()
    assert (got[0] - expected[0]).abs().sum() <= 0.001 * left.shape[0] * p * q, (got[0] - expected[0]).abs().sum()
    torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=0)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-3, atol=1e-3 * float(expected[2].abs().max()))
    times = {"factored": [], "formed": [], "bmm": []}
    ratios = []
    cases = [("factored", factored), ("formed", formed), ("bmm", bmm_only)]
    for _, fn in cases:  # warm-up
        seconds_per_call(fn, calls)
    for repeat in range(repeats):
        for name, fn in cases if repeat % 2 == 0 else cases[::-1]:
            times[name].append(seconds_per_call(fn, calls))
        ratios.append(times["formed"][-1] / times["factored"][-1])
    return {name: statistics.median(t) for name, t in times.items()}, statistics.median(ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repeats per shape")
    parser.add_argument("--calls", type=int, default=10, help="calls timed per repeat")
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
    print(f"{'(N, T, p, q)':20} {'G MB':>6} {'factored':>9} {'formed':>8} {'bmm':>8} {'formed / factored':>18}")
    for shape in SHAPES:
        medians, ratio = time_shape(shape, args.repeats, args.calls)
        n, _, p, q = shape
        print(
            f"{str(shape):20} {n * p * q * 4 / 2**20:>6.1f} {1e3 * medians['factored']:>9.3f} "
            f"{1e3 * medians['formed']:>8.3f} {1e3 * medians['bmm']:>8.3f} {ratio:>17.2f}x"
        )
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
