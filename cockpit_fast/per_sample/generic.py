"""The exact routes for what no per-layer rule covers.

* :class:`ModuleVjpGrads`, module-local: ``torch.func.vjp`` of the one module call, under ``vmap``
  over its samples, given the captured input and output gradient (Opacus's functorch route). It
  never backpropagates through the rest of the model, and forms its gradients a chunk of
  samples at a time.
* :func:`whole_graph_grads`: one batched backward pass of every sample's own loss through the
  whole graph, for modules whose samples interact (a batch norm in training mode) or calls that
  cannot be replayed (random ops such as dropout).
"""

import contextlib
import warnings
import weakref

import torch
from backpack import hook_store_io as backpack_store_io
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from cockpit_fast.per_sample.grads import DenseGrads, PerSampleGrads, samples_per_chunk


class ModuleVjpGrads(PerSampleGrads):
    """Per-sample gradients of parameters of one module call, replayed sample by sample.

    Args:
        call: The captured call (:class:`~cockpit_fast.per_sample.capture.Call`).
        name (str): The parameter's name in ``call.module`` (dotted for a submodule's).
        output_grads (list): The gradient of each tensor output of the call (None: none).
    """

    def __init__(self, call, name, output_grads):
        self._call, self._name, self._output_grads = call, name, output_grads
        self.batch_size = call.batch_size
        self.shape = call.params[name].shape
        self._cache = None

    @property
    def formed_per_sample(self):
        return self._call.size  # a replay forms every parameter of the call at once

    def dense_range(self, start, stop):
        if self._cache is None or self._cache[0] != (start, stop):
            values = self._call.replay(start, stop, self._output_grads)
            self._cache = ((start, stop), values)
        return self._cache[1][self._name]


def _sample_dims(leaves, dim, n):
    """The sample dimension of each leaf: ``dim`` where it has N entries there, else 0 where it
    has N entries there (a mask given batch-first), else None (shared by every sample)."""
    dims = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            dims.append(None)
        elif leaf.dim() > dim and leaf.shape[dim] == n:
            dims.append(dim)
        elif leaf.shape[0] == n:
            dims.append(0)
        else:
            dims.append(None)
    return dims


