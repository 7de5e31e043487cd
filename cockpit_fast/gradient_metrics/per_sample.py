"""Per-sample gradients of every sample's own loss from one batched backward pass.

The collector only sees the loss, after the forward pass, so nothing can have been hooked into the
model (BackPACK needs its extension before the forward pass). Instead, one
``torch.autograd.grad(..., is_grads_batched=True)`` call backpropagates the N rows of the identity
at once: row n of each result is the gradient of ``loss[n]`` alone, for any graph, any module and
raw tensors alike. Linear layers get a cheaper treatment inside that scheme:

* A Linear layer shows up in the graph as an ``addmm``/``mm`` node that is the only user of the
  transposed weight. The backward stops at the layer's output z, giving
  ``J[n, m] = d loss[n] / d z[m]``, and the weight's per-sample gradient is ``J[n]^T a`` with the
  input ``a`` autograd saved. When samples do not interact (J vanishes off the diagonal) that is
  the outer product ``J[n, n] a[n]^T``, which stays factored: its statistics follow from those of
  the two factors, and the N-fold weight-gradient products of the batched backward are skipped.
  A bias used only by that node gets ``J[n, n]``, or ``sum_m J[n, m]`` when samples interact.
* When every target belongs to such a layer, ``2 log2(N) + 1`` probe rows replace the N rows of
  the identity (see ``_from_probes``); the identity is used when they show that samples interact.
* Every other target gets its batched gradient, as autograd computes it.
"""

import math
import warnings

import torch
from torch.autograd.graph import GradientEdge

from cockpit_fast import ops
from cockpit_fast import stats as columns
from cockpit_fast._validation import MAX_P_VALUES, accumulation_dtype

_warned = set()


def warn_once(message):
    """Warns about a slow fallback the first time each distinct message comes up."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class PerSampleGrad:
    """Per-sample gradients of one target, shape (N, *target_shape), dense or as two factors.

    Args:
        dense: The gradients themselves, or None when given as factors.
        factors: ``(delta, a)`` of shapes (N, out) and (N, in) whose outer products
            ``delta[n] a[n]^T`` are the gradients.
    """

    def __init__(self, dense=None, factors=None):
        self._dense = dense
        self.factors = factors

    @property
    def dtype(self):
        """dtype of the gradients."""
        return (self._dense if self.factors is None else self.factors[0]).dtype

    @property
    def values_per_sample(self):
        """How many values one sample's gradient has."""
        if self.factors is None:
            return math.prod(self._dense.shape[1:])
        delta, a = self.factors
        return delta.shape[1] * a.shape[1]

    def dense(self):
        """The gradients as one (N, *target_shape) tensor, built from the factors once if needed."""
        if self._dense is None:
            delta, a = self.factors
            self._dense = torch.einsum("no,ni->noi", delta, a)
        return self._dense


def per_sample_gradients(loss, targets, retain_graph):
    """Gradients of each ``loss[n]`` with respect to every target, from batched backward passes.

    One pass, or two when the probes of ``_from_probes`` find interacting samples.

    Args:
        loss: Per-sample losses, shape (N,).
        targets: Parameters or other tensors in the graph of ``loss``.
        retain_graph: Whether the graph survives the call.

    Returns:
        dict: ``id(target)`` to its :class:`PerSampleGrad`.
    """
    n = loss.shape[0]
    layers = _find_linear_layers(loss, targets, n)
    by_layer = {id(t) for layer in layers for t in (layer.weight, layer.bias) if t is not None}
    others = [t for t in targets if id(t) not in by_layer]
    edges = [GradientEdge(layer.node, 0) for layer in layers]
    grads = None if others else _from_probes(loss, layers, edges)
    if grads is None:
        identity = torch.eye(n, dtype=loss.dtype, device=loss.device)
        results = _batched_grad(loss, edges + others, identity)
        grads = {id(t): PerSampleGrad(dense=g) for t, g in zip(others, results[len(layers) :])}
        for layer, jacobian in zip(layers, results):
            grads.update(layer.gradients_from_jacobian(jacobian))
    if not retain_graph:
        torch.autograd.grad(loss, edges + others, grad_outputs=torch.zeros_like(loss))
    return grads


