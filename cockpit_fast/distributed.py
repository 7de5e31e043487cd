"""Statistics of the global batch when training runs in several processes (``torch.distributed``).

Each rank's backward pass sees its own samples only: BackPACK's ``grad_batch`` there is
``∇ℓ_n / N_r`` with ``N_r`` the rank's batch size, and its statistics, loss and gradient are
those of its shard. :func:`reduce_step` turns them into those of the global batch (the
concatenation of every rank's samples, ``N = sum_r N_r``) before any quantity reads them, so
every quantity equals that of one process on the concatenated batch, whatever the batch size of
each rank. A step's reductions travel in six collectives (seven with histograms: see 2), each
over one flat buffer:

0. ``all_gather`` of the number and shapes of the tracked parameters (checked to agree), then of
   which of them each rank's backward passes reached and whether it dropped what it kept
   (:func:`agreed_by_ranks`): a rank whose samples did not use a parameter (a branch, an expert
   none of its tokens chose) gives its samples' zero gradients for it, as one backward pass over
   the global batch counts them;
1. ``all_gather`` of each rank's batch size and buffer layout (checked to agree);
2. ``all_reduce(SUM)`` of everything that adds up: the gradient sum ``sum_n ∇ℓ_n``, summed
   statistics back in units of ``∇ℓ_n`` (sums of squared gradients), the loss times ``N_r``,
   diagonal curvatures times ``N_r``; histogram counts in a second, int64 buffer, so that they
   stay exact (float32 holds counts only up to 2^24);
3. ``all_gather`` of per-sample values (squared norms, projections, individual losses), taken to
   the global batch's units first and concatenated in rank order;
4. ``all_reduce(MAX)`` of the abs-maxima that bin adaptation asks for.

Statistics that read the mini-batch gradient (dot products with it, plain SGD's update in Alpha)
are computed between 2 and 3, from the per-sample gradients the hook kept for them. The batch
sizes of 1 are read on the host (they lay out 3): on a GPU the one synchronisation of the step.

The gradient is this rank's own, captured by a tensor hook as the backward pass produces it, not
``param.grad``, which DistributedDataParallel overwrites with the plain average over ranks (not
the global mean when batch sizes differ). A step that reduces therefore communicates one more
gradient-sized buffer than DistributedDataParallel does (see ``benchmarks/bench_distributed.py``).
"""

import datetime
import os
import warnings
import zlib
from collections import Counter

import torch
import torch.distributed as dist

from cockpit_fast.per_sample.capture import OBSERVES_THE_STEP, in_own_pass

_NOT_THE_SAME = (
    "the processes track different quantities or parameters at this step, or different steps: "
    "every rank must track the same, with the same global_step"
)


FIRST_MEETING_SECONDS = 300.0
"""After how long a cockpit waiting for the cockpits of the other processes before its first
exchange (:func:`meet`) warns which have not come; it waits on up to the process group's timeout."""

_meetings = Counter()  # group's global ranks -> this process's meetings with that group so far