def replay_grads(module, params, args, kwargs, outputs, positions, output_grads, sample_dim, batch, start, stop, rows=False):
    """``{name: (stop - start, *shape)}``: per-sample gradients of ``params`` (names in
    ``module``) for samples ``start`` to ``stop`` of one call of ``module``.

    Args:
        args, kwargs: The call's inputs (detached).
        outputs (list[torch.Tensor]): The call's tensor outputs that require grad, flattened.
        positions (list[int]): Where each of them is among all the call's tensor outputs.
        output_grads (list): Their gradients (None where an output got none).
        sample_dim (int): Where the samples are in the inputs and outputs (0, or 1 for a module
            with ``batch_first=False``).
        batch (int): N, the number of samples of the call.
        rows (bool): Each sample's part of the inputs and outputs is the rows the call had for it
            (a routed call's, regrouped ``(N, P, ...)``; a shared call's inputs, made once for
            all): replayed as rows, as the module takes them (an experts module indexes its
            rows), not as a batch of one.
    """
    n = stop - start
    flat_inputs, spec = tree_flatten((args, kwargs))
    in_dims = _sample_dims(flat_inputs, sample_dim, batch)
    out_dims = _sample_dims(outputs, sample_dim, batch)
    kept = [i for i, g in enumerate(output_grads) if g is not None and out_dims[i] is not None]
    sliced = [leaf.narrow(d, start, n) if d is not None else leaf for leaf, d in zip(flat_inputs, in_dims)]
    cotangents = [output_grads[i].narrow(out_dims[i], start, n) for i in kept]
    # Inputs that hold no samples, outputs that do (parameters expanded to the batch, as
    # Perceiver's latents): each sample's output is its row of the whole batch's, by its index.
    expanded = not rows and bool(kept) and all(d is None for d in in_dims)
    if expanded:
        sliced, in_dims = [*sliced, torch.arange(start, stop, device=cotangents[0].device)], [*in_dims, 0]
    # A call may change its module's tensors in place, which the user's backward pass would then
    # refuse: a replay changes copies. Parameters (a learnable fake quantizer clamps its scale's
    # data), and in training mode buffers (running statistics, a spectral norm's power iteration).
    detached = {name: p.detach().clone() for name, p in params.items()}
    buffers = {name: b.clone() for name, b in module.named_buffers()} if module.training else {}

    def forward(p, sample_inputs):
        if expanded:
            *sample_inputs, index = sample_inputs
        restored = [leaf.unsqueeze(d) if d is not None and not rows else leaf for leaf, d in zip(sample_inputs, in_dims)]
        call_args, call_kwargs = tree_unflatten(restored, spec)
        # (The parameters the call's inner calls claim are read as they are: detached below.)
        # Untied: a tensor held under two names the call owns gets each use's gradient under
        # its name (the capture sums them), and one an inner call claims stays as it is.
        leaves = tree_flatten(functional_call(module, {**buffers, **p}, tuple(call_args), call_kwargs, tie_weights=False))[0]
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if expanded:
            return tuple(tensors[positions[i]].movedim(out_dims[i], 0)[index] for i in kept)
        return tuple(tensors[positions[i]] if rows else tensors[positions[i]].squeeze(out_dims[i]) for i in kept)

    def one_sample(sample_inputs, sample_cotangents):
        _, pullback = vjp(lambda p: forward(p, sample_inputs), detached)
        # Values only: through the module's other parameters the result would carry their graph.
        return {name: g.detach() for name, g in pullback(tuple(sample_cotangents))[0].items()}

    def one_sample_by_autograd(sample_inputs, sample_cotangents):
        # Autograd itself runs what torch.func cannot (a custom autograd.Function without setup_context).
        p = {name: value.detach().requires_grad_() for name, value in detached.items()}
        reached = [(out, cot) for out, cot in zip(forward(p, sample_inputs), sample_cotangents) if out.requires_grad]
        if not reached:
            return {name: torch.zeros_like(value) for name, value in p.items()}
        outs, cots = zip(*reached)
        return dict(zip(p, torch.autograd.grad(outs, list(p.values()), cots, allow_unused=True, materialize_grads=True)))

    def by_autograd():
        samples, drew = [], False
        for k in range(n):
            one = [leaf.select(d, k) if d is not None else leaf for leaf, d in zip(sliced, in_dims)]
            cot = [c.select(out_dims[i], k) for c, i in zip(cotangents, kept)]
            samples.append(one_sample_by_autograd(one, cot))
            if k == 0:  # once more: a call drawing random numbers (vmap refuses to) draws others
                drew = _differ(samples[0], one_sample_by_autograd(one, cot))
        return {name: torch.stack([sample[name] for sample in samples]) for name in params}, drew

    with torch.enable_grad(), _module_hooks_set_aside(module), _attributes_kept(module):
        try:
            grads = vmap(one_sample, in_dims=(in_dims, [out_dims[i] for i in kept]), randomness="error")(sliced, cotangents)
            _replayed_by_autograd.discard(module)
            return grads
        except Exception as error:  # noqa: BLE001 (what a batched replay raises: any kind)
            if "random" in str(error).lower():
                raise _draws_random_numbers(module) from error
        # vmap has no batching rule for an op, or torch.func no transform: one sample at a time.
        try:
            grads, drew = by_autograd()
        except Exception as again:  # noqa: BLE001 (torch.func raises many kinds for what it cannot do)
            where = f"the per-sample gradients of {', '.join(params)} in {type(module).__name__} come from replaying its call"
            caches = sorted({type(leaf).__name__ for leaf in flat_inputs if type(leaf).__name__.endswith("Cache")})
            if caches:  # Hugging Face's key/value or state caches: the call filled them as it ran
                raise RuntimeError(
                    f"{where}, which was handed a {' and a '.join(caches)} that it fills as it runs, so it cannot "
                    "be run again: train without the cache (model.config.use_cache = False, or use_cache=False "
                    "in the model's call)"
                ) from again
            raise RuntimeError(
                f"{where} with torch.func, which fails ({type(again).__name__}: {again}); register a rule for "
                "the module (cockpit_fast.per_sample.register_rule), track without these parameters, or, on a "
                "step without info['individual_losses'], hand them in with their graph (the route through the "
                "whole graph)"
            ) from again
        if drew:
            raise _draws_random_numbers(module)
        _replayed_by_autograd.add(module)
        return grads


def _draws_random_numbers(module):
    return ValueError(
        f"{type(module).__name__} draws random numbers in its forward pass (dropout?), so its call cannot be "
        "replayed sample by sample: hand in info['individual_losses'] with their graph (the route through the "
        "whole graph), or put the module in eval mode"
    )


def _differ(first, again):
    """Whether two replays of one sample differ by more than a kernel's nondeterminism."""
    return any(bool((first[name] - again[name]).norm() > 1e-4 * first[name].norm()) for name in first)


_replayed_by_autograd = weakref.WeakSet()
"""The modules whose last call torch.func could not replay under vmap and autograd did, one
sample at a time (:func:`replayed_by_autograd`)."""


def replayed_by_autograd(module):
    """Whether the last call of ``module`` was replayed one sample at a time by autograd, where
    torch.func could not batch it."""
    return module in _replayed_by_autograd


@contextlib.contextmanager
def _attributes_kept(module):
    """A replay leaves the modules' attributes and buffers as it found them: one their forward
    pass sets (an output kept for logging, a recurrent state, a statistic in a buffer) held the
    replay's tensor, escaped from torch.func's transforms (reading it raised), where the user
    reads the model's."""
    # (A scripted module's buffers are no dict: its replay cannot run anyway.)
    kept = [(held, dict(held)) for m in module.modules() for held in (m.__dict__, m._buffers) if isinstance(held, dict)]
    try:
        yield
    finally:
        for held, before in kept:
            if held.keys() != before.keys() or any(held[key] is not value for key, value in before.items()):
                held.clear()
                held.update(before)