def _batched_grad(loss, inputs, grad_outputs):
    """One backward pass per row of ``grad_outputs``, batched with vmap.

    The graph is kept so that a batched pass that fails can still fall back to one pass per
    sample; ``per_sample_gradients`` frees it afterwards as the original's last pass would.
    """
    return torch.autograd.grad(
        loss, inputs, grad_outputs=grad_outputs, is_grads_batched=True, retain_graph=True
    )


def _from_probes(loss, layers, edges):
    """Per-sample gradients of Linear layers from 2 log2(N) + 1 backward rows instead of N.

    Row 0 of the probes is all ones, giving ``sum_n J[n, m]``, which is ``J[m, m]`` when the
    samples are independent. Every other row weights, with random positive weights, the samples
    whose index has a given value of a given bit; its gradient must vanish at every sample outside
    that group. Any two samples differ in some bit, so a nonzero ``J[n, m]`` (n != m) shows up unless
    a random combination cancels exactly. Returns None when the samples interact.
    """
    if not layers:
        return None
    n = loss.shape[0]
    index = torch.arange(n, device=loss.device)
    groups = [((index >> bit) & 1) == value for bit in range(max(1, (n - 1).bit_length())) for value in (0, 1)]
    weights = 1 + torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = weights.to(device=loss.device, dtype=loss.dtype)
    probes = torch.stack([torch.ones_like(weights)] + [weights * group for group in groups])
    outside = probes[1:] == 0
    results = _batched_grad(loss, edges, probes)
    if any(torch.count_nonzero(rows[1:][outside]) for rows in results):
        return None
    grads = {}
    for layer, rows in zip(layers, results):
        grads.update(layer.independent_gradients(rows[0]))
    return grads


class _LinearLayer:
    """An ``addmm``/``mm`` node computing ``z = a @ weight^T (+ bias)`` for the N samples."""

    def __init__(self, node, weight, bias, inputs):
        self.node, self.weight, self.bias = node, weight, bias
        # Saved activations may require grad; the gradients never do.
        self.inputs = None if inputs is None else inputs.detach()

    def gradients_from_jacobian(self, jacobian):
        """Per-sample gradients of weight and bias from ``J[n, m] = d loss[n] / d z[m]``."""
        diagonal = jacobian.diagonal(dim1=0, dim2=1).T  # J[n, n], (N, out)
        # Exact zeros off the diagonal: row-wise ops never mix an untouched row into another.
        if torch.count_nonzero(jacobian) == torch.count_nonzero(diagonal):
            return self.independent_gradients(diagonal)
        grads = {}
        if self.weight is not None:
            dense = torch.einsum("nmo,mi->noi", jacobian, self.inputs)
            grads[id(self.weight)] = PerSampleGrad(dense=dense)
        if self.bias is not None:
            grads[id(self.bias)] = PerSampleGrad(dense=jacobian.sum(1))
        return grads

    def independent_gradients(self, delta):
        """Per-sample gradients when row n of ``delta`` is ``d loss[n] / d z[n]``, all that matters."""
        grads = {}
        if self.weight is not None:
            grads[id(self.weight)] = PerSampleGrad(factors=(delta, self.inputs))
        if self.bias is not None:
            grads[id(self.bias)] = PerSampleGrad(dense=delta)
        return grads


# Backward nodes of z = a @ weight^T (+ bias): the name of the saved input a, and the input slot
# that takes weight^T (addmm(bias, a, weight^T) and mm(a, weight^T)).
_MATMULS = {"AddmmBackward0": ("mat1", 2), "MmBackward0": ("self", 1)}


