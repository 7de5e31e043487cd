"""hist1d_batch_l2_batch_dots against the separate hist1d, batch_l2 and 2 x batch_dot, side by side.

    python benchmarks/bench_hist1d_batch_l2_batch_dots.py [--repeats 21] [--calls 20] [--threads 1]
        [--families gpt2 llama bert vit] [--steps 12]

A tracked step reads each parameter's chunk of per-sample gradients g once per statistic: the
histogram, the per-sample squared norms and the projections on two directions (four passes).
The fused op reads it once. For float32 chunks of real layer shapes, each repeat times ``--calls``
calls of the fused op and of the four separate calls, in alternating order; printed are the
medians over the repeats (ms per call) and the median of the per-repeat ratios separate / fused,
with hist1d alone for scale. Inputs as Cockpit sees them: g ~ 1 / N, binned at scale N into 100
bins over (-2, 2). Then what it does to a tracked step: plain steps, tracked steps whose
statistics read each formed chunk through the op, and tracked steps with the op replaced by the
separate calls, interleaved (``bench_families.py``'s models and economy cockpit).
"""

import argparse
import os
import statistics
import time
import warnings

import torch

import cockpit_fast
from cockpit_fast import ops

import bench_families  # its models and tracked steps

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


def separate(g, directions, bins, range, hist_scale):
    """What the op returns, from the separate ops (the statistics' reads before it)."""
    dots = [ops.batch_dot(g, d) for d in directions]
    return ops.hist1d(g, bins, range, hist_scale), ops.batch_l2(g), torch.stack(dots, 1) if dots else g.new_zeros(len(g), 0)


def time_steps(name, steps):
    """Median ms of a plain step, a tracked step with the op, one with the separate ops."""
    fused = ops.hist1d_batch_l2_batch_dots
    model, batch, losses = bench_families.build(name, 1024)
    tracked, _ = bench_families.stepper(model, batch, losses, True)
    plain = bench_families.stepper(bench_families.build(name, 1024)[0], batch, losses, False)[0]
    for i in range(3):
        tracked(i), plain(i)
    times = {"plain": [], "fused": [], "separate": []}
    for i in range(steps):
        for variant, found in times.items():
            ops.hist1d_batch_l2_batch_dots = separate if variant == "separate" else fused
            found.append(bench_families.seconds(plain if variant == "plain" else tracked, 3 + i))
    ops.hist1d_batch_l2_batch_dots = fused
    return {variant: 1e3 * statistics.median(found) for variant, found in times.items()}


def op_benchmark_arguments(description, repeats, calls, parser=None):
    """The fused ops' benchmarks' command line (``--repeats``, ``--calls``, ``--threads``), applied
    and printed with the load; stops where the extension is not built."""
    parser = parser or argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved repeats per input")
    parser.add_argument("--calls", type=int, default=calls, help="calls timed per repeat")
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
    return args


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=["gpt2", "llama", "bert", "vit"], help="tracked steps of")
    parser.add_argument("--steps", type=int, default=12, help="interleaved steps per variant")
    args = op_benchmark_arguments(None, repeats=21, calls=20, parser=parser)
    print(f"{'chunk (N, *param)':20} {'MB':>6} {'fused':>8} {'separate':>9} {'hist1d':>8} {'separate / fused':>17}")
    for shape in CHUNKS:
        medians, ratio = time_chunk(shape, args.repeats, args.calls)
        megabytes = torch.Size(shape).numel() * 4 / 2**20
        print(
            f"{str(shape):20} {megabytes:>6.1f} {1e3 * medians['fused']:>8.3f} {1e3 * medians['separate']:>9.3f} "
            f"{1e3 * medians['hist1d']:>8.3f} {ratio:>16.2f}x"
        )
    if args.families:
        import transformers  # noqa: PLC0415 (only for the steps)

        warnings.simplefilter("ignore")  # the engine's notices
        transformers.logging.set_verbosity_error()  # GPT-2's config names its own vocabulary's end token
        print(f"\ntracked economy steps (N = 32, T = 32), median of {args.steps} interleaved steps; ms and x plain")
        print(f"{'family':8} {'plain':>8} {'fused':>15} {'separate':>15}")
        for name in args.families:
            ms = time_steps(name, args.steps)
            cells = [f"{ms[v]:7.1f} ({ms[v] / ms['plain']:.2f}x)" for v in ("fused", "separate")]
            print(f"{name:8} {ms['plain']:8.1f} {cells[0]:>15} {cells[1]:>15}", flush=True)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
