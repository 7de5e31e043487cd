"""FSDP2: a step tracked by the cockpit's ``economy`` configuration against a plain FSDP2 step.

Two processes (gloo on loopback, one thread each) train Hugging Face GPT-2 from a small config
(4 layers, width 128, 4 heads, random weights, a vocabulary of ``--vocab`` tokens), ``fully_shard``
on each block and at the root, AdamW (or plain SGD, ``--optimizer sgd``), N = 8 sequences of
T = 64 tokens per process; each sample's loss is its mean next-token cross-entropy. With AdamW,
``Alpha`` keeps each process's individual gradients of a tracked step (N times the parameters,
full-size) until the next step reveals the update; with plain SGD it keeps nothing.

Time: two copies of the sharded model in each process, one plain and one tracked, ``--repeats``
interleaved pairs of steps after warm-up (the pair's order alternates); rank 0's median ms per
step, the ratio of the medians and the spread of the pairs' ratios.

Communication per step, as rank 0 hands it to torch.distributed (each collective's input:
what one process contributes), counted by wrapping torch.distributed's collectives and the
functional collectives DTensor uses: FSDP2's own in a plain step (all-gathers of parameters,
reduce-scatters of gradients), and what a tracked step adds, with its number of collectives.

Memory: each variant in a fresh pair of processes; each resets its peak resident set size
(``/proc/self/clear_refs``) after its imports and a throwaway build, then builds and shards the
model and runs four steps; the growth of the peak RSS per rank, and tracked over plain. These
processes (not the timed ones) run with glibc's mmap threshold fixed at 128 KiB
(``MALLOC_MMAP_THRESHOLD_``, as in ``bench_families.py``), so that the peak RSS follows the live
tensors.

Usage: ``python benchmarks/bench_fsdp.py [--repeats R] [--vocab V] [--optimizer adamw|sgd]``
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
from bench_distributed import CollectiveCounter  # noqa: E402
from bench_ghost import _status_kib, next_forward_starts  # noqa: E402

WORLD, N, T, LAYERS, WIDTH, HEADS = 2, 8, 64, 4, 128, 4
MEMORY_STEPS = 4

# Where each collective takes the tensor one process contributes: the cockpit's, FSDP2's, DTensor's.
CONTRIBUTED = {
    **CollectiveCounter.COCKPIT,
    (dist, "all_gather_single"): 1, (dist, "reduce_scatter_single"): 1,
    (dist, "all_gather_into_tensor"): 1, (dist, "reduce_scatter_tensor"): 1,
    (funcol, "all_reduce"): 0, (funcol, "all_gather_tensor"): 0, (funcol, "reduce_scatter_tensor"): 0,
}


def build(vocab, optimizer):
    """GPT-2 sharded with FSDP2, its optimizer (``"adamw"`` or ``"sgd"``), and this rank's batch."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=T, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    data = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, vocab, (N, T), generator=data)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=1e-2)
    return model, opt, ids


def stepper(model, opt, ids, tracked):
    """A step of ``model`` (``step(i)``), tracked by a cockpit of the economy configuration or plain."""
    from cockpit_fast.cockpit import Cockpit
    from cockpit_fast.integrations.language_models import causal_lm_losses
    from cockpit_fast.utils.configuration import configuration

    cockpit = Cockpit(model.parameters(), quantities=configuration("economy")) if tracked else None

    def step(i):
        opt.zero_grad()
        losses = causal_lm_losses(model(ids).logits, ids)
        loss = losses.mean()
        if cockpit is None:
            loss.backward()
        else:
            with cockpit(i, info={"batch_size": N, "individual_losses": losses, "loss": loss, "optimizer": opt}):
                loss.backward()
        opt.step()
        next_forward_starts()

    return step, cockpit


