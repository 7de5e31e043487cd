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

import os
import statistics

import torch

from cockpit_fast import ops

from bench_hist1d_batch_l2_batch_dots import op_benchmark_arguments, seconds_per_call  # noqa: E402

SHAPES = [(32, 32, 128, 384), (32, 32, 128, 512), (32, 32, 512, 128), (32, 64, 128, 128), (16, 1, 256, 784)]
BINS, RANGE = 100, (-2.0, 2.0)


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
    args = op_benchmark_arguments(__doc__.splitlines()[0], repeats=15, calls=10)
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
