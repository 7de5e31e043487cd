"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the tensors a tracked parameter is computed with.

A parameter FSDP2 shards is a ``DTensor`` holding this rank's shard. Forward and backward passes
compute with another tensor: the unsharded parameter FSDP2 all-gathers into (one object per
parameter for the whole run, its storage freed between uses), which FSDP2 sets on the module
while it runs; its gradient, this rank's own and full-size, is reduce-scattered into the shard's
``.grad``. :class:`Unsharded` maps each tracked parameter to the tensor in the graph and back,
so that the capture, the engine and the gradient hooks see the calls and gradients of the
tracked parameters. FSDP1 (``FullyShardedDataParallel``) is refused (:func:`refuse_fsdp1`).
"""

import torch

try:
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch without torch.distributed
    DTensor = FSDPState = None
    _module_state_mapping = {}


def is_sharded(tensor):
    """Whether ``tensor`` is a ``DTensor`` (a shard of FSDP2's, or any distributed tensor)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def refuse_fsdp1(params):
    """Raises a ValueError if ``params`` are FSDP1's flat parameters."""
    if any(getattr(p, "_is_flat_param", False) for p in params):  # FlatParameter's own isinstance test
        raise ValueError(
            "the parameters are FullyShardedDataParallel's (FSDP1) flat parameters, which hold every layer's "
            "values in one tensor: the cockpit supports sharded training with FSDP2 (torch.distributed.fsdp."
            "fully_shard); make the cockpit from model.parameters() of a model sharded with fully_shard"
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
        if id(param) not in self._tracked:
            return param
        if id(param) not in self._to_graph:
            self._refresh()
        if id(param) not in self._to_graph:
            raise ValueError(
                f"a tracked parameter of shape {tuple(param.shape)} is a DTensor that no fully_shard-ed module's "
                "forward pass has unsharded yet: the cockpit tracks sharded parameters of FSDP2 (fully_shard) after "
                "the forward pass of the step"
            )
        return self._to_graph[id(param)]

    def tracked(self, tensor):
        """The tracked parameter ``tensor`` stands for (itself where it is one); None for a
        tensor no tracked parameter is computed with."""
        if not self._tracked:
            return None
        if id(tensor) not in self._to_tracked:
            self._refresh()
        return self._to_tracked.get(id(tensor))

    def _refresh(self):
        """Reads every FSDP2 state's parameters (unsharded tensors exist after the first forward)."""
        for state_ref in list(_module_state_mapping.values()):
            state = state_ref()
            if not isinstance(state, FSDPState):
                continue
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    shard = self._tracked.get(id(fsdp_param.sharded_param))
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if shard is not None and unsharded is not None:
                        self._to_graph[id(shard)] = unsharded
                        self._to_tracked[id(unsharded)] = shard


def full(value):
    """``value`` as a plain tensor: a ``DTensor``'s full value (a collective every rank joins:
    a sharded parameter gathered, a norm of shards summed); anything else as it is."""
    return value.full_tensor() if is_sharded(value) else value