def _find_linear_layers(loss, targets, n):
    """Linear layers over the N samples whose target weight and/or bias have no other use."""
    users = _users_of_nodes(loss.grad_fn)
    wanted = {id(t) for t in targets}
    roles = {}  # node -> {"weight": tensor, "bias": tensor}
    for node, uses in users.items():
        target = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if target is None or id(target) not in wanted or len(uses) != 1:
            continue
        (user, slot), = uses
        role = _role_in_linear(user, slot, users)
        # A bias is a vector broadcast over the rows; any other addend is not.
        if role is not None and (role[1] == "weight" or target.dim() == 1):
            roles.setdefault(role[0], {})[role[1]] = target
    layers = []
    for node, found in roles.items():
        input_name = _MATMULS[type(node).__name__][0]
        # One row per sample, so that row n of z belongs to sample n.
        if getattr(node, f"_saved_{input_name}_sym_sizes")[0] != n:
            continue
        inputs = getattr(node, f"_saved_{input_name}") if "weight" in found else None
        layers.append(_LinearLayer(node, found.get("weight"), found.get("bias"), inputs))
    return layers


def _role_in_linear(user, slot, users):
    """``(node, "weight" | "bias")`` when a leaf used at ``user``'s input ``slot`` is one of those."""
    kind = type(user).__name__
    if kind == "AddmmBackward0" and slot == 0 and user._saved_beta == 1:
        return user, "bias"
    if kind != "TBackward0" or len(users.get(user, ())) != 1:
        return None
    (matmul, matmul_slot), = users[user]
    matmul_kind = type(matmul).__name__
    if matmul_kind not in _MATMULS or matmul_slot != _MATMULS[matmul_kind][1]:
        return None
    if matmul_kind == "AddmmBackward0" and matmul._saved_alpha != 1:
        return None
    return matmul, "weight"


def _users_of_nodes(root):
    """Every node reachable from ``root`` mapped to its ``[(user node, input slot), ...]``."""
    users = {}
    stack = [root] if root is not None else []
    seen = set(stack)
    while stack:
        node = stack.pop()
        for slot, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            users.setdefault(child, []).append((node, slot))
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return users


def per_sample_stats(grad, p_values):
    """``cockpit_fast.ops.per_sample_stats`` rows of a :class:`PerSampleGrad`, for any number of p.

    Factored gradients are never built: every column of an outer product follows from the
    columns of its two factors.
    """
    if grad.factors is None:
        return _stats_in_groups(grad.dense(), p_values)
    delta, a = grad.factors
    # In float64: each factor's p-th powers can overflow or vanish in float32 where the
    # products' (the outer product's values') do not.
    wide = _outer_product_stats(
        _stats_in_groups(delta.double(), p_values), delta.shape[1], _stats_in_groups(a.double(), p_values), a.shape[1]
    )
    return wide.to(accumulation_dtype(delta.dtype))


def _stats_in_groups(g, p_values):
    """One op call per group of at most MAX_P_VALUES p values; the groups' p columns joined."""
    groups = [p_values[i : i + MAX_P_VALUES] for i in range(0, len(p_values), MAX_P_VALUES)]
    rows = [ops.per_sample_stats(g, 1.0, group) for group in groups or [()]]
    return torch.cat([rows[0]] + [r[:, columns.P0 :] for r in rows[1:]], dim=1)


def _outer_product_stats(s, size_s, t, size_t):
    """Stats rows of the outer products x[i, j] = u[i] v[j] from the rows s of u and t of v."""
    corners = torch.stack(
        [s[:, e] * t[:, f] for e in (columns.MAX, columns.MIN) for f in (columns.MAX, columns.MIN)]
    )
    out = torch.empty_like(s)
    out[:, columns.MAX] = corners.amax(0)
    out[:, columns.MIN] = corners.amin(0)
    out[:, columns.MEAN] = s[:, columns.MEAN] * t[:, columns.MEAN]
    # u v - mean(u) mean(v) splits into three mutually orthogonal parts, so M2 is a sum of
    # non-negative terms and does not cancel.
    out[:, columns.M2] = (
        s[:, columns.M2] * t[:, columns.M2]
        + size_s * s[:, columns.MEAN] ** 2 * t[:, columns.M2]
        + size_t * t[:, columns.MEAN] ** 2 * s[:, columns.M2]
    )
    out[:, columns.MAX_ABS] = s[:, columns.MAX_ABS] * t[:, columns.MAX_ABS]
    out[:, columns.P0 :] = s[:, columns.P0 :] * t[:, columns.P0 :]
    return out