def meet(group, layout, global_step):
    """Waits until every process of ``group`` has come here as often as this one: before a
    cockpit's first exchange (the k-th call of a process meets the k-th call of every other).

    The processes meet through the default process group's store, not a collective: a process
    that never comes (its cockpit never made, or its ``with cockpit(...)`` skipped) leaves no
    collective pending, and this process says which: a warning after
    :data:`FIRST_MEETING_SECONDS` (a process may only be late), an error at the group's
    timeout (gloo's default: 30 minutes), where a collective would have failed with a
    transport error.

    Raises:
        RuntimeError: If some process has not come within the group's timeout.
        ValueError: On every process, if their cockpits' ``layout`` (what each tracks)
            differs.
    """
    ranks = dist.get_process_group_ranks(group)
    _meetings[tuple(ranks)] += 1
    # (The elastic agent's store keeps its keys when it restarts the processes: each attempt its own.)
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"
    key = f"cockpit_fast/meeting/{attempt}/{'-'.join(map(str, ranks))}/{_meetings[tuple(ranks)]}"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{dist.get_rank()}", str(_checksum(layout)))
    if store.add(key, 1) == len(ranks):
        store.set(f"{key}/all", "")
    limit = _timeout(group)
    said = min(datetime.timedelta(seconds=FIRST_MEETING_SECONDS), limit)

    def missing(waited):
        late = [rank for rank in ranks if not store.check([f"{key}/{rank}"])]
        return (
            f"[Step {global_step}] the cockpit has waited {waited.total_seconds():g} s before its first exchange for the "
            f"cockpits of processes {late} (global ranks), which have not come: under torch.distributed every process "
            "of the group makes the cockpit and enters `with cockpit(global_step, ...)` at the same steps (not rank 0 "
            "alone: the log is written by rank 0 only anyway)"
        )

    try:
        store.wait([f"{key}/all"], said)
    except RuntimeError:  # (DistStoreError is one)
        if said == limit:
            raise RuntimeError(missing(limit)) from None
        warnings.warn(f"{missing(said)}; waiting on up to the group's timeout", RuntimeWarning, stacklevel=3)
        try:
            store.wait([f"{key}/all"], limit - said)
        except RuntimeError:
            raise RuntimeError(missing(limit)) from None
    if len({store.get(f"{key}/{rank}") for rank in ranks}) != 1:
        raise ValueError(_NOT_THE_SAME)


def _timeout(group):
    """The timeout of ``group``'s collectives (as ``init_process_group`` or ``new_group`` set it;
    torch's default where its backend does not tell)."""
    for device in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return dist.default_pg_timeout


