"""Training under cockpit_fast's Cockpit in one process or in a spawned gloo group (test helper).

The same model, initial weights and global batches either way: rank r trains on its slice of
each global batch. Each run saves ``{"output": cockpit.get_output(), "written": [...]}``.
"""

import contextlib
import datetime
import gc
import io
import os
import socket
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from backpack import extend

import cockpit_fast.distributed
from cockpit_fast import quantities as q
from cockpit_fast.cockpit import Cockpit
from cockpit_fast.utils import schedules
from cockpit_fast.utils.training import training_step
from test_cockpit_core import build_model

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a rank left waiting fails instead of hanging


def every_quantity():
    """Every quantity of Cockpit's set that is defined on several processes, tracked every step."""
    s = schedules.linear(1)
    return [
        q.Loss(s),
        q.GradNorm(s),
        q.MeanGSNR(s),
        q.NormTest(s),
        q.InnerTest(s),
        q.OrthoTest(s),
        q.CABS(s),
        q.EarlyStopping(s),
        q.TICDiag(s),
        q.TICTrace(s, curvature="diag_ggn_exact"),
        q.HessTrace(s),
        q.Alpha(s),
        q.Distance(s),
        q.UpdateSize(s),
        q.Parameters(s),
        q.GradHist1d(s, bins=9, adapt=q.GradAbsMax(schedules.linear(2), padding=0.1)),
        q.GradHist2d(s, bins=(6, 5), range=((-0.5, 0.5), (-1, 1)), keep_individual=True),
    ]


QUANTITY_SETS = {
    "every": every_quantity,
    # What combines over micro-batches: every quantity but BackPACK's curvatures and HessMaxEV.
    "first_order": lambda: [
        quantity for quantity in every_quantity() if not isinstance(quantity, (q.TICDiag, q.TICTrace, q.HessTrace))
    ],
    # ... but CABS and EarlyStopping, which need plain SGD.
    "any_optimizer": lambda: [
        quantity for quantity in QUANTITY_SETS["first_order"]() if not isinstance(quantity, (q.CABS, q.EarlyStopping))
    ],
    "hessian_max_ev": lambda: [q.HessMaxEV(schedules.linear(1))],
    "alpha_adam": lambda: [q.Alpha(schedules.linear(1))],
    "time_only": lambda: [q.Time(schedules.linear(1))],
    # One bin, one cell: each counts every gradient value of the step.
    "one_bin": lambda: [
        q.GradHist1d(schedules.linear(1), bins=1),
        q.GradHist2d(schedules.linear(1), bins=(1, 1), keep_individual=True),
    ],
    # The range adapts on steps without a histogram: those steps read the batch all the same.
    "adapt_off_schedule": lambda: [
        q.GradHist1d(schedules.linear(3), bins=9, adapt=q.GradAbsMax(schedules.linear(2), padding=0.1))
    ],
}


def weighted_allreduce(share, bucket):
    """DDP communication hook: the global batch's mean gradient, each rank weighted by N_r / N
    (DDP's default averages the ranks' means, which is that only for equal batch sizes)."""
    buffer = bucket.buffer().mul_(share)
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def accumulated_step(model, opt, cockpit, step, batch, individual_loss_fn, micro_batches):
    """One step over ``micro_batches`` micro-batches of ``batch`` (of unequal sizes where it does
    not divide), DistributedDataParallel's synchronisation left for the last (``no_sync()``)."""
    inputs, labels = batch
    opt.zero_grad()
    parts = list(zip(inputs.tensor_split(micro_batches), labels.tensor_split(micro_batches)))
    with cockpit(step, info={"batch_size": len(inputs), "optimizer": opt}) as tracked:
        for index, (x, y) in enumerate(parts):
            last = index == len(parts) - 1
            ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
            with model.no_sync() if ddp and not last else contextlib.nullcontext():
                losses = individual_loss_fn(model(x), y)
                loss = losses.sum() / len(inputs)
                tracked.micro_batch(individual_losses=losses, loss=loss)
                loss.backward()
    opt.step()


