"""gradient-metrics 0.5.0 against cockpit_fast.gradient_metrics on an MLP 784-256-10.

Times one collector call (the graph is kept with ``retain_graph=True`` and reused, so the forward
pass is not timed) with all five metric kinds over the whole model, for N in {32, 128, 512}, and
prints the median time per call and the speed-up. A second table times the per-sample gradients
alone: the route the collector takes, plain identity rows through ``is_grads_batched`` (the route
for arbitrary graphs), and BackPACK's ``BatchGrad`` on a model extended before its forward pass.

``--model gpt2`` times a Hugging Face GPT-2 built from a config instead (2 layers, width 64,
2 heads, random weights; N sequences of 16 tokens, the loss of a sequence the mean of its tokens'),
for N in {16, 32, 64}: its layers are ``transformers``' ``Conv1D``, its output head tied to the
token embedding.

Usage: ``python benchmarks/bench_gradient_metrics.py [--quick] [--model mlp|gpt2]``
"""

import argparse
import copy
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import gradient_metrics as original
import torch
import torch.nn as nn
from backpack import backpack, extend
from backpack.extensions import BatchGrad
from gradient_metrics import metrics as orig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
import cockpit_fast  # noqa: E402
from cockpit_fast.gradient_metrics import GradientMetricCollector  # noqa: E402
from cockpit_fast.gradient_metrics import metrics as fast  # noqa: E402
from cockpit_fast.per_sample import Capture  # noqa: E402

BATCH_SIZES = (32, 128, 512)


def make_metrics(module, model):
    """All five kinds, each over every parameter of the model."""
    return [
        module.Max(model),
        module.Min(model),
        module.Mean(model),
        module.MeanStd(model),
        module.PNorm(model, p=2),
    ]


def cpu_name():
    """The CPU model from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def median_seconds(call, repeats, min_seconds):
    """Median of at least ``repeats`` timed calls, repeating until ``min_seconds`` have passed."""
    call()  # warm-up
    times, start = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_seconds:
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return statistics.median(times), len(times)


def gpt2_main(repeats, min_seconds):
    """The collector on GPT-2, against gradient-metrics 0.5.0."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' GPT-2
    from any_models import hf_gpt2, token_losses

    torch.manual_seed(0)
    vocab = 50257  # GPT-2's
    model = hf_gpt2(layers=2, width=64, heads=2, vocab=vocab, positions=16, dropout=0.1)
    print("GPT-2 2 layers, width 64, T = 16; metrics Max, Min, Mean, MeanStd, PNorm(p=2) over the model")
    print(f"{'N':>5} {'gradient-metrics [ms]':>22} {'cockpit_fast [ms]':>18} {'speed-up':>9}")
    warnings.simplefilter("ignore")
    theirs = original.GradientMetricCollector(make_metrics(orig, model))
    ours = GradientMetricCollector(make_metrics(fast, model))  # before the forward passes it watches
    for n in (16, 32, 64):
        ids = torch.randint(0, vocab, (n, 16))
        loss = token_losses(model(ids), ids)
        torch.testing.assert_close(ours(loss, retain_graph=True), theirs(loss, retain_graph=True), rtol=1e-3, atol=1e-6)
        t_theirs, _ = median_seconds(lambda: theirs(loss, retain_graph=True), repeats, min_seconds)
        t_ours, _ = median_seconds(lambda: ours(loss, retain_graph=True), repeats, min_seconds)
        print(f"{n:>5} {1e3 * t_theirs:>22.2f} {1e3 * t_ours:>18.2f} {t_theirs / t_ours:>8.1f}x", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one timed call per measurement")
    parser.add_argument("--model", choices=["mlp", "gpt2"], default="mlp")
    args = parser.parse_args()

    repeats, min_seconds = (1, 0.0) if args.quick else (3, 2.0)
    if args.model == "gpt2":
        print(f"device: cpu ({cpu_name()}), {torch.get_num_threads()} threads")
        return gpt2_main(repeats, min_seconds)
    print(f"device: cpu ({cpu_name()}), {torch.get_num_threads()} threads")
    print(f"torch {torch.__version__}, cockpit_fast extension built: {cockpit_fast.has_extension()}")
    print("MLP 784-256-10, cross-entropy per sample; metrics Max, Min, Mean, MeanStd, PNorm(p=2) over all parameters")
    print(f"{'N':>5} {'gradient-metrics [ms]':>22} {'cockpit_fast [ms]':>18} {'speed-up':>9}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    # The reference-ops notice (if not built) and BackPACK's notice about its module hooks.
    warnings.simplefilter("ignore", RuntimeWarning)
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    rows = []
    # Made before the forward passes, which the collector (its per-sample engine) watches.
    theirs = original.GradientMetricCollector(make_metrics(orig, model))
    ours = GradientMetricCollector(make_metrics(fast, model))
    for n in BATCH_SIZES:
        x, y = torch.randn(n, 784), torch.randint(0, 10, (n,))
        loss = nn.functional.cross_entropy(model(x), y, reduction="none")
        torch.testing.assert_close(ours(loss, retain_graph=True), theirs(loss, retain_graph=True),
                                   rtol=1e-4, atol=1e-6)
        t_theirs, _ = median_seconds(lambda: theirs(loss, retain_graph=True), repeats, min_seconds)
        t_ours, _ = median_seconds(lambda: ours(loss, retain_graph=True), 5 * repeats, min_seconds)
        print(f"{n:>5} {1e3 * t_theirs:>22.2f} {1e3 * t_ours:>18.2f} {t_theirs / t_ours:>8.1f}x")
        rows.append((n, per_sample_gradient_times(model, x, y, ours._engine, loss, repeats, min_seconds)))
    print("\nper-sample gradients alone (no metrics), the route above against BackPACK BatchGrad")
    print("(BackPACK needs the model extended before the forward pass, which is timed with it)")
    print(f"{'N':>5} {'engine [ms]':>17} {'identity rows [ms]':>19} {'BackPACK fwd+bwd [ms]':>22}")
    for n, (t_route, t_identity, t_backpack) in rows:
        print(f"{n:>5} {1e3 * t_route:>17.2f} {1e3 * t_identity:>19.2f} {1e3 * t_backpack:>22.2f}")


def per_sample_gradient_times(model, x, y, engine, loss, repeats, min_seconds):
    """Median seconds of: the collector's per-sample gradients, plain identity rows, BackPACK."""
    params = list(model.parameters())
    t_route, _ = median_seconds(lambda: engine.per_sample(loss), 5 * repeats, min_seconds)
    identity = torch.eye(len(loss))
    t_identity, _ = median_seconds(
        lambda: torch.autograd.grad(loss, params, identity, retain_graph=True, is_grads_batched=True),
        repeats, 0.0,  # slow at large N: the fewest repeats asked for
    )
    extended = extend(copy.deepcopy(model))
    sum_loss = extend(nn.CrossEntropyLoss(reduction="sum"))

    def backpack_step():
        extended.zero_grad()
        with backpack(BatchGrad()):
            sum_loss(extended(x), y).backward()

    t_backpack, _ = median_seconds(backpack_step, 5 * repeats, min_seconds)
    return t_route, t_identity, t_backpack


if __name__ == "__main__":
    main()
