"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the tensors a tracked parameter is computed with.

A parameter FSDP2 shards is a ``DTensor`` holding this rank's shard. Forward and backward passes
compute with another tensor: the unsharded parameter FSDP2 all-gathers into (one object per
parameter for the whole run, its storage freed between uses), which FSDP2 sets on the module
while it runs; its gradient, this rank's own and full-size, is reduce-scattered into the shard's
``.grad``. :class:`Unsharded` maps each tracked parameter to the tensor in the graph and back,
so that the capture, the engine and the gradient hooks see the calls and gradients of the
tracked parameters. :meth:`Unsharded.engine_passes` keeps FSDP2's hooks out of the per-sample
engine's own backward passes. FSDP1 (``FullyShardedDataParallel``) is refused (:func:`refuse_fsdp1`).
"""

import contextlib
import math

import torch
import torch.distributed as dist

try:
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # a torch without torch.distributed
    DTensor = FSDPState = distribute_tensor = None
    _module_state_mapping = {}


def is_sharded(tensor):
    """Whether ``tensor`` is a ``DTensor`` (a shard of FSDP2's, or any distributed tensor)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def sharded_as(tensor, param):
    """``tensor``, a full value of ``param``'s shape, sharded as ``param`` is: this process's part
    as a ``DTensor``, split here with no communication. Unchanged where ``param`` is not sharded
    or ``tensor`` already is."""
    if is_sharded(param) and not is_sharded(tensor):
        return distribute_tensor(tensor, param.device_mesh, param.placements, src_data_rank=None)
    return tensor


def local_part(tensor, param):
    """This process's part of ``tensor``, a value of ``param``'s shape, as a plain tensor: a
    DTensor's local tensor; of a full value where FSDP2 shards ``param``, its shard (split here,
    as DTensor splits: ``torch.chunk`` along dimension 0 on a 1-D mesh); else ``tensor``."""
    if is_sharded(tensor):
        return tensor.to_local()
    if not is_sharded(param):
        return tensor
    if not _sharded_on_one_dim(param):
        return sharded_as(tensor, param).to_local()
    chunks, rank = torch.chunk(tensor, param.device_mesh.size(), dim=0), param.device_mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else tensor[:0]


def summed_squares(groups, params):
    """Of each list in ``groups`` (one :func:`local_part` per parameter of ``params``), the sum of
    the squared ℓ₂ norms of the whole tensors (float64), without a DTensor op a tensor (0.05 ms
    each on the CPU, a step's worth for a model of many tensors)."""
    squares = torch.stack([torch.stack(torch._foreach_norm(list(group), 2, dtype=torch.float64)).square() for group in groups])
    return _over_processes(squares, params, lambda g, k: groups[g][k]).sum(1)


def _over_processes(squares, params, part):
    """``squares`` ``(G, K)``, squared norms of this process's parts ``part(g, k)`` of ``G``
    values of each of the ``K`` ``params``, made those of the whole values: the parts of FSDP2's
    shards summed over their processes, one collective for every set of processes; other
    placements (HSDP's) one collective a value."""
    by_ranks = {}
    for k, p in enumerate(params):
        if not is_sharded(p):
            continue
        if _sharded_on_one_dim(p):
            group = p.device_mesh.get_group()
            by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), (group, []))[1].append(k)
            continue
        for g in range(len(squares)):
            whole = DTensor.from_local(part(g, k), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            squares[g, k] = full(torch.linalg.vector_norm(whole, dtype=torch.float64)).square()
    for group, columns in by_ranks.values():  # in the parameters' order: the same on every process
        summed = squares[:, columns]
        dist.all_reduce(summed, group=group)
        squares[:, columns] = summed
    return squares


def reduction_dtypes(params):
    """``{id(param): dtype}`` of those of ``params`` that FSDP2 shards: the dtype its gradients
    are reduced in (its ``MixedPrecisionPolicy``'s ``reduce_dtype``, else the dtype it computes
    in), whose rounding the sharded gradient carries. Reads FSDP2's private state (torch 2.13)."""
    wanted, found = {id(p) for p in params if is_sharded(p)}, {}
    for state_ref in list(_module_state_mapping.values()) if wanted else []:
        state = state_ref()
        for group in state._fsdp_param_groups if isinstance(state, FSDPState) else []:
            for fsdp_param in group.fsdp_params:
                if id(fsdp_param.sharded_param) in wanted:
                    dtype = fsdp_param.reduce_dtype or fsdp_param.param_dtype or fsdp_param.orig_dtype
                    found[id(fsdp_param.sharded_param)] = dtype
    return found


def each(foreach_op, tensors, *others):
    """``foreach_op`` (a ``torch._foreach_*`` function) over ``tensors`` and the lists ``others``
    (tensors or scalars, one per tensor): one call, not a launch per tensor; where FSDP2's shards
    stand beside plain tensors, whose mix DTensor's foreach ops refuse, one call per tensor."""
    tensors = list(tensors)
    if len({is_sharded(t) for t in tensors}) <= 1:
        return list(foreach_op(tensors, *others)) if tensors else []
    return [foreach_op([t], *([other[i]] for other in others))[0] for i, t in enumerate(tensors)]


def refuse_fsdp1(params):
    """Raises a ValueError if ``params`` are FSDP1's flat parameters, or parameters it flattened
    into one (``use_orig_params=True`` keeps them as views; a model wrapped after the cockpit
    was made leaves the cockpit's in the flat one)."""
    # (FlatParameter's own isinstance test; the mark FSDP1 puts on each parameter it flattens)
    if any(getattr(p, "_is_flat_param", False) or getattr(p, "_fsdp_flattened", False) for p in params):
        raise ValueError(
            "the parameters are FullyShardedDataParallel's (FSDP1): it flattens every layer's values into one "
            "tensor: the cockpit supports sharded training with FSDP2 (torch.distributed.fsdp.fully_shard); make "
            "the cockpit from model.parameters() of a model sharded with fully_shard"
        )


class Unsharded:
    """The unsharded tensor each tracked FSDP2 parameter is computed with, and back.

    Args:
        params (list[torch.Tensor]): The tracked parameters; none sharded: every lookup is the
            identity at no cost.
    """

    def __init__(self, params):
        self._tracked = {id(p): p for p in params if is_sharded(p)}
        self._to_graph = {}  # id(tracked shard) -> unsharded tensor
        self._to_tracked = {}  # id(unsharded tensor) -> tracked shard
        self._in_engine_passes = False

    @property
    def active(self):
        """Whether some tracked parameter is sharded."""
        return bool(self._tracked)

    def in_graph(self, param):
        """The tensor the graph holds for tracked ``param``: the unsharded one under FSDP2.

        Raises:
            ValueError: If ``param`` is sharded but no FSDP2 module manages it, or its module has
                not run a forward pass yet.
        """
        made = self.made(param)
        if made is None:
            raise ValueError(
                f"a tracked parameter of shape {tuple(param.shape)} is a DTensor that no fully_shard-ed module's "
                "forward pass has unsharded yet: the cockpit tracks sharded parameters of FSDP2 (fully_shard) after "
                "the forward pass of the step"
            )
        return made

    def made(self, param, refresh=True):
        """:meth:`in_graph`, or None where FSDP2 has not made that tensor yet (before the first
        forward pass of ``param``'s module); ``refresh``: read every FSDP2 state where not known."""
        if id(param) not in self._tracked:
            return param
        if id(param) not in self._to_graph and refresh:
            self.refresh()
        return self._to_graph.get(id(param))

    def read(self, module):
        """Reads the unsharded tensors of ``module``'s own FSDP2 parameters (its forward pass
        makes them); False where it is no FSDP2 module."""
        state_ref = _module_state_mapping.get(module)
        state = None if state_ref is None else state_ref()
        if not isinstance(state, FSDPState):
            return False
        self._read(state)
        return True

    def tracked(self, tensor):
        """The tracked parameter ``tensor`` stands for (itself where it is one); None for a
        tensor no tracked parameter is computed with."""
        if not self._tracked:
            return None
        if id(tensor) not in self._to_tracked:
            self.refresh()
        return self._to_tracked.get(id(tensor))

    def refresh(self):
        """Reads every FSDP2 state's parameters (unsharded tensors exist after the first forward)."""
        if not self._tracked:  # (other models' FSDP2 states are none of its business)
            return
        for state_ref in list(_module_state_mapping.values()):
            state = state_ref()
            if isinstance(state, FSDPState):
                self._read(state)

    @contextlib.contextmanager
    def engine_passes(self, needed, frees_the_graph=False, on_every_rank=False):
        """Around the per-sample engine's own backward passes (not the step's): every FSDP2
        module of the tracked parameters' models unsharded, and FSDP2's hooks in the graph
        doing nothing. Every rank of their meshes enters it at once (it is a collective);
        nested, it does nothing.

        FSDP2's hooks unshard each module a backward pass reaches (an all-gather) and
        reduce-scatter its gradient after. An engine's pass reaches what this rank's samples
        used (not a branch or an expert none of them took), on the steps this rank's engine
        decides (a module's first call): the ranks' collectives would not match (gloo aborts,
        NCCL hangs). So the ranks agree whether any of them runs such passes, and then each
        unshards every module in one order; the passes want gradients with respect to the
        unsharded tensors only, none of FSDP2's reductions. The whole model is unsharded while
        they run.

        Args:
            needed (bool): Whether this rank runs passes of its own.
            frees_the_graph (bool): The passes end the forward pass's graph (no backward pass
                of the user's follows): FSDP2's callback at the end of a backward pass runs after
                each of them, as it would after that one, and forgets the forward pass (else
                kept, that of the user's backward pass, which prefetches by it).
            on_every_rank (bool): Every rank runs passes (the collector's): nothing to agree on.
        """
        if self._in_engine_passes or not self._tracked:
            yield
            return
        meshes = list(dict.fromkeys(p.device_mesh for p in self._tracked.values()))
        if not (on_every_rank or _on_any_rank(needed, meshes)):
            yield
            return
        states = self._states()
        groups = [group for state in states for group in state._fsdp_param_groups]
        sharded = [state for state in states if not all(group.is_unsharded for group in state._fsdp_param_groups)]
        training_states = [state._training_state for state in states]  # (the pre-backward hook sets it)
        contexts = [] if frees_the_graph else list(dict.fromkeys(state._state_ctx for state in states))
        queued = [context.post_backward_final_callback_queued for context in contexts]
        for state in sharded:
            state._modules[0].unshard()
        # No unshard (all is), reduce-scatter or reshard in the passes. (The hooks look these
        # methods up as they run: the instance's hide the class's.)
        for group in groups:
            group.pre_backward = group.post_backward = _do_nothing
        for context in contexts:  # (as if queued already: none is)
            context.post_backward_final_callback_queued = True
        self._in_engine_passes = True
        try:
            yield
        finally:
            self._in_engine_passes = False
            for group in groups:  # (the class's methods again)
                vars(group).pop("pre_backward", None)
                vars(group).pop("post_backward", None)
            for context, was in zip(contexts, queued):
                context.post_backward_final_callback_queued = was
            for state, was in zip(states, training_states):
                state._training_state = was
            for state in sharded:
                state._modules[0].reshard()

    def _states(self):
        """The FSDP2 states of every module of the models that hold tracked parameters (also
        of modules that hold none: the passes run through them), in an order every rank shares:
        that of the fully_shard calls, each model's modules in ``named_modules()`` order."""
        states = []
        for state_ref in list(_module_state_mapping.values()):
            state = state_ref()
            if isinstance(state, FSDPState) and state not in states and any(
                id(fsdp_param.sharded_param) in self._tracked
                for group in state._fsdp_param_groups
                for fsdp_param in group.fsdp_params
            ):
                states.extend(s for s in state._state_ctx.all_states if s not in states)
        return states

    def _read(self, state):
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                shard = self._tracked.get(id(fsdp_param.sharded_param))
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if shard is not None and unsharded is not None:
                    self._to_graph[id(shard)] = unsharded
                    self._to_tracked[id(unsharded)] = shard


def _do_nothing(*_):
    pass


def _on_any_rank(flag, meshes):
    """Whether ``flag`` holds on any rank of ``meshes`` (one all-reduce per mesh dimension,
    which every rank of them joins)."""
    flag = torch.tensor([int(flag)])
    for mesh in meshes:
        flag = flag.to(mesh.device_type)
        for group in mesh.get_all_groups():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def norms(tensors, dtype=None):
    """The ℓ₂ norm of each tensor (0-dim tensors; in ``dtype`` if given, else in each one's own).
    Those of tensors sharded over one process group (FSDP2's shards) are summed over it in one
    collective for all of them, not one each."""
    tensors = list(tensors)
    # One fused call for all of them: on a GPU a launch each would cost the host more than the norms.
    local = [t.to_local() if is_sharded(t) else t for t in tensors]
    found = list(torch._foreach_norm(local, 2, dtype=dtype)) if tensors else []
    sharded = [i for i, t in enumerate(tensors) if is_sharded(t)]
    if sharded:
        squares = torch.stack([found[i].double() ** 2 for i in sharded])[None]
        whole = _over_processes(squares, [tensors[i] for i in sharded], lambda g, k: local[sharded[k]])
        for i, total in zip(sharded, whole[0].sqrt()):
            found[i] = total.to(found[i].dtype)
    return found


def _sharded_on_one_dim(tensor):
    """Whether ``tensor`` is sharded along dimension 0 over a one-dimensional mesh (FSDP2's,
    not HSDP's)."""
    return tensor.device_mesh.ndim == 1 and tensor.placements[0].is_shard(0)


def gathered(tensors):
    """``(index, full value)`` of each tensor in order, DTensors gathered: FSDP2's shards of
    consecutive tensors in one collective each, a batch holding at most as many values as the
    largest tensor (about one layer's), so that no more than two such are held at once."""
    tensors = list(tensors)
    largest = max((t.numel() for t in tensors if is_sharded(t)), default=0)
    batch, held = [], 0  # indices waiting for the next collective, and their values
    for index, t in enumerate(tensors):
        batchable = is_sharded(t) and _sharded_on_one_dim(t)
        first = tensors[batch[0]] if batch else None
        if first is not None and (not batchable or (t.device_mesh, t.dtype) != (first.device_mesh, first.dtype) or held + t.numel() > largest):
            yield from zip(batch, _gather_shards([tensors[i] for i in batch]))
            batch, held = [], 0
        if batchable:
            batch.append(index)
            held += t.numel()
        else:
            yield index, full(t)
    yield from zip(batch, _gather_shards([tensors[i] for i in batch]))


def _gather_shards(shards):
    """Full values of DTensors sharded along dimension 0 over one 1-D mesh (``torch.chunk``'s
    split, as DTensor and FSDP2 make it): every rank's shards in one all-gather."""
    if not shards:
        return []
    mesh = shards[0].device_mesh
    world = mesh.size()

    def rows(t):  # each rank's rows of t
        step = -(-t.shape[0] // world)
        return [max(0, min(step, t.shape[0] - step * k)) for k in range(world)]

    counts = [[n * math.prod(t.shape[1:]) for n in rows(t)] for t in shards]
    width = max(sum(c[k] for c in counts) for k in range(world))
    local = torch.cat([t.to_local().reshape(-1) for t in shards])
    buffer = local.new_zeros(width)
    buffer[: local.numel()] = local
    out = local.new_empty(world * width)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the new name: torch 2.13)
    gather(out, buffer, group=mesh.get_group())
    out = out.view(world, width)
    starts = [0] * world
    values = []
    for t, count in zip(shards, counts):
        pieces = [out[k, starts[k] : starts[k] + count[k]] for k in range(world)]
        starts = [start + c for start, c in zip(starts, count)]
        values.append(torch.cat(pieces).view(t.shape))
    return values


def full(value):
    """``value`` as a plain tensor: a ``DTensor``'s full value (a collective every rank joins:
    a sharded parameter gathered, a norm of shards summed); anything else as it is."""
    return value.full_tensor() if is_sharded(value) else value