def train(config, rank=0, rank_sizes=None, out=None):
    """Train ``config["steps"]`` steps; rank ``rank`` of ``len(rank_sizes)`` takes its slice.

    config keys: model, quantities (a QUANTITY_SETS key), steps, route, optimizer, micro_batches
    (each step accumulated over that many micro-batches of the rank's slice), sync
    ("ddp": DistributedDataParallel; "manual": the test all-reduces gradients itself),
    fail_on_rank (raise there at step 1), quantities_on_rank1 (another set on rank 1),
    model_on_rank1 (another model on rank 1, with the same input shape),
    step_offset_on_rank1 (rank 1 hands the cockpit global_step + offset),
    log_all_ranks, plot (save the dashboard too), branch_samples (how many of the global batch's
    first samples take the "branch" model's branch), max_kept_bytes (the cockpit's),
    restored_after (a new cockpit goes on from that step, restored from the state of this rank,
    or of rank 0 with rank0_state), cockpit_on_rank0_only (the others train untracked),
    late_rank1_seconds (rank 1 sleeps that long before its first step); run_group's processes
    also take first_meeting_seconds (the cockpit's FIRST_MEETING_SECONDS) and
    collective_timeout_on_rank0 (rank 0's process group timeout), plain_average (DDP averages
    unequal batches' mean gradients as it does unless told otherwise). Logs and plots go to ``out``, a folder of this rank's own.
    """
    rank_sizes = rank_sizes or [config["batch_size"]]
    distributed = len(rank_sizes) > 1
    global_n, local_n = sum(rank_sizes), rank_sizes[rank]
    start = sum(rank_sizes[:rank])
    torch.manual_seed(0)
    model, input_shape = build_model(config["model_on_rank1"] if distributed and rank == 1 and "model_on_rank1" in config else config["model"])
    model = extend(model)
    params = list(model.parameters())
    if distributed and config.get("sync", "ddp") == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters="branch_samples" in config)
        if len(set(rank_sizes)) > 1 and not config.get("plain_average"):
            model.register_comm_hook(local_n / global_n, weighted_allreduce)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    if config.get("optimizer", "sgd") == "sgd":
        opt = torch.optim.SGD(params, lr=0.1)
    else:
        opt = torch.optim.Adam(params, lr=0.01)
    names = config["quantities"]
    if distributed and rank == 1 and "quantities_on_rank1" in config:
        names = config["quantities_on_rank1"]
    make_cockpit = lambda: Cockpit(  # noqa: E731
        params,
        quantities=QUANTITY_SETS[names](),
        per_sample_route=config.get("route", "auto"),
        log_all_ranks=config.get("log_all_ranks", False),
        max_kept_bytes=config.get("max_kept_bytes"),
        logpath=str(Path(out) / "streamed") if config.get("stream") and out is not None else None,
    )
    cockpit = make_cockpit() if not (config.get("cockpit_on_rank0_only") and rank > 0) else None

    def all_reduce_gradients():  # the global batch's mean gradient, each rank weighted by N_r / N
        for p in params:
            p.grad = p.grad.detach() * (local_n / global_n)
            dist.all_reduce(p.grad)

    sync = all_reduce_gradients if distributed and config.get("sync") == "manual" else None

    data = torch.Generator().manual_seed(1)
    for step in range(config["steps"]):
        if config.get("fail_on_rank") == rank and step == 1:
            raise RuntimeError(f"rank {rank} fails on purpose")
        if step == 0 and rank == 1:
            time.sleep(config.get("late_rank1_seconds", 0))
        inputs = torch.randn(global_n, *input_shape, generator=data)
        if "branch_samples" in config:  # the first ones take the "branch" model's branch, the rest not
            inputs[:, 0] = inputs[:, 0].abs() * torch.where(torch.arange(global_n) < config["branch_samples"], 1.0, -1.0)
        inputs = inputs[start : start + local_n]
        labels = torch.randint(0, 4, (global_n,), generator=data)[start : start + local_n]
        if step == config.get("restored_after"):
            cockpit = restored(cockpit, make_cockpit, config.get("rank0_state", False))
        tracked = step + (config.get("step_offset_on_rank1", 0) if rank == 1 else 0)
        batch = inputs, labels
        if config.get("micro_batches"):
            accumulated_step(model, opt, cockpit, tracked, batch, individual_loss_fn, config["micro_batches"])
        else:
            training_step(
                model, opt, batch, individual_loss_fn, loss_fn=loss_fn, cockpit=cockpit, step=tracked, after_backward=sync
            )
    written = []
    if out is not None:
        logpath = str(Path(out) / "log")
        cockpit.write(logpath)
        if config.get("plot"):
            from cockpit_fast.plotter import CockpitPlotter

            CockpitPlotter().plot(cockpit, show_plot=False, save_plot=True, savedir=out)
        written = sorted(path.name for path in Path(out).iterdir())
    return {"output": _plain(cockpit.get_output()), "written": written}


def restored(cockpit, make_cockpit, rank0_state=False, state_file=None):
    """A new cockpit (``make_cockpit()``) restored from ``cockpit``'s state as a checkpoint file
    holds it, or (``rank0_state``) from rank 0's in every process, or from ``state_file``."""
    saved = io.BytesIO()
    torch.save(cockpit.state_dict(), saved)
    state = torch.load(state_file or io.BytesIO(saved.getvalue()), weights_only=True)
    if rank0_state:
        shared = [state]
        dist.broadcast_object_list(shared, src=0)
        state = shared[0]
    fresh = make_cockpit()
    fresh.load_state_dict(state)
    return fresh


