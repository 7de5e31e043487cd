"""The factor route: statistics of per-sample weight gradients from a layer's two factors.

The per-sample weight gradient of a ``Linear`` layer is ``G_n = sum_t δ_{n,t} a_{n,t}^T``: ``a``
its input, ``δ`` the gradient of its output (already carrying the loss's 1/N, as BackPACK's
``grad_batch`` does), ``t`` running over any extra dimensions of the input. A ``Conv2d`` layer
is the same with ``t`` over output positions and ``a`` the unfolded input. BackPACK's
``BatchGrad`` writes all N gradients ``G_n``; :class:`GradBatchFactors` hands the hook these
factors instead, and :class:`WeightFactors` computes each statistic from them:

- 2-d inputs (``G_n = δ_n a_n^T``, one product per element): square norms and dot products by
  matrix products of the factors, histograms by :func:`cockpit_fast.ops.outer_hist1d` /
  :func:`~cockpit_fast.ops.outer_hist2d`. No per-sample gradient is formed at all.
- otherwise: per-sample squared norms by the Gram form ``<δ_n δ_n^T, a_n a_n^T>`` where that is
  cheaper, dot products by matrix products, and the rest from per-sample gradients formed for a
  few samples at a time (:meth:`WeightFactors.chunks`), never for the whole batch.

Factors pay where they are smaller than the gradient they stand for (:func:`factors_pay`):
elsewhere (convolutions over many positions with few channels, say) every statistic would form
per-sample gradients anyway, and BackPACK forms them faster; there :class:`GradBatchFactors`
hands on BackPACK's ``grad_batch`` unless forced, or unless BackPACK would get the layer wrong
(:func:`batch_grad_is_exact`: a Conv2d padded other than by zeros given as numbers). Biases keep
BackPACK's ``grad_batch`` (N x out, no bigger than the output gradient itself).
"""

import math
from functools import cached_property

import torch
from backpack.extensions import BatchGrad
from backpack.extensions.firstorder.batch_grad.conv2d import BatchGradConv2d
from backpack.extensions.firstorder.batch_grad.linear import BatchGradLinear
from torch.nn import Conv2d, Linear
from torch.nn.functional import pad, unfold

from cockpit_fast import ops
from cockpit_fast._validation import accumulation_dtype

CHUNK_VALUES = 2**22
"""Most per-sample gradient values formed at once where a statistic needs them (16 MiB float32)."""


def factors_pay(positions, out_features, in_features):
    """Whether a weight's per-sample gradients are cheaper to work with as factors: one outer
    product each, or factors (``positions * (out + in)`` values a sample) smaller than the
    gradient itself (``out * in``)."""
    return positions == 1 or positions * (out_features + in_features) < out_features * in_features


