"""Fused ops against the pure-torch paths Cockpit takes today, side by side in one run.

    python benchmarks/bench_ops.py [--quick] [--device cpu|cuda]

For per-sample gradients of real layer shapes, prints per op the median time of the fused op and
of the baseline, their ratio, and the effective bandwidth of the fused op (bytes of g read / time).
Baselines are Cockpit 1.0.2's own histogram transforms when Cockpit is installed (else the
Cockpit-style twins in cockpit_fast.reference), two separate torch reductions for the squared
norms, and einsum for dot products. On CUDA it also prints the device-to-device copy bandwidth
and hist2d on data concentrated in one bin against spread data.
"""

import argparse
import weakref

import torch
from torch.utils.benchmark import Timer

import cockpit_fast
from cockpit_fast import ops, reference

LAYERS = {
    "Linear 256x784": (256, 784),
    "Linear 10x256": (10, 256),
    "Conv 64x32x3x3": (64, 32, 3, 3),
}


def cockpit_histograms():
    """Cockpit's own GradHist1d / GradHist2d transforms, or None without Cockpit."""
    try:
        from cockpit.quantities import GradHist1d, GradHist2d
    except ImportError:
        return None
    always = lambda step: True  # noqa: E731
    return GradHist1d(always, bins=100, range=(-2, 2)), GradHist2d(always, bins=(40, 50), range=((-1, 1), (-2, 2)))


def median_seconds(fn, min_run_time):
    return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def cases(g, param, n, cockpit):
    """(op name, fused call, baseline call, baseline name) for one gradient tensor."""
    direction = param
    if cockpit is not None:
        hist1d_quantity, hist2d_quantity = cockpit
        g._param_weakref = weakref.ref(param)  # what BackPACK attaches to grad_batch
        hist1d_base = ("Cockpit GradHist1d", lambda: hist1d_quantity._compute_histogram(g))
        hist2d_base = ("Cockpit GradHist2d", lambda: hist2d_quantity._compute_histogram(g))
    else:
        hist1d_base = ("clamp + histc", lambda: reference.hist1d(g, 100, (-2.0, 2.0), n))
        hist2d_base = ("Cockpit-style 2D", lambda: reference.hist2d(g, param, scale=n))
    return [
        ("hist1d", lambda: ops.hist1d(g, 100, (-2.0, 2.0), n), *hist1d_base),
        ("hist2d", lambda: ops.hist2d(g, param, scale=n), *hist2d_base),
        (
            "batch_l2 + sum_grad_squared",
            lambda: ops.batch_l2_and_sum_grad_squared(g, n),
            "two torch reductions",
            lambda: (reference.batch_l2(g, n), reference.sum_grad_squared(g, n)),
        ),
        ("batch_dot", lambda: ops.batch_dot(g, direction, n), "einsum", lambda: reference.batch_dot(g, direction, n)),
        (
            "per_sample_stats (p=1,2)",
            lambda: ops.per_sample_stats(g, n, [1.0, 2.0]),
            "torch reductions",
            lambda: reference.per_sample_stats(g, n, [1.0, 2.0]),
        ),
    ]


def run_table(device, batch_sizes, min_run_time):
    cockpit = cockpit_histograms()
    gen = torch.Generator().manual_seed(0)
    print(f"{'layer':16} {'N':>4} {'op':28} {'fused ms':>9} {'baseline ms':>11} {'ratio':>7} {'GB/s':>6}  baseline")
    for layer, shape in LAYERS.items():
        for n in batch_sizes:
            # BackPACK's grad_batch of a mean loss: (1/N) grad l_n, of magnitude ~1/N.
            g = (torch.randn((n, *shape), generator=gen) / n).to(device)
            param = torch.randn(shape, generator=gen).to(device)
            for name, fused, baseline_name, baseline in cases(g, param, float(n), cockpit):
                fused_s = median_seconds(lambda: (fused(), sync(device)), min_run_time)
                base_s = median_seconds(lambda: (baseline(), sync(device)), min_run_time)
                gbps = g.numel() * g.element_size() / fused_s / 1e9
                print(
                    f"{layer:16} {n:>4} {name:28} {fused_s * 1e3:>9.3f} {base_s * 1e3:>11.3f} "
                    f"{base_s / fused_s:>6.1f}x {gbps:>6.1f}  {baseline_name}"
                )


def run_gpu_bandwidth(min_run_time):
    """Large inputs against the device's copy bandwidth; concentrated against spread hist2d data."""
    n, shape = 256, (4096, 1024)
    g = torch.randn((n, *shape), device="cuda") / n
    param = torch.randn(shape, device="cuda")
    copy_target = torch.empty_like(g)
    bytes_read = g.numel() * g.element_size()
    copy_s = median_seconds(lambda: (copy_target.copy_(g), sync("cuda")), min_run_time)
    copy_gbps = 2 * bytes_read / copy_s / 1e9  # a copy reads and writes
    print(f"\nLarge input: g {tuple(g.shape)} float32 ({bytes_read / 1e9:.1f} GB); D2D copy {copy_gbps:.0f} GB/s")
    for name, fn in [
        ("hist1d", lambda: ops.hist1d(g, 100, (-2.0, 2.0), n)),
        ("hist2d", lambda: ops.hist2d(g, param, scale=n)),
        ("batch_l2 + sum_grad_squared", lambda: ops.batch_l2_and_sum_grad_squared(g, n)),
        ("batch_dot", lambda: ops.batch_dot(g, param, n)),
        ("per_sample_stats (p=1,2)", lambda: ops.per_sample_stats(g, n, [1.0, 2.0])),
    ]:
        seconds = median_seconds(lambda: (fn(), sync("cuda")), min_run_time)
        gbps = bytes_read / seconds / 1e9
        print(f"  {name:28} {seconds * 1e3:8.3f} ms  {gbps:7.0f} GB/s  {100 * gbps / copy_gbps:5.1f}% of copy")
    concentrated = torch.full_like(g, 0.001)
    flat_param = torch.full_like(param, 0.5)
    spread_s = median_seconds(lambda: (ops.hist2d(g, param, scale=n), sync("cuda")), min_run_time)
    concentrated_s = median_seconds(lambda: (ops.hist2d(concentrated, flat_param, scale=n), sync("cuda")), min_run_time)
    print(f"  hist2d concentrated in one bin / spread: {concentrated_s / spread_s:.2f}x the time")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 32 only, shorter timing")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if not cockpit_fast.has_extension():
        raise SystemExit("cockpit_fast._C is not built: the benchmark would time the reference against itself")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"cockpit_fast op benchmark on {device_name}; torch {torch.__version__}")
    run_table(args.device, [32] if args.quick else [32, 128], 0.05 if args.quick else 0.3)
    if args.device == "cuda":
        run_gpu_bandwidth(0.05 if args.quick else 0.3)


if __name__ == "__main__":
    main()
