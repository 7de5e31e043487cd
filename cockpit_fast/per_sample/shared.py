"""Calls shared by every sample: their output's gradient, sample by sample, where it is broadcast.

A module called once for the whole batch (T5's relative-attention-bias table looked up with
position buckets, a learned query) gives an output without a dimension of samples; broadcasting
adds it to each sample's tensors (or ``expand`` makes it the batch's, as MPNet's position bias),
and the backward pass sums the samples' gradients before they reach the output. They are still
apart where the broadcast happens: the add's (or the expand's) backward node receives
``(N, ...)``. A pre-hook on that node keeps each sample's rows, summed over the other broadcast
dimensions, and takes them back to the output through the nodes between (a permute,
an unsqueeze, a mask applied with ``where``: tensors still one for all, so each node's vjp is
the same linear map for every sample, and ``vmap`` applies it to all rows at once). Where the
broadcast makes rows that are ``k`` of each sample's (an image's windows) or ``repeat`` makes a
copy for each (DeBERTa's position projections, for each sample's heads), each sample's rows are
taken sample-major, where the engine's proof checks it with such rows (one row each proves no
order). The call then has per-sample output gradients like any other and takes its module's
rule.

Uses through nodes with several outputs, or into anything but such broadcasts, leave the call to
the whole graph (:func:`frontiers`); the engine proves the result like every other call's.
"""

from collections import defaultdict

import torch

_VIEWS = {  # ops that keep a tensor one for all whatever its shape
    "PermuteBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ViewBackward0",
    "UnsafeViewBackward0", "TransposeBackward0", "TransposeBackward1", "SliceBackward0", "CloneBackward0",
    "ToCopyBackward0", "AliasBackward0",
}
_BROADCASTS = {"AddBackward0", "SubBackward0", "ExpandBackward0", "RepeatBackward0"}


CALL_TAG = "cockpit_fast_calls"
"""Key of a backward node's metadata: weak references to the calls whose output it made."""


def is_shared_lookup(module, args, output, sample_dim, batch_size):
    """Whether the call is an embedding looking up ids of shape (1, T) (positions) after the
    forward pass showed ``batch_size`` > 1 samples: its output is broadcast over them, and the
    capture expands it to the batch (a view) so that it takes each sample's gradient."""
    ids = args[0] if args else None
    return (
        isinstance(module, torch.nn.Embedding)
        and sample_dim == 0
        and batch_size > 1
        and isinstance(ids, torch.Tensor)
        and ids.dim() == 2
        and ids.shape[0] == 1
        and isinstance(output, torch.Tensor)
    )


def frontiers(root, calls, batch_size, grouped=lambda call: True):
    """``{call: [(node, chain)] or None}`` for the ``calls`` whose output is in the graph of
    ``root`` (a backward node): the broadcasting adds its output reaches through nodes that
    keep it one for all, each with those nodes from the add's side to the output's; None where
    the output is used otherwise. Rows that are ``k`` of each sample's (:func:`_broadcasts_samples`)
    only for the calls ``grouped(call)`` allows (where a proof checks them, or checked them)."""
    consumers, targets = defaultdict(list), {}
    wanted = {id(call) for call in calls}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for ref in node.metadata.get(CALL_TAG, ()):
            call = ref()
            if call is not None and id(call) in wanted:
                targets[call] = node
        for nxt, _ in node.next_functions:
            if nxt is not None:
                consumers[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)

    def climb(node, chain, found, output_shape, rows):
        for consumer in dict.fromkeys(consumers[node]):
            link = (consumer, [i for i, (nxt, _) in enumerate(consumer.next_functions) if nxt is node])
            if type(consumer).__name__ in _BROADCASTS and _broadcasts_samples(consumer, chain, output_shape, batch_size, rows):
                found.append((consumer, chain))
            elif _still_shared(consumer, batch_size):
                if not climb(consumer, [link, *chain], found, output_shape, rows):
                    return False
            else:
                return False
        return True

    out = {}
    for call, node in targets.items():
        found = []
        out[call] = found if climb(node, [], found, call.output_shapes[0], grouped(call)) and found else None
    del climb  # a recursive closure is a reference cycle: it would hold the graph until a collection
    return out