class WeightFactors:
    """The per-sample gradients of one weight, ``G_n = sum_t output_grads[n, t] inputs[n, t]^T``.

    Args:
        inputs (torch.Tensor): ``(N, T, q)``, the layer input (unfolded for convolutions).
        output_grads (torch.Tensor): ``(N, T, p)``, the gradient of the layer output.
        weight_shape (torch.Size): The weight's shape; it has ``p * q`` elements.
    """

    def __init__(self, inputs, output_grads, weight_shape):
        self.inputs = inputs.detach()
        self.output_grads = output_grads.detach()
        self.weight_shape = weight_shape
        self.batch_size, self.positions, self.in_features = inputs.shape
        self.out_features = output_grads.shape[-1]

    @property
    def is_outer_product(self):
        """Whether each ``G_n`` is one outer product (a 2-d Linear input)."""
        return self.positions == 1

    def _acc(self, t):
        return t.to(accumulation_dtype(t.dtype))

    def _as_matrix(self, t):
        """A weight-shaped tensor as the (p, q) matrix the factors multiply into."""
        return t.reshape(self.out_features, self.in_features)

    @cached_property
    def grad(self):
        """The mini-batch gradient sum_n G_n, weight-shaped."""
        delta = self.output_grads.flatten(0, 1)
        return (delta.T @ self.inputs.flatten(0, 1)).reshape(self.weight_shape)

    def batch_l2(self):
        """(N,) squared norms ||G_n||², or None where forming ``G_n`` is cheaper."""
        delta, a = self._acc(self.output_grads), self._acc(self.inputs)
        if self.is_outer_product:
            return (delta[:, 0] ** 2).sum(1) * (a[:, 0] ** 2).sum(1)
        t, p, q = self.positions, self.out_features, self.in_features
        if not factors_pay(t, p, q):
            return None
        return (delta @ delta.transpose(1, 2) * (a @ a.transpose(1, 2))).sum((1, 2))

    def sum_grad_squared(self):
        """sum_n G_n², weight-shaped, or None unless each ``G_n`` is one outer product."""
        if not self.is_outer_product:
            return None
        delta, a = self._acc(self.output_grads[:, 0]), self._acc(self.inputs[:, 0])
        return ((delta**2).T @ a**2).reshape(self.weight_shape)

    def dot(self, direction):
        """(N,) dot products <G_n, direction> = sum_t δ_{n,t}^T direction a_{n,t}."""
        d = self._as_matrix(self._acc(direction))
        delta, a = self._acc(self.output_grads), self._acc(self.inputs)
        return ((a @ d.T) * delta).sum((1, 2))

    def abs_max(self, scale):
        """max |scale * G_n| over samples and elements, or None unless outer products.

        The largest product is the product of the largest factors, exactly in floating point.
        """
        if not self.is_outer_product:
            return None
        largest = self.output_grads[:, 0].abs().amax(1) * self.inputs[:, 0].abs().amax(1)
        return (scale * self._acc(largest)).abs().max()

    def hist1d(self, bins, range, scale):
        """:func:`cockpit_fast.ops.hist1d` counts of ``scale * G``, or None unless outer products."""
        if not self.is_outer_product:
            return None
        return ops.outer_hist1d(self.output_grads[:, 0], self.inputs[:, 0], bins, range, scale)

    def hist2d(self, param, bins, range, scale):
        """:func:`cockpit_fast.ops.hist2d` counts against ``param``, or None unless outer products."""
        if not self.is_outer_product:
            return None
        weight = self._as_matrix(param.detach())
        return ops.outer_hist2d(self.output_grads[:, 0], self.inputs[:, 0], weight, bins, range, scale)

    def chunks(self):
        """Per-sample gradients ``(c, *weight_shape)`` of consecutive samples, c at most
        ``CHUNK_VALUES / weight size``: what statistics without a factored form are taken from."""
        size = math.prod(self.weight_shape)
        step = max(1, CHUNK_VALUES // max(1, size))
        for start in range(0, self.batch_size, step):
            delta = self.output_grads[start : start + step]
            a = self.inputs[start : start + step]
            yield (delta.transpose(1, 2) @ a).reshape(-1, *self.weight_shape)


def linear_factors(module, g_out):
    """:class:`WeightFactors` of a ``Linear`` weight: input (N, *, in), output gradient (N, *, out)."""
    a, delta = module.input0, g_out[0]
    n = a.shape[0]
    return WeightFactors(a.reshape(n, -1, a.shape[-1]), delta.reshape(n, -1, delta.shape[-1]), module.weight.shape)


def conv2d_factors(module, g_out):
    """:class:`WeightFactors` of a ``Conv2d`` weight: unfolded input, output gradient per position."""
    if batch_grad_is_exact(module):  # zero padding given as numbers: unfold pads
        a = unfold(module.input0, module.kernel_size, module.dilation, module.padding, module.stride)
    else:  # pad as the layer does ('same', reflect, ...), then unfold the padded input
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        padded = pad(module.input0, module._reversed_padding_repeated_twice, mode=mode)
        a = unfold(padded, module.kernel_size, module.dilation, 0, module.stride)
    delta = g_out[0].flatten(2)  # (N, out, positions)
    return WeightFactors(a.transpose(1, 2), delta.transpose(1, 2), module.weight.shape)


def conv2d_has_factors(module):
    """Whether :func:`conv2d_factors` covers the layer: one group (any padding)."""
    return module.groups == 1


def batch_grad_is_exact(module):
    """Whether BackPACK's ``BatchGrad`` gives the layer's per-sample weight gradients: not for a
    ``Conv2d`` with a ``padding_mode`` other than zeros (ignored) or padding given as a string
    ('same', 'valid'; not taken)."""
    if not isinstance(module, Conv2d):
        return True
    return module.padding_mode == "zeros" and not isinstance(module.padding, str)


def _inexact_batch_grad(module):
    return ValueError(
        f"BackPACK's BatchGrad gives wrong per-sample gradients for {module} (it ignores "
        f"padding_mode={module.padding_mode!r} and padding given as a string): use "
        "per_sample_route='auto' or 'factors', which pad as the layer does"
    )


class _WeightFactorsWherePaying:
    """A BatchGrad module extension whose weight gets :class:`WeightFactors` where
    :func:`factors_pay` (everywhere the layer has them if ``force``), else BatchGrad's own
    ``grad_batch``. Subclasses say the factors' sizes (None: the layer has none) and form them."""

    def __init__(self, force):
        super().__init__()
        self._force = force

    def weight(self, ext, module, g_inp, g_out, backproped):
        sizes = self.factor_sizes(module, g_out)
        if sizes is None and self._force:
            raise ValueError(
                f"per_sample_route='factors': {module} has no factored form (grouped convolution); "
                "use 'auto' or 'grad_batch'"
            )
        if sizes is not None and (self._force or not batch_grad_is_exact(module) or factors_pay(*sizes)):
            return self.factors(module, g_out)
        return self._make_param_function("weight")(ext, module, g_inp, g_out, backproped)


class _LinearWeightFactors(_WeightFactorsWherePaying, BatchGradLinear):
    @staticmethod
    def factor_sizes(module, g_out):
        return math.prod(module.input0.shape[1:-1]), module.out_features, module.in_features

    factors = staticmethod(linear_factors)


class _Conv2dWeightFactors(_WeightFactorsWherePaying, BatchGradConv2d):
    @staticmethod
    def factor_sizes(module, g_out):
        if not conv2d_has_factors(module):
            return None
        return math.prod(g_out[0].shape[2:]), module.out_channels, module.weight[0].numel()

    factors = staticmethod(conv2d_factors)


class _CheckedConv2d(BatchGradConv2d):
    """BackPACK's Conv2d BatchGrad, refusing the layers it would get wrong."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        if not batch_grad_is_exact(module):
            raise _inexact_batch_grad(module)
        return self._make_param_function("weight")(ext, module, g_inp, g_out, backproped)


class CheckedBatchGrad(BatchGrad):
    """BackPACK's ``BatchGrad`` (savefield ``grad_batch``), with a clear error for the Conv2d
    layers whose per-sample weight gradients it would get wrong (:func:`batch_grad_is_exact`)."""

    def __init__(self):
        super().__init__()
        self.set_module_extension(Conv2d, _CheckedConv2d(), overwrite=True)


class GradBatchFactors(BatchGrad):
    """BackPACK extension: ``BatchGrad``, except that Linear and Conv2d weights get factors.

    Saves to ``grad_batch_factors``: a :class:`WeightFactors` for the weight of every Linear layer
    and of every Conv2d layer :func:`conv2d_has_factors` covers where :func:`factors_pay` (every
    one of them if ``force``), BackPACK's ``grad_batch`` tensor for every other parameter
    (biases, other layers).

    Args:
        force (bool, optional): Factors wherever they are possible, even where materialising
            is cheaper. Defaults to ``False``.
    """

    def __init__(self, force=False):
        super().__init__()
        self.savefield = "grad_batch_factors"
        self.set_module_extension(Linear, _LinearWeightFactors(force), overwrite=True)
        self.set_module_extension(Conv2d, _Conv2dWeightFactors(force), overwrite=True)