@contextlib.contextmanager
def _module_hooks_set_aside(module):
    """A replay computes gradients for the statistics, not the model's backward pass: the
    modules' backward hooks (BackPACK's extensions, a user's) do not run in it (torch.func
    cannot run them either), nor BackPACK's forward hooks storing inputs for its own pass."""
    set_aside = []
    for m in module.modules():
        for hooks in (m._backward_hooks, m._backward_pre_hooks):
            if hooks:
                set_aside.append((hooks, dict(hooks)))
                hooks.clear()
        stores = {key: hook for key, hook in m._forward_hooks.items() if hook is backpack_store_io}
        if stores:
            set_aside.append((m._forward_hooks, stores))
            for key in stores:
                del m._forward_hooks[key]
    try:
        yield
    finally:
        for hooks, kept in set_aside:
            hooks.update(kept)


def whole_graph_grads(losses, params, scale, activations=0):
    """``{id(param): DenseGrads}``: ``scale`` times the gradient of every ``losses[n]`` through the
    whole graph, from batched backward passes of a chunk of samples each; the graph is kept for
    the caller's own. A batched pass holds every activation's gradient once per sample of its
    chunk: ``activations``, the values of the graph's activations (as far as the caller knows
    them), bounds the chunk with the parameters' values (one sample a pass where they are large:
    on the CPU one pass a sample is also the faster: 0.55x the time of 32 at once for a small
    batch-norm CNN, benchmarks/RESULTS.md). A graph that holds an op the batched pass cannot
    run (cuDNN's recurrent backward has no batching rule) takes one sample a pass."""
    refuse_reentrant_checkpoints(losses)
    n = losses.shape[0]
    out = [p.new_empty(n, *p.shape) for p in params]
    size = samples_per_chunk(sum(p.numel() for p in params) + activations)
    start = 0
    while start < n:
        stop = min(n, start + size)
        rows = scale * torch.eye(n, dtype=losses.dtype, device=losses.device)[start:stop]
        if stop - start == 1:  # a plain backward pass: a batched one of one sample takes 1.2x its time
            grads = torch.autograd.grad(losses, params, grad_outputs=rows[0], retain_graph=True, allow_unused=True)
            grads = [None if g is None else g.unsqueeze(0) for g in grads]
        else:
            try:
                grads = torch.autograd.grad(
                    losses, params, grad_outputs=rows, is_grads_batched=True, retain_graph=True, allow_unused=True
                )
            except RuntimeError as error:  # an op that vmap cannot batch: one sample a pass from here on
                warnings.warn(
                    f"cockpit_fast: the whole graph's batched backward pass failed ({type(error).__name__}: "
                    f"{(str(error).splitlines() or [''])[0]}); one backward pass per sample instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
                size = 1
                continue
        for values, g in zip(out, grads):
            values[start:stop] = 0 if g is None else g
        start = stop
    return {id(p): DenseGrads(values) for p, values in zip(params, out)}


def refuse_reentrant_checkpoints(losses):
    """Raises a ValueError where the graph of ``losses`` holds activation checkpointing with
    ``use_reentrant=True``: its backward pass runs a backward pass of its own, which a batched
    backward pass cannot see into (its parameters would get no per-sample gradient)."""
    checkpointed = torch.utils.checkpoint.CheckpointFunction._backward_cls
    if any(type(node) is checkpointed for node in graph_nodes(losses.grad_fn)):
        raise ValueError(
            "per-sample gradients through activation checkpointing with use_reentrant=True cannot be computed: "
            "its backward pass is a backward pass of its own. Use "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
        )


def refuse_composable_checkpoints(model):
    """Raises a ValueError where ``model`` holds modules under torch's composable activation
    checkpointing (``torch.distributed._composable.checkpoint``): it recomputes them in a context
    made once per forward pass, so a second backward pass through them raises, and the step's
    checks or whole graph are backward passes besides the user's."""
    if model is None or not torch.distributed.is_available():
        return
    from torch.distributed._composable import checkpoint

    found = [name or type(model).__name__ for name, module in model.named_modules() if checkpoint.state(module) is not None]
    if found:
        raise ValueError(
            f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} checkpointed with torch.distributed._composable."
            "checkpoint, whose graph takes one backward pass only (torch recomputes it in a context made once), and "
            "this step's per-sample gradients need passes of their own: checkpoint with "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or torch.distributed.algorithms._checkpoint."
            "checkpoint_wrapper.checkpoint_wrapper instead"
        )


def graph_nodes(root):
    """The backward nodes of the graph of ``root`` (a backward node, or None: none), each once,
    ``root`` first; the caller may stop early."""
    if root is None:
        return
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        yield node
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                stack.append(next_node)