def resolve_group(process_group):
    """The group to reduce over: ``process_group``, else the world group when ``torch.distributed``
    is initialised; None when there is no other process to reduce with."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    return process_group if dist.get_world_size(process_group) > 1 else None


def is_writer(process_group, all_ranks=False):
    """Whether this process writes logs and plots: rank 0 of the group only, unless ``all_ranks``."""
    return all_ranks or process_group is None or dist.get_rank(process_group) == 0


class GradientCapture:
    """Keeps this rank's gradient of every tracked parameter from the backward passes of a step.

    Tensor hooks see the gradient before it is accumulated into ``param.grad`` (where
    DistributedDataParallel averages it in place, and a trainer clips it), so the copy is the
    rank's own. Backward passes since the last :meth:`take` add up.

    Args:
        params (list[torch.Tensor]): The tracked parameters.
        keep_graph (bool): Keep the gradient's graph (for Hessian-vector products).
        copy (bool): Keep a copy (DistributedDataParallel changes the gradient in place), not
            the tensor autograd hands on. Defaults to ``True``.
        unsharded (cockpit_fast.fsdp.Unsharded, optional): Where FSDP2 shards the parameters,
            the tensors the graph holds for them: their gradients, full-size, are the rank's.
        on_grad (callable, optional): Told ``(index, gradient)`` as each parameter's gradient
            arrives, the first time since :meth:`take`.
    """

    def __init__(self, params, keep_graph, copy=True, unsharded=None, on_grad=None):
        self.grads = {}
        self._versions = {}  # index -> the version of its kept gradient when kept
        self.on_grad = on_grad  # on_grad(index, gradient), at each parameter's first gradient since take()
        self._tasks = set()  # the backward passes (autograd graph tasks) that reached a parameter
        self._params, self._unsharded = params, unsharded
        self._keepers = [self._keeper(i, keep_graph, copy, p.dtype) for i, p in enumerate(params)]
        self._handles = []
        self.attach()

    def attach(self):
        """Keep the gradients of the backward passes from now on (again, after :meth:`remove`).
        FSDP2's unsharded tensors that no forward pass has made yet (a step entered before the
        run's first forward pass) are hooked after the forward pass that makes them."""
        if self._unsharded is not None:
            self._unsharded.refresh()
        waiting = [i for i in range(len(self._params)) if not self._hook(i)]
        if not waiting:
            return

        def hook_made(module, *_):  # after each FSDP2 module's forward pass, its own
            if self._unsharded.read(module):
                waiting[:] = [i for i in waiting if not self._hook(i)]
            if not waiting:
                handle.remove()

        handle = torch.nn.modules.module.register_module_forward_hook(hook_made)
        self._handles.append(handle)

    def _hook(self, index):
        """Hooks parameter ``index``'s gradient; False where its tensor is not made yet."""
        param = self._params[index]
        in_graph = param if self._unsharded is None else self._unsharded.made(param, refresh=False)
        if in_graph is None:
            return False
        self._handles.append(in_graph.register_hook(self._keepers[index]))
        return True

    @property
    def passes(self):
        """How many backward passes reached a tracked parameter since the last :meth:`take`."""
        return len(self._tasks)

    def _keeper(self, index, keep_graph, copy, dtype):
        def keep(grad):
            if in_own_pass():  # (another cockpit's engine's: its whole graph, say)
                return
            self._tasks.add(torch._C._current_graph_task_id())
            if grad.dtype != dtype:  # FSDP2's bf16 compute: in the parameter's dtype, as FSDP2 reduces it
                grad = grad.to(dtype)
            kept = grad if keep_graph else grad.detach().clone() if copy else grad.detach()
            first = index not in self.grads
            self.grads[index] = kept if first else self.grads[index] + kept
            self._versions[index] = self.grads[index]._version
            if first and self.on_grad is not None:
                self.on_grad(index, kept.detach())

        setattr(keep, OBSERVES_THE_STEP, True)  # not a hook each sample's gradient passes
        return keep

    def take(self):
        """The gradients of the backward passes since the last call (``{index: gradient}``) and
        how many passes there were; the next passes start anew."""
        grads, passes = self.grads, self.passes
        self.grads, self._tasks = {}, set()
        return grads, passes

    def changed_in_place(self):
        """Indices of the kept gradients changed in place since they were kept: not copied, the
        tensor autograd hands on became ``param.grad``, which the caller then changed (clipped,
        unscaled by a ``GradScaler``) before :meth:`take`."""
        return [index for index, grad in self.grads.items() if grad._version != self._versions[index]]

    def remove(self):
        """Remove the hooks (the per-sample engine's own backward passes are none of the step's)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def reduce_step(ctx, curvature_names=()):
    """The global batch's step from ``ctx`` (a :class:`~cockpit_fast.statistics.StepContext`
    with a ``group``), a new context.

    Args:
        ctx: The step; its ``local_grads`` hold this rank's gradients.
        curvature_names (iterable[str]): BackPACK savefields of diagonal curvatures this step
            computed (``diag_h``, ...), combined as means over the global batch.

    Raises:
        ValueError: If this rank's batch size is unknown, two statistics cannot be told apart
            across processes, or the ranks' steps do not match (checked before any buffer is
            exchanged).

    Returns:
        StepContext: The global batch's statistics, gradient, curvatures and ``info``.
    """
    group, params = ctx.group, ctx.params
    local_n = _local_batch_size(ctx)
    statistics = _in_agreed_order(ctx.requests)
    curvature_names = [name for name in curvature_names if all(hasattr(p, name) for p in params)]
    has_loss, has_losses = ctx.has_info("loss"), ctx.has_info("individual_losses")
    results = ctx.results()

    # 1. Batch sizes, and a checksum of the step and of the layout every buffer below has: ranks
    # that track different things, or different steps, would otherwise exchange misaligned numbers.
    layout = [
        ctx.global_step,
        [(repr(s), sorted(results.get(s, {}))) for s in statistics],
        curvature_names,
        [tuple(p.shape) for p in params],
        has_loss,
        has_losses,
    ]
    sizes = [n for n, in _gathered_alike(layout, [local_n], group, params[0].device)]
    global_n = sum(sizes)
    info = {}  # the global batch's entries

    def values_of(reduction):
        return [(s, i) for s in statistics if s.reduction == reduction for i in sorted(results.get(s, {}))]

    # 2. Sums, in units of the individual gradients ∇ℓ_n: rank batch sizes cancel.
    summed = values_of("sum")
    parts = []
    for index, p in enumerate(params):
        grad = ctx.local_grads.get(index)  # None: the parameter got no gradient on this rank
        parts.append(local_n * (grad.detach() if grad is not None else torch.zeros(p.shape, dtype=p.dtype, device=p.device)))
    parts += [local_n**s.sample_power * results[s][i] for s, i in summed]
    parts += [local_n * getattr(p, name).detach() for name in curvature_names for p in params]
    if has_loss:
        parts.append(local_n * ctx.loss(_REDUCTION))
    totals = iter(_all_sum(parts, group))
    grads = [next(totals) / global_n for _ in params]
    for s, i in summed:
        total = next(totals)
        results[s][i] = total / global_n**s.sample_power if s.sample_power else total  # counts stay int64
    curvatures = {name: [next(totals) / global_n for _ in params] for name in curvature_names}
    if has_loss:
        info["loss"] = next(totals) / global_n

    # Statistics that read the mini-batch gradient, now that it is the global one.
    if ctx.waiting is not None:
        for statistic, index, value in ctx.waiting.later(grads):
            results.setdefault(statistic, {})[index] = value

    # 3. Per-sample values in the global batch's units, concatenated in rank order.
    per_sample = values_of("per_sample")
    pieces = [s.global_factor(local_n, global_n) * results[s][i] for s, i in per_sample]
    lengths = [s.rank_lengths(sizes) for s, _ in per_sample]
    if has_losses:
        pieces.append(ctx.info("individual_losses", _REDUCTION).detach().reshape(-1))
        lengths.append(sizes)
    if pieces:
        gathered = iter(_gather_per_sample(pieces, lengths, group))
        for s, i in per_sample:
            results[s][i] = next(gathered)
        if has_losses:
            info["individual_losses"] = next(gathered)

    # 4. Maxima.
    maxima = values_of("max")
    if maxima:
        largest = iter(_all_reduce([results[s][i].reshape(1) for s, i in maxima], dist.ReduceOp.MAX, group))
        for s, i in maxima:
            results[s][i] = next(largest)
    info["batch_size"] = global_n
    return ctx.reduced(
        results=results, grads=grads, curvatures=curvatures, info=ctx.info_with(**info), waiting=None,
        rank_sizes=sizes, rank_share=local_n / global_n,
    )


def _in_agreed_order(statistics):
    """``statistics`` in an order every process computes alike (by name).

    Raises:
        ValueError: If two statistics share a name (two quantities of one kind projecting on
            their own directions), so that no order could be agreed on.
    """
    ordered = sorted(statistics, key=repr)
    names = [repr(s) for s in ordered]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise ValueError(f"statistics {clashes} of several quantities of one kind cannot be combined across processes")
    return ordered


def global_mean(tensors, ctx):
    """Means over the global batch of per-rank means ``tensors`` (e.g. Hessian-vector products of
    each rank's loss): ``sum_r (N_r / N) tensors_r``, one collective. Unchanged without a group."""
    if ctx.group is None:
        return list(tensors)
    parts = [ctx.rank_share * t for t in tensors]
    return _unflatten(_all_reduce(parts, dist.ReduceOp.SUM, ctx.group), parts)


def same_everywhere(tensors, group):
    """``tensors`` as rank 0 of ``group`` has them (e.g. a random start), one collective."""
    if group is None:
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
    return _unflatten(flat, tensors)


class _Reduction:
    """Stands for the reduction where ``ctx.info`` asks who needs an entry."""


_REDUCTION = _Reduction()


def _local_batch_size(ctx):
    """This rank's batch size: as the hook saw it, else ``info['batch_size']``, else the length
    of ``info['individual_losses']``."""
    if ctx.local_batch_size is not None:
        return int(ctx.local_batch_size)
    given = ctx.given_batch_size()
    if given is not None:
        return given
    raise ValueError(
        "Under torch.distributed the cockpit weighs each process by its batch size: hand it in via "
        "cockpit(..., info={'batch_size': ...})"
    )


def agreed_by_ranks(reached, complete, dropped, params, group):
    """What the ranks' backward passes make of the step, alike on every rank: ``(anywhere,
    everywhere, dropped)``, the indices of ``params`` that some rank's backward passes reached,
    those that every backward pass of every rank reached, and whether some rank dropped the forms
    it kept for the step's end (past ``max_kept_bytes``: then every rank skips what waited for
    them). ``reached``, ``complete``, ``dropped``: this rank's own.

    Raises:
        ValueError: On every rank, if the ranks track different parameters (checked first: the
            flags' buffers must have one size everywhere).
    """
    _gathered_alike([tuple(p.shape) for p in params], [], group, params[0].device)
    mine = torch.zeros(2, len(params) + 1, dtype=torch.int32, device=params[0].device)
    mine[0, sorted(reached)] = 1
    mine[1, sorted(complete)] = 1
    mine[0, -1] = int(dropped)
    every = _all_gather(mine, group)
    anywhere, everywhere = every[:, 0].amax(0), every[:, 1, :-1].amin(0)
    return set(anywhere[:-1].nonzero().flatten().tolist()), set(everywhere.nonzero().flatten().tolist()), bool(anywhere[-1])


def _gathered_alike(layout, values, group, device):
    """``values`` (integers) of every rank, in rank order, from ranks whose ``layout`` (what the
    buffers exchanged next are laid out by) is alike: its checksum travels with them.

    Raises:
        ValueError: On every rank, if some rank's layout differs (misaligned buffers are never
            exchanged).
    """
    mine = torch.tensor([*values, _checksum(layout)], dtype=torch.int64, device=device)
    every = _all_gather(mine, group).tolist()
    if len({row[-1] for row in every}) != 1:
        raise ValueError(_NOT_THE_SAME)
    return [row[:-1] for row in every]


def _checksum(layout):
    """A number alike on every process whose ``layout`` (plain values) is alike."""
    return zlib.crc32(repr(layout).encode())


def _all_gather(tensor, group):
    """``tensor`` of every rank, stacked in rank order."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return torch.stack(out)


def _all_reduce(parts, op, group):
    """``parts`` reduced with ``op`` over the group, as one flat buffer; returns the flat result."""
    dtype = _buffer_dtype(parts)
    flat = torch.cat([p.detach().reshape(-1).to(dtype) for p in parts])
    dist.all_reduce(flat, op=op, group=group)
    return flat


def _all_sum(parts, group):
    """``parts`` summed over the group, shaped and typed like them. Integer parts (histogram
    counts) travel in their own int64 buffer, exact at any count; the rest in one float buffer."""
    out = [None] * len(parts)
    for integer in (False, True):
        indices = [k for k, p in enumerate(parts) if p.is_floating_point() != integer]
        if indices:
            chosen = [parts[k] for k in indices]
            for k, total in zip(indices, _unflatten(_all_reduce(chosen, dist.ReduceOp.SUM, group), chosen)):
                out[k] = total
    return out


def _unflatten(flat, parts):
    """Split ``flat`` back into tensors shaped and typed like ``parts``."""
    out, offset = [], 0
    for p in parts:
        out.append(flat[offset : offset + p.numel()].reshape(p.shape).to(p.dtype))
        offset += p.numel()
    return out


def _gather_per_sample(pieces, lengths, group):
    """Each piece (one value per local sample; ``lengths[k][r]`` of them on rank r)
    concatenated over ranks in rank order."""
    dtype = _buffer_dtype(pieces)
    local = torch.cat([p.detach().reshape(-1).to(dtype) for p in pieces])
    totals = [sum(piece[r] for piece in lengths) for r in range(len(lengths[0]))]
    padded = torch.zeros(max(totals), dtype=dtype, device=local.device)
    padded[: local.numel()] = local
    rows = _all_gather(padded, group)
    starts = [0] * len(totals)  # where each rank's row holds the next piece
    out = []
    for piece, piece_lengths in zip(pieces, lengths):
        parts = [rows[r, starts[r] : starts[r] + n] for r, n in enumerate(piece_lengths)]
        starts = [start + n for start, n in zip(starts, piece_lengths)]
        out.append(torch.cat(parts).to(piece.dtype))
    return out


def _buffer_dtype(parts):
    """int64 for integer parts only (counts), else float64 if any part is, else float32."""
    if not any(p.is_floating_point() for p in parts):
        return torch.int64
    return torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