def time_and_count(rank, vocab, optimizer, repeats, out):
    """Rank ``rank`` of the timing run: interleaved pairs of plain and tracked steps."""
    counter = CollectiveCounter(CONTRIBUTED)
    plain_step, _ = stepper(*build(vocab, optimizer), tracked=False)
    tracked_step, cockpit = stepper(*build(vocab, optimizer), tracked=True)
    for i in range(3):  # warm-up: the tracked step's first step runs the engine's checks
        plain_step(i)
        tracked_step(i)
    times = {"plain": [], "tracked": []}
    sent = {"plain": [], "tracked": []}
    for i in range(3, 3 + repeats):
        order = (("plain", plain_step), ("tracked", tracked_step))
        for name, step in order if i % 2 else order[::-1]:
            dist.barrier()
            calls, sent_bytes = counter.calls, counter.bytes
            start = time.perf_counter()
            step(i)
            times[name].append(time.perf_counter() - start)
            sent[name].append((counter.calls - calls, counter.bytes - sent_bytes))
    cockpit.get_output()
    if rank == 0:
        torch.save({"times": times, "sent": sent}, Path(out) / "timing.pt")


def measure_memory(rank, vocab, optimizer, variant, out):
    """Rank ``rank``'s peak RSS growth of building, sharding and running a few steps of ``variant``."""
    build(vocab, optimizer)  # a throwaway build: what it imports lazily is not counted
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak (VmHWM) to the current resident size
    before = _status_kib("VmRSS")
    step, _ = stepper(*build(vocab, optimizer), tracked=variant == "tracked")
    for i in range(MEMORY_STEPS):
        step(i)
    (Path(out) / f"memory{rank}.txt").write_text(str((_status_kib("VmHWM") - before) / 1024))


def _rank_main(rank, job, args, out):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300)
    )
    try:
        job(rank, *args, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def in_group(job, *args):
    out = tempfile.mkdtemp()
    mp.spawn(_rank_main, args=(job, args, out), nprocs=WORLD, join=True)
    return Path(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="interleaved pairs of timed steps")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="the training step's optimizer")
    args = parser.parse_args()
    print(
        f"GPT-2 {LAYERS} layers, width {WIDTH}, vocab {args.vocab}, N = {N} per rank, T = {T}, {WORLD} ranks "
        f"(gloo, 1 thread each), fully_shard per block and root, {args.optimizer}; economy configuration"
    )
    result = torch.load(in_group(time_and_count, args.vocab, args.optimizer, args.repeats) / "timing.pt")
    times, sent = result["times"], result["sent"]
    plain, tracked = statistics.median(times["plain"]), statistics.median(times["tracked"])
    ratios = [t / p for t, p in zip(times["tracked"], times["plain"])]
    print(f"time: plain {plain * 1e3:.1f} ms, tracked {tracked * 1e3:.1f} ms per step (medians of {args.repeats}), "
          f"ratio {tracked / plain:.2f}x (pairs {min(ratios):.2f}-{max(ratios):.2f}x)")
    fsdp_calls, fsdp_bytes = statistics.median(c for c, _ in sent["plain"]), statistics.median(b for _, b in sent["plain"])
    all_calls, all_bytes = statistics.median(c for c, _ in sent["tracked"]), statistics.median(b for _, b in sent["tracked"])
    print(f"communication, rank 0's contribution per step: FSDP2 {fsdp_calls:.0f} collectives, {fsdp_bytes / 2**20:.2f} MiB; "
          f"the cockpit adds {all_calls - fsdp_calls:.0f} collectives, {(all_bytes - fsdp_bytes) / 2**20:.2f} MiB")
    growth = {}
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # read by glibc as each process it spawns starts
    for variant in ("plain", "tracked"):
        folder = in_group(measure_memory, args.vocab, args.optimizer, variant)
        growth[variant] = [float((folder / f"memory{r}.txt").read_text()) for r in range(WORLD)]
    print(
        "peak RSS growth per rank: plain " + ", ".join(f"{m:.1f}" for m in growth["plain"])
        + " MiB; tracked " + ", ".join(f"{m:.1f}" for m in growth["tracked"]) + " MiB; tracked / plain "
        + ", ".join(f"{t / p:.2f}x" for t, p in zip(growth["tracked"], growth["plain"]))
    )


if __name__ == "__main__":
    main()
