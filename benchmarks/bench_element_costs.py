"""What one per-sample gradient element costs a tracked step, against what a plain step spends on it.

    python benchmarks/bench_element_costs.py [--threads 1] [--positions 1 32]

A plain step spends about 6 T multiply-adds' worth of matrix products on each (sample, weight)
pair of a layer applied at T positions (forward, input gradient, weight gradient). A histogram
of the individual gradients (Cockpit's GradHist1d, in ``economy``) has to bin every one of the
N x P values, and where T > 1 form them first (one batched product with T-long inner
dimension, bounded by writing its output). Printed: ns per element of each of those, measured
here side by side, the matrix products' rate, and the floor they set on a tracked step's time
over a plain one's, ``1 + (formation + binning) / plain``, per T; and the same with
``factored_hist1d_batch_l2_batch_dots``, which forms and bins in cache (nothing written). Python
overhead is not counted: a floor for the layer, not a prediction for a model.
"""

import argparse
import statistics
import time

import torch

from cockpit_fast import ops


def median_seconds(fn, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--positions", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, p, q = 32, 128, 512  # a GPT-2-sized layer at width 128, N = 32
    elements = n * p * q
    g = torch.randn(n, p * q) * 0.01
    directions = torch.randn(2, p * q)
    left, right = torch.randn(n, p) * 0.1, torch.randn(n, q) * 0.1

    binning = median_seconds(lambda: ops.hist1d(g, 100, (-2.0, 2.0), scale=n)) / elements
    fused = median_seconds(lambda: ops.hist1d_batch_l2_batch_dots(g, directions, 100, (-2.0, 2.0), n)) / elements
    outer = median_seconds(lambda: ops.outer_hist1d(left, right, 100, (-2.0, 2.0), n)) / elements
    copy = median_seconds(lambda: g.clone()) / elements
    a, b = torch.randn(n * 32, p), torch.randn(p, q)
    gemm_rate = 2 * n * 32 * p * q / median_seconds(lambda: a @ b)

    print(f"torch {torch.__version__}, {args.threads} thread(s); layer {p}x{q}, N = {n}")
    print(f"matrix product (N*32 x {p} @ {p} x {q}): {gemm_rate / 1e9:.1f} GFLOP/s")
    print(f"ns per element: hist1d {1e9 * binning:.2f}, hist1d + batch_l2 + 2 dots {1e9 * fused:.2f}, "
          f"outer_hist1d (T = 1, not formed) {1e9 * outer:.2f}, a copy (read + write) {1e9 * copy:.2f}")
    print(f"{'T':>4} {'plain ns/elem':>14} {'formation':>10} {'binning':>8} {'floor x plain':>14} {'in cache':>9} {'floor':>6}")
    for t in args.positions:
        plain = 6 * t / gemm_rate  # 2 T flops per pass, three passes
        left_t, right_t = torch.randn(n, t, p) * 0.1, torch.randn(n, t, q) * 0.1
        factored = median_seconds(
            lambda: ops.factored_hist1d_batch_l2_batch_dots(left_t, right_t, directions.view(2, p, q), 100, (-2.0, 2.0), n)
        ) / elements
        if t == 1:
            formation, binned = 0.0, outer
        else:
            formation = median_seconds(lambda: left_t.transpose(1, 2) @ right_t) / elements
            binned = fused
        floor = 1 + (formation + binned) / plain
        print(
            f"{t:>4} {1e9 * plain:>14.2f} {1e9 * formation:>10.2f} {1e9 * binned:>8.2f} {floor:>13.2f}x"
            f" {1e9 * factored:>9.2f} {1 + factored / plain:>5.2f}x"
        )


if __name__ == "__main__":
    main()