def collect_rows(rank=0, rank_sizes=(6,)):
    """gradient-metrics rows of a DDP-wrapped MLP's samples (this rank's slice of the batch),
    with the warnings the collector gave."""
    from cockpit_fast.gradient_metrics import GradientMetricCollector
    from cockpit_fast.gradient_metrics.metrics import Max, MeanStd, PNorm

    torch.manual_seed(0)
    model, input_shape = build_model("mlp")
    collector = GradientMetricCollector([Max(model), MeanStd(model[0]), PNorm(model, p=2)])
    if len(rank_sizes) > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    global_n, start = sum(rank_sizes), sum(rank_sizes[:rank])
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(global_n, *input_shape, generator=data)[start : start + rank_sizes[rank]]
    labels = torch.randint(0, 4, (global_n,), generator=data)[start : start + rank_sizes[rank]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = collector(torch.nn.functional.cross_entropy(model(inputs), labels, reduction="none"))
    return {"rows": rows.detach(), "warnings": [str(w.message) for w in caught]}


def comparable(output):
    """``output`` without the ``Time`` quantity (its values differ between runs), ``Alpha`` as a
    float: a fit within rounding of a line gives α = -1 (an int, as Cockpit's concave fits) or
    -1 + 1e-13 (a float) by the sign of its rounding; α is continuous there."""
    return {
        step: {k: float(v) if k == "Alpha" and v is not None else v for k, v in values.items() if k != "Time"}
        for step, values in output.items()
    }


def _plain(output):
    return {step: dict(values) for step, values in output.items()}


def _rank_main(rank, rank_sizes, config, workdir):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=len(rank_sizes),
        timeout=datetime.timedelta(seconds=config.get("collective_timeout_on_rank0", 60)) if rank == 0 else COLLECTIVE_TIMEOUT,
    )
    cockpit_fast.distributed.FIRST_MEETING_SECONDS = config.get("first_meeting_seconds", 300)
    try:
        if config.get("job") == "collect":
            result = collect_rows(rank, rank_sizes)
        elif config.get("job") in ("fsdp", "fsdp_routed", "fsdp_collect", "fsdp_refusals", "fsdp_each", "fsdp_rank0", "fsdp_meshes"):
            import fsdp_training

            job = {
                "fsdp": fsdp_training.train, "fsdp_routed": fsdp_training.train_routed,
                "fsdp_collect": fsdp_training.collect_rows, "fsdp_refusals": fsdp_training.refusals,
                "fsdp_each": fsdp_training.foreach_over_a_mix, "fsdp_rank0": fsdp_training.cockpit_on_rank0_only,
                "fsdp_meshes": fsdp_training.norms_over_two_meshes,
            }
            result = job[config["job"]](config, rank, rank_sizes)
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = train(config, rank, rank_sizes, out=workdir / f"logs{rank}")
            result["warnings"] = [str(w.message) for w in caught]
        torch.save(result, workdir / f"rank{rank}.pt")
        dist.barrier()  # gloo aborts if a group is torn down while a peer still uses it
    except BaseException:
        # Peers of a failing rank fail too, and spawn reports whichever it sees first: keep each.
        (workdir / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        leave_process_group()


def leave_process_group():
    """Ends a ``torchrun`` script's process group, its gloo threads joined before the interpreter
    exits. The trainers' DDP wrappers, in reference cycles, hold the group: destroyed with them
    still alive, its threads were left to the interpreter's exit, which aborted about 1 run in
    25 ("terminate called without an active exception", in no Python frame)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_group(rank_sizes, config, workdir):
    """Train in ``len(rank_sizes)`` spawned processes; every rank's result, in rank order.

    A rank that raises ends every other rank (torch.multiprocessing terminates them) and an
    error is raised here; each failed rank's traceback is in ``workdir/error<rank>.txt``.
    """
    workdir = Path(workdir)
    for rank in range(len(rank_sizes)):
        (workdir / f"logs{rank}").mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_main, args=(rank_sizes, config, workdir), nprocs=len(rank_sizes), join=True)
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(len(rank_sizes))]


def torchrun_and_one(script, out):
    """Runs ``script out`` in the 2 processes of a ``torchrun`` (:func:`torchrun`), then
    ``script out --one`` in one process (a test helper script saving each one's output under
    ``out``); returns their stderr, and fails with its tail where one fails."""
    return [torchrun(script, out), _run([sys.executable, str(script), str(out), "--one"], out)]


def torchrun(script, out, *flags):
    """Runs ``script out *flags`` in the 2 processes of a ``torchrun`` (gloo on loopback); returns
    its stderr, and fails with its tail where it fails."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}"]
    return _run(launch + [str(script), str(out), *flags], out)


def _run(command, out):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=out)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def assert_resumed_as_whole(out, rel=lambda name: 1e-10):
    """Each rank's ``out/resume_rank<r>.pt`` (``{"whole": output, "resumed": output}``, 4 steps,
    the resumed run from a checkpoint after step 2): every value the same within ``rel(name)``,
    steps 0 and 1 too (carried over; Alpha and UpdateSize of step 1 finished after the resume)."""
    for rank in range(2):
        runs = torch.load(Path(out) / f"resume_rank{rank}.pt", weights_only=False)
        whole, resumed = runs["whole"], runs["resumed"]
        assert sorted(resumed) == sorted(whole) == [0, 1, 2, 3]
        assert "Alpha" in whole[2] and "UpdateSize" in whole[2]
        for step in whole:
            assert sorted(resumed[step]) == sorted(whole[step]), (rank, step)
            for name in whole[step]:
                assert resumed[step][name] == pytest.approx(whole[step][name], rel=rel(name), abs=1e-14), (rank, step, name)