def _still_shared(node, batch_size):
    """Whether ``node`` makes one tensor (its backward, linear in its gradient, the same for
    every sample): a view, or an output without the samples along dimension 0. (A call's
    samples are told apart by the engine's proof, whatever this guesses.)"""
    if len(node._input_metadata) != 1:
        return False
    shape = node._input_metadata[0].shape
    return type(node).__name__ in _VIEWS or len(shape) == 0 or shape[0] != batch_size


def _broadcasts_samples(node, chain, output_shape, batch_size, rows=True):
    """Whether ``node`` broadcasts the shared tensor (one for all) to ``batch_size`` samples, or,
    where ``rows``, to rows that are ``k`` of each sample's (windows of an image; heads, as
    DeBERTa repeats its position projections for each sample's): taken sample-major, which the
    engine's proof checks."""
    result = list(node._input_metadata[0].shape)
    shape = list(chain[0][0]._input_metadata[0].shape) if chain else list(output_shape)
    padded = [1] * (len(result) - len(shape)) + shape
    if len(padded) != len(result) or not result or result[0] == 0 or result[0] % batch_size:
        return False
    if type(node).__name__ == "RepeatBackward0":  # (each sample's copy: repeated along dimension 0 alone)
        return (rows or padded[0] == 1) and result == [batch_size * padded[0], *padded[1:]]
    return padded[0] == 1 and (rows or result[0] == batch_size)


def rows_per_sample(found, batch_size):
    """Whether some broadcast of ``found`` (:func:`frontiers`) reaches rows that are several of
    each sample's, whose grouping only a proof with such rows tells."""
    return any(node._input_metadata[0].shape[0] != batch_size for node, _ in found)


def per_sample_output_grads(chain, grad, batch_size, output_shape):
    """The output's gradient of each sample ``(N, *output_shape)`` from ``grad``, what the
    broadcasting node receives (``k`` rows of each sample: summed where it broadcast them, each
    sample's copy where it repeated it); None where it does not hold the samples along
    dimension 0."""
    shape = list(chain[0][0]._input_metadata[0].shape) if chain else list(output_shape)
    padded = [1] * (grad.dim() - len(shape)) + shape
    if grad.dim() == 0 or grad.shape[0] == 0 or grad.shape[0] % batch_size or len(padded) != grad.dim():
        return None
    grouped = grad.unflatten(0, (batch_size, -1))  # (N, k, ...): each sample's k rows
    summed = [d + 1 for d in range(grad.dim()) if padded[d] == 1 and grouped.shape[d + 1] != 1]
    rows = (grouped.sum(summed, keepdim=True) if summed else grouped).reshape(batch_size, *shape)

    def back(row):
        for node, inputs in chain:  # each node's vjp, for the input the shared tensor came by
            grads = node(row)
            grads = grads if isinstance(grads, tuple) else (grads,)
            row = sum(grads[i] for i in inputs)
        return row

    return torch.vmap(back)(rows) if chain else rows


def install(found, call, capture):
    """Pre-hooks on the broadcasting adds ``found`` (:func:`frontiers`) that hand
    ``capture.fire_broadcast(call, [per-sample output gradient])`` what each receives in the
    passes ``capture`` is armed for; returns their handles."""
    handles = []
    for node, chain in found:

        def hook(grads, chain=chain):
            # (Not in other passes: one through the whole graph for some parameters alone does
            # not compute the gradients of the call's output, which the chain's nodes read.)
            if not capture.armed:
                return
            rows = per_sample_output_grads(chain, grads[0], call.batch_size, call.output_shapes[0][1:])
            if rows is None:
                raise RuntimeError(
                    f"the output of the {type(call.module).__name__} call shared by every sample no longer reaches "
                    "them along dimension 0 of a broadcasting add, as it did when the engine checked it"
                )
            capture.fire_broadcast(call, [rows])

        handles.append(node.register_prehook(hook))
    return handles
