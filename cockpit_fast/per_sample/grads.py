"""How the per-sample gradients of one parameter are held, and the statistics each form gives cheaply.

Every form stands for ``G_n``, n = 0..N-1, the gradients of one parameter for each sample in the
units of the backward pass that produced them (``∇ℓ_n / N`` for a mean loss, as BackPACK's
``grad_batch``). A form offers:

- ``chunks()``: the dense gradients of a few consecutive samples at a time (at most
  :data:`CHUNK_VALUES` values, one sample at least), what any statistic can be computed from;
- ``grad``: the mini-batch gradient ``sum_n G_n``;
- closed forms, each returning None where the form has none and the chunks must serve:
  ``batch_l2``, ``sum_grad_squared``, ``dot``, ``abs_max``, ``hist1d``, ``hist2d``, ``stats``.

:class:`DenseGrads` holds the tensor (N, *shape) itself. :class:`FactoredGrads` holds two factors,
``G_n = sum_t left[n, t] right[n, t]^T`` (Linear and convolution weights), and
:class:`ConvGrads` forms a convolution's a chunk of samples at a time, and
:class:`RowGrads` holds the few rows of an embedding table each sample touches.
:class:`SummedGrads` adds the forms of a parameter used several times (a module called twice,
weights tied across modules).
"""

import math
from functools import cached_property, lru_cache

import torch

from cockpit_fast import ops
from cockpit_fast import stats as columns
from cockpit_fast._validation import MAX_P_VALUES, accumulation_dtype

CHUNK_VALUES = 2**22
"""Most per-sample gradient values formed at once where a statistic needs them (16 MiB float32)."""


def factors_pay(positions, left_size, right_size):
    """Whether per-sample gradients are cheaper to work with as factors: one outer product each,
    or factors (``positions * (p + q)`` values a sample) smaller than the gradient (``p * q``)."""
    return positions == 1 or positions * (left_size + right_size) < left_size * right_size


def samples_per_chunk(values_per_sample):
    """How many samples one chunk holds when each forms ``values_per_sample`` values (:data:`CHUNK_VALUES`)."""
    return max(1, CHUNK_VALUES // max(1, values_per_sample))


class Scratch:
    """Memory that formed chunks take in turn, each that of the one before: a new tensor for each
    costs the first touch of its pages on the CPU (4096 page faults for a 16 MiB chunk), about
    as long as forming the chunk."""

    def __init__(self):
        self._memory = None

    def tensor(self, shape, dtype, device):
        """An uninitialised tensor in the memory (valid until the next one is asked for)."""
        n, memory = math.prod(shape), self._memory
        if memory is None or memory.numel() < n or memory.dtype != dtype or memory.device != device:
            memory = self._memory = torch.empty(n, dtype=dtype, device=device)
        return memory[:n].view(shape)


def _widened(out, dtype):
    """``out``, or a copy in the wider dtype where ``dtype`` is wider: parts of one parameter's
    gradients may come in different precisions (autocast's bf16 head tied to an fp32 embedding)."""
    wide = torch.promote_types(out.dtype, dtype)
    return out if wide == out.dtype else out.to(wide)


def _acc(t):
    return t.to(accumulation_dtype(t.dtype))


def held_tensors(form, cached=True):
    """The tensors ``form`` holds (its factors, rows, dense gradients, inner forms'), each once;
    without ``cached``, only those the gradients follow from (not the sum ``grad`` once read)."""
    found = {}
    _walked(form, lambda tensor: found.setdefault(id(tensor), tensor), lambda form, fields: None, cached)
    return list(found.values())


def _walked(item, on_tensor, on_form, cached=False):
    """``item`` (a form, its tensors, lists of them) rebuilt: each tensor as ``on_tensor(tensor)``,
    each form as ``on_form(form, fields)`` of its fields walked (without ``cached``, not the sum
    ``grad`` once read)."""
    if isinstance(item, torch.Tensor):
        return on_tensor(item)
    if isinstance(item, (list, tuple)):
        return type(item)(_walked(value, on_tensor, on_form, cached) for value in item)
    if isinstance(item, PerSampleGrads):
        fields = {name: _walked(value, on_tensor, on_form, cached) for name, value in vars(item).items() if cached or name != "grad"}
        return on_form(item, fields)
    return item


def held_bytes(form):
    """Bytes of the tensors ``form`` holds: what keeping it costs."""
    return sum(t.numel() * t.element_size() for t in held_tensors(form))


class PerSampleGrads:
    """Base of the forms: N per-sample gradients of a parameter of shape ``shape``."""

    batch_size: int
    shape: torch.Size

    FRESH_RANGES = False
    """Whether :meth:`dense_range` returns a new tensor that the caller may change in place."""

    keepable = False
    """Whether :class:`Kept` may keep the form itself: its gradients follow from the tensors it
    holds alone (not from parameters' values or hooks, which change by a later step), and its dot
    products need no formed gradient (factors, embedding rows)."""

    computed_in = None
    """The least precise dtype the calls that made the form computed in (autocast's bfloat16,
    say, inside a call that takes and returns float32): the precision of the parameter's own
    gradient, which the engine's sum check holds the form to."""

    @cached_property
    def grad(self):
        """The mini-batch gradient ``sum_n G_n``."""
        return sum(chunk.sum(0) for chunk in self.chunks())

    def ranges(self, size=None):
        """``(start, stop)`` of ``size`` consecutive samples at a time (the last range may be
        smaller); by default as many as :data:`CHUNK_VALUES` allows."""
        size = size or samples_per_chunk(self.formed_per_sample)
        return [(start, min(start + size, self.batch_size)) for start in range(0, self.batch_size, size)] or [(0, 0)]

    def chunks(self, size=None, scratch=None):
        """Dense gradients ``(c, *shape)`` of each of :meth:`ranges` (no samples: one empty chunk);
        with a :class:`Scratch`, formed in its memory where the form forms them (the caller reads
        each chunk before it asks for the next, and keeps none)."""
        for start, stop in self.ranges(size):
            yield self.dense_range(start, stop) if scratch is None else self.range_in(start, stop, scratch)

    def binned_ranges(self, directions, bins, range, hist_scale, dtype):
        """:func:`cockpit_fast.ops.hist1d_batch_l2_batch_dots` of each of :meth:`ranges` against
        the list of ``directions``, without writing the gradients to memory; None where the form
        cannot, or holds them in another dtype than ``dtype``."""
        return None

    @property
    def formed_per_sample(self):
        """How many values forming one sample's gradient takes (more than the gradient's where
        other parameters are formed alongside it)."""
        return math.prod(self.shape)

    def dense_range(self, start, stop):
        """The dense gradients of samples ``start`` to ``stop``, ``(stop - start, *shape)``."""
        raise NotImplementedError

    def range_in(self, start, stop, scratch):
        """:meth:`dense_range`, formed in ``scratch``'s memory where the form forms the
        gradients (then the caller's to change until the next chunk, as :attr:`FRESH_RANGES`
        says of the form's ranges; else as :meth:`dense_range` gives them)."""
        return self.dense_range(start, stop)

    def dense(self):
        """All N gradients as one ``(N, *shape)`` tensor."""
        return self.dense_range(0, self.batch_size)

    def magnitude(self):
        """The absolute values of the terms ``grad`` sums, added up entry by entry (at least
        ``sum_n |G_n|``): the scale of its rounding, for checking it against another sum."""
        return sum(chunk.abs().sum(0) for chunk in self.chunks())

    def add_range_to(self, out, start, stop):
        """``out`` (``(stop - start, *shape)``, changed in place) plus the gradients of samples
        ``start`` to ``stop``, in the wider of the two dtypes (a new tensor where that is not out's)."""
        addend = self.dense_range(start, stop)
        out = _widened(out, addend.dtype)
        out += addend
        return out

    def batch_l2(self, force=False):
        """(N,) squared norms; ``force``: the closed form even where forming is cheaper."""
        return None

    def sum_grad_squared(self):
        return None

    def dot(self, direction):
        return None

    def formed_dots(self, direction):
        """(N,) ``<G_n, direction>`` from the gradients formed a chunk at a time, for a kept form
        without a closed form (:meth:`dot`)."""
        return torch.cat([ops.batch_dot(chunk.to(direction.dtype), direction) for chunk in self.chunks()])

    def row_dots(self, direction):
        """(N, rows): ``<G_n[r], direction[r]>`` for each row ``r`` of the first dimension, in
        closed form; None without one."""
        return None

    def abs_max(self, scale):
        return None

    def hist1d(self, bins, range, scale):
        return None

    def hist2d(self, param, bins, range, scale):
        return None

    def stats(self, p_values):
        """:func:`cockpit_fast.ops.per_sample_stats` rows ``(N, 5 + len(p_values))`` for any number
        of p values, or None."""
        return None


class DenseGrads(PerSampleGrads):
    """The per-sample gradients as one tensor ``(N, *shape)``; every statistic from the ops.

    Args:
        terms (list[torch.Tensor], optional): What ``values`` sums over dimension 1, ``(N, T,
            *part)`` each, the parts concatenated along the last dimension (a bias's output
            gradients over positions): their absolute values are the scale of its rounding,
            which its sums may have cancelled (a key projection's bias, zero in exact arithmetic).
    """

    def __init__(self, values, terms=None):
        self.values = values.detach()
        self.batch_size, self.shape = values.shape[0], values.shape[1:]
        self._terms = terms

    @cached_property
    def grad(self):
        return self.values.sum(0)

    def chunks(self, size=None, scratch=None):
        if size is None or size >= self.batch_size:  # no copy: the ops read it as it is
            yield self.values
        else:
            yield from super().chunks(size, scratch)

    def dense_range(self, start, stop):
        return self.values[start:stop]

    def magnitude(self):
        if self._terms is None:
            return self.values.abs().sum(0)
        return torch.cat([t.abs().sum((0, 1)) for t in self._terms], -1)

    def stats(self, p_values):
        return stats_in_groups(self.values, p_values)


class FactoredGrads(PerSampleGrads):
    """``G_n = sum_t left[n, t] right[n, t]^T``, reshaped to ``shape``.

    Args:
        left (torch.Tensor): ``(N, T, p)``; for a Linear weight the output gradient.
        right (torch.Tensor): ``(N, T, q)``; for a Linear weight the input (unfolded for a
            convolution).
        shape (torch.Size): The parameter's shape, ``p * q`` elements.

    With ``T = 1`` each gradient is one outer product: norms and dot products come from matrix
    products of the factors, histograms from :func:`cockpit_fast.ops.outer_hist1d` /
    :func:`~cockpit_fast.ops.outer_hist2d` (the very products a dense gradient holds), and no
    per-sample gradient is formed. Otherwise norms take the Gram form over positions where
    :func:`factors_pay`, dot products matrix products, and the rest the chunks.
    """

    FRESH_RANGES = True

    def __init__(self, left, right, shape):
        self.left, self.right = left.detach(), right.detach()
        self.shape = torch.Size(shape)
        self.batch_size, self.positions, self.left_size = left.shape
        self.right_size = right.shape[-1]

    @property
    def is_outer_product(self):
        """Whether each ``G_n`` is one outer product."""
        return self.positions == 1

    keepable = True

    @property
    def pays(self):
        """Whether the factors are smaller than the gradients they stand for."""
        return factors_pay(self.positions, self.left_size, self.right_size)

    def _as_matrix(self, t):
        return t.reshape(self.left_size, self.right_size)

    @cached_property
    def grad(self):
        left = self.left.flatten(0, 1)
        return (left.T @ self.right.flatten(0, 1)).reshape(self.shape)

    def dense_range(self, start, stop):
        return self._formed(start, stop)

    def range_in(self, start, stop, scratch):
        dtype = torch.promote_types(self.left.dtype, self.right.dtype)
        return self._formed(start, stop, scratch.tensor((stop - start, self.left_size, self.right_size), dtype, self.left.device))

    def _formed(self, start, stop, out=None):
        left, right = self.left[start:stop], self.right[start:stop]
        if self.is_outer_product:  # a product by broadcasting: a batched product of depth 1 is 3x slower
            return torch.mul(left[:, 0, :, None], right[:, 0, None, :], out=out).reshape(-1, *self.shape)
        return torch.bmm(left.transpose(1, 2), right, out=out).reshape(-1, *self.shape)

    def magnitude(self):
        return (self.left.flatten(0, 1).abs().T @ self.right.flatten(0, 1).abs()).reshape(self.shape)

    def batch_l2(self, force=False):
        left, right = _acc(self.left), _acc(self.right)
        if self.is_outer_product:
            return (left[:, 0] ** 2).sum(1) * (right[:, 0] ** 2).sum(1)
        if not (self.pays or force):
            return None
        return (left @ left.transpose(1, 2) * (right @ right.transpose(1, 2))).sum((1, 2))

    def sum_grad_squared(self):
        if not self.is_outer_product:
            return None
        left, right = _acc(self.left[:, 0]), _acc(self.right[:, 0])
        return ((left**2).T @ right**2).reshape(self.shape)

    def dot(self, direction):
        return self._left_dots(direction).sum(1)

    def row_dots(self, direction):
        return self._left_dots(direction) if self.shape[0] == self.left_size else None

    def _left_dots(self, direction):
        """(N, left_size): the dot products by entry of the left factor (summed over positions)."""
        d = self._as_matrix(_acc(direction))
        left, right = _acc(self.left), _acc(self.right)
        return ((right @ d.T) * left).sum(1)

    def abs_max(self, scale):
        # The largest product is the product of the largest factors, exactly in floating point.
        if not self.is_outer_product:
            return None
        largest = self.left[:, 0].abs().amax(1) * self.right[:, 0].abs().amax(1)
        return (scale * _acc(largest)).abs().max()

    def hist1d(self, bins, range, scale):
        if not self.is_outer_product:
            return None
        return ops.outer_hist1d(self.left[:, 0], self.right[:, 0], bins, range, scale)

    def binned_ranges(self, directions, bins, range, hist_scale, dtype):
        if self.left.dtype != dtype:  # formed in a layer's autocast dtype: the chunks convert it
            return None
        shape = (self.left_size, self.right_size)
        directions = torch.stack([d.reshape(shape) for d in directions]) if directions else self.left.new_empty(0, *shape)
        return [
            ops.factored_hist1d_batch_l2_batch_dots(self.left[start:stop], self.right[start:stop], directions, bins, range, hist_scale)
            for start, stop in self.ranges()
        ]

    def hist2d(self, param, bins, range, scale):
        if not self.is_outer_product:
            return None
        weight = self._as_matrix(param.detach())
        left, right = _read_against(self.left[:, 0], weight), _read_against(self.right[:, 0], weight)
        return ops.outer_hist2d(left, right, weight, bins, range, scale)

    def stats(self, p_values):
        if not self.is_outer_product:
            return None
        left, right = self.left[:, 0], self.right[:, 0]
        # In float64: each factor's p-th powers can overflow or vanish in float32 where the
        # products' do not.
        wide = _outer_product_stats(
            stats_in_groups(left.double(), p_values), left.shape[1], stats_in_groups(right.double(), p_values), right.shape[1]
        )
        return wide.to(accumulation_dtype(left.dtype))

    def joined(self, other):
        """One :class:`FactoredGrads` for the sum of ``self`` and ``other`` (positions joined)."""
        return FactoredGrads(torch.cat([self.left, other.left], 1), torch.cat([self.right, other.right], 1), self.shape)


class ConvGrads(PerSampleGrads):
    """Per-sample gradients of a convolution's weight (1, 2 or 3 spatial dimensions, any groups).

    Args:
        padded_input (torch.Tensor): ``(N, in, *spatial)``, padded as the layer pads it.
        output_grad (torch.Tensor): ``(N, out, *spatial')``.
        shape (torch.Size): The weight's shape ``(out, in / groups, *kernel)``.
        stride, dilation (tuple), groups (int): The layer's.

    A chunk of samples is formed as the weight gradient of one convolution with a group per
    sample (and per group of the layer), each mapping its sample's input channels to its
    output channels: one weight-gradient product, where the factors of the unfolded input
    would copy the input once per kernel position.
    """

    FRESH_RANGES = True

    def __init__(self, padded_input, output_grad, shape, stride, dilation, groups):
        self.input, self.output_grad = padded_input.detach(), output_grad.detach()
        self.batch_size, self.shape = padded_input.shape[0], torch.Size(shape)
        self.stride, self.dilation, self.groups = list(stride), list(dilation), groups

    def dense_range(self, start, stop):
        c = stop - start
        if c == 0:
            return self.input.new_zeros(0, *self.shape)
        x = self.input[start:stop].flatten(0, 1).unsqueeze(0)  # (1, c * in, *spatial)
        g = self.output_grad[start:stop].flatten(0, 1).unsqueeze(0)  # (1, c * out, *spatial')
        weight = x.new_empty(c * self.shape[0], *self.shape[1:])  # read for its shape only
        zeros = [0] * len(self.stride)
        _, grad, _ = torch.ops.aten.convolution_backward(
            g, x, weight, None, self.stride, zeros, self.dilation, False, zeros, c * self.groups, [False, True, False]
        )
        return grad.reshape(c, *self.shape)

    def magnitude(self):
        # The weight gradient of the absolute values: every product |g| |x| the gradient sums.
        zeros = [0] * len(self.stride)
        weight = self.input.new_empty(self.shape)  # read for its shape only
        _, grad, _ = torch.ops.aten.convolution_backward(
            self.output_grad.abs(), self.input.abs(), weight, None, self.stride, zeros, self.dilation, False, zeros,
            self.groups, [False, True, False],
        )
        return grad


class RowGrads(PerSampleGrads):
    """Gradients of an embedding table (V, D): each sample touches a few rows.

    Args:
        rows (torch.Tensor): ``(K, D)``, the gradient of each (sample, row) pair that is touched.
        samples (torch.Tensor): ``(K,)``, the sample of each pair.
        indices (torch.Tensor): ``(K,)``, the table row of each pair.
        batch_size (int): N.
        shape (torch.Size): ``(V, D)``.

    Every other entry is zero: the statistics count the zeros without forming them.
    """

    keepable = True

    def __init__(self, rows, samples, indices, batch_size, shape):
        self.rows, self.samples, self.indices = rows.detach(), samples, indices
        self.batch_size, self.shape = batch_size, torch.Size(shape)

    @classmethod
    def from_lookups(cls, ids, output_grads, num_rows, skip=None):
        """The rows of a lookup ``table[ids]``: ``ids`` (N, *) and its output gradient (N, *, D);
        lookups of row ``skip`` (a padding index) get no gradient."""
        n, width = ids.shape[0], output_grads.shape[-1]
        ids = ids.reshape(n, -1)
        samples = torch.arange(n, device=ids.device).unsqueeze(1).expand_as(ids)
        pairs = (samples * num_rows + ids).reshape(-1)
        grads = output_grads.reshape(-1, width)
        if skip is not None:
            grads = grads.masked_fill((ids.reshape(-1) == skip).unsqueeze(1), 0)
        # A row a sample looks up twice sums. Not torch.unique: its size, known on the device only,
        # would stop the host. A slot per lookup instead: each run of one pair sums into its first
        # slot, the slots left over stay zero rows at (sample 0, row 0). Zero rows, like the padding
        # lookups', change no statistic: they are counted as the zeros they stand for.
        ordered, order = pairs.sort()
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        slot = first.cumsum(0) - 1
        rows = grads.new_zeros(pairs.shape[0], width).index_add_(0, slot, grads[order])
        keys = torch.zeros_like(pairs).scatter_(0, slot, ordered)
        return cls(rows, keys // num_rows, keys % num_rows, n, (num_rows, width))

    @cached_property
    def grad(self):
        return self.rows.new_zeros(self.shape).index_add_(0, self.indices, self.rows)

    def magnitude(self):
        return self.rows.new_zeros(self.shape).index_add_(0, self.indices, self.rows.abs())

    FRESH_RANGES = True

    def dense_range(self, start, stop):
        return self.add_range_to(self.rows.new_zeros(stop - start, *self.shape), start, stop)

    def add_range_to(self, out, start, stop):
        # Every row, those of other samples as zeros: a selection's size would stop the host.
        local = self.samples - start
        inside = (local >= 0) & (local < stop - start)
        out = _widened(out, self.rows.dtype)
        rows = self.rows.masked_fill(~inside.unsqueeze(1), 0).to(out.dtype)
        out.index_put_((local.clamp(0, stop - start - 1), self.indices), rows, accumulate=True)
        return out

    def batch_l2(self, force=False):
        squares = (_acc(self.rows) ** 2).sum(1)
        return squares.new_zeros(self.batch_size).index_add_(0, self.samples, squares)

    def sum_grad_squared(self):
        squares = _acc(self.rows) ** 2
        return squares.new_zeros(self.shape).index_add_(0, self.indices, squares)

    def dot(self, direction):
        products = (_acc(self.rows) * _acc(direction)[self.indices]).sum(1)
        return products.new_zeros(self.batch_size).index_add_(0, self.samples, products)

    def abs_max(self, scale):
        if self.rows.numel() == 0:  # every entry is zero
            return torch.zeros((), dtype=accumulation_dtype(self.rows.dtype), device=self.rows.device)
        return (scale * _acc(self.rows)).abs().amax()

    def _zeros(self):
        """How many entries of the N gradients are zero without being a touched row's."""
        return self.batch_size * math.prod(self.shape) - self.rows.numel()

    def hist1d(self, bins, range, scale):
        touched = ops.hist1d(self.rows.unsqueeze(0), bins, range, scale)
        zero = ops.hist1d(self.rows.new_zeros(1, 1), bins, range, scale)
        return touched + self._zeros() * zero

    def hist2d(self, param, bins, range, scale):
        # Touched rows against their parameter rows, plus zeros against every row of every
        # sample except the touched ones.
        param = param.detach()
        rows = _read_against(self.rows, param)
        touched_params = param[self.indices]
        touched = ops.hist2d(rows.unsqueeze(0), touched_params, bins, range, scale)
        all_zero = ops.hist2d(param.new_zeros(1, *self.shape), param, bins, range, scale)
        touched_zero = ops.hist2d(rows.new_zeros(1, *touched_params.shape), touched_params, bins, range, scale)
        return touched + self.batch_size * all_zero - touched_zero


class ZeroGrads(PerSampleGrads):
    """N zero gradients of a parameter of ``shape`` (one no backward pass of a micro-batch
    reached): every statistic in closed form, nothing formed (an unchosen expert costs what its
    histogram's one zero does)."""

    keepable = True

    def __init__(self, batch_size, param):
        self.batch_size, self.shape = batch_size, param.shape
        self.zero = torch.zeros((), dtype=param.dtype, device=param.device)  # (a tensor: moved with a kept form)

    def _zeros(self, *shape, accumulated=True):
        dtype = accumulation_dtype(self.zero.dtype) if accumulated else self.zero.dtype
        return self.zero.new_zeros(shape, dtype=dtype)

    @cached_property
    def grad(self):
        return self._zeros(*self.shape, accumulated=False)

    def dense_range(self, start, stop):
        return self._zeros(stop - start, *self.shape, accumulated=False)

    def magnitude(self):
        return self.grad

    def batch_l2(self, force=False):
        return self._zeros(self.batch_size)

    def sum_grad_squared(self):
        return self._zeros(*self.shape)

    def dot(self, direction):
        return self._zeros(self.batch_size)

    def row_dots(self, direction):
        return self._zeros(self.batch_size, self.shape[0]) if self.shape else None

    def abs_max(self, scale):
        return self._zeros()

    def hist1d(self, bins, range, scale):
        zero = _zero_hist1d(bins, tuple(range), scale, self.zero.dtype, self.zero.device)
        return self.batch_size * math.prod(self.shape) * zero

    def hist2d(self, param, bins, range, scale):
        param = param.detach()
        return self.batch_size * ops.hist2d(param.new_zeros(1, *self.shape), param, bins, range, scale)


@lru_cache(maxsize=16)
def _zero_hist1d(bins, range, scale, dtype, device):
    """hist1d of one zero: the same for every unreached parameter of a step (an op call each costs
    more than the rest of its statistics)."""
    return ops.hist1d(torch.zeros(1, 1, dtype=dtype, device=device), bins, range, scale)


class SummedGrads(PerSampleGrads):
    """The per-sample gradients of a parameter used several times: the sum of each use's form."""

    def __init__(self, parts):
        self.parts = parts
        self.batch_size, self.shape = parts[0].batch_size, parts[0].shape

    @property
    def keepable(self):
        return all(part.keepable for part in self.parts)

    @property
    def formed_per_sample(self):
        return sum(part.formed_per_sample for part in self.parts)

    @cached_property
    def grad(self):
        return sum(part.grad for part in self.parts)

    def magnitude(self):
        return sum(part.magnitude() for part in self.parts)

    FRESH_RANGES = True

    def dense_range(self, start, stop):
        # One part's gradients are formed and the others added into them: embedding rows by
        # index, without a zero tensor of their own.
        first, *rest = sorted(self.parts, key=lambda part: isinstance(part, RowGrads))
        out = first.dense_range(start, stop)
        if not first.FRESH_RANGES:
            out = out.clone()
        for part in rest:
            out = part.add_range_to(out, start, stop)
        return out

    def dot(self, direction):  # linear in G_n: the sum of the parts'
        values = [part.dot(direction) for part in self.parts]
        return None if any(v is None for v in values) else sum(values)


class _Wrapped(PerSampleGrads):
    """The per-sample gradients of another ``form``, changed sample by sample."""

    FRESH_RANGES = True

    def __init__(self, form):
        self.form = form
        self.batch_size, self.shape = form.batch_size, form.shape

    @property
    def formed_per_sample(self):
        return self.form.formed_per_sample


class ScaledGrads(_Wrapped):
    """``factor`` times another form's gradients: a ``GradScaler``'s scale divided out of those
    of a scaled loss's backward pass. Every statistic is the inner form's, rescaled."""

    def __init__(self, form, factor):
        super().__init__(form)
        self.factor = factor

    @property
    def keepable(self):
        return self.form.keepable

    @cached_property
    def grad(self):
        return self.form.grad * self.factor

    def dense_range(self, start, stop):
        return self.form.dense_range(start, stop) * self.factor

    def magnitude(self):
        return self.form.magnitude() * abs(self.factor)

    def batch_l2(self, force=False):
        return _rescaled(self.form.batch_l2(force), self.factor**2)

    def sum_grad_squared(self):
        return _rescaled(self.form.sum_grad_squared(), self.factor**2)

    def dot(self, direction):
        return _rescaled(self.form.dot(direction), self.factor)

    def abs_max(self, scale):
        return self.form.abs_max(scale * self.factor)

    def hist1d(self, bins, range, scale):
        return self.form.hist1d(bins, range, scale * self.factor)

    def hist2d(self, param, bins, range, scale):
        return self.form.hist2d(param, bins, range, scale * self.factor)


def _read_against(t, param):
    """``t`` formed in a layer's compute dtype (autocast's, FSDP2's bf16 parameters) in the
    dtype of the parameter whose values a histogram reads beside it."""
    return t.to(param.dtype) if t.dtype != param.dtype and param.is_floating_point() else t


def _rescaled(value, factor):
    return None if value is None else value * factor


class HookedGrads(_Wrapped):
    """The per-sample gradients after the user's hooks on the parameter (``param.register_hook``:
    a pruning mask, a clip), applied to each sample's gradient, as autograd applies them to the
    mini-batch gradient and gradient-metrics to each sample's."""

    def __init__(self, form, hooks):
        super().__init__(form)
        self.hooks = hooks

    def dense_range(self, start, stop):
        g = self.form.dense_range(start, stop)
        for hook in self.hooks:
            g = torch.stack([_hooked(hook, sample) for sample in g.unbind(0)]) if len(g) else g
        return g


def _hooked(hook, grad):
    out = hook(grad)
    return grad if out is None else out


class Kept:
    """Per-sample gradients kept for a later step (Alpha's projections on the update the optimizer
    makes after the backward pass), as ``forms`` of consecutive samples (chunks, micro-batches):
    each a copy of the parameter's form where :meth:`pays` (its own tensors: an input batch copied
    into one buffer every step changes nothing kept), else the formed gradients (a
    :class:`DenseGrads`).
    """

    FORMS = {cls.__name__: cls for cls in (DenseGrads, FactoredGrads, RowGrads, SummedGrads, ScaledGrads, ZeroGrads)}
    """The forms a :meth:`state` names: those kept (:attr:`~PerSampleGrads.keepable` ones, formed)."""

    def __init__(self, forms):
        self.forms = list(forms)

    @classmethod
    def copied(cls, form):
        """A :class:`Kept` of a copy of ``form`` (one that :meth:`pays`) with tensors of its own."""
        return cls([_walked(form, torch.Tensor.clone, lambda form, fields: _form_of(type(form), fields))])

    @staticmethod
    def pays(form):
        """Whether ``form`` is :attr:`~PerSampleGrads.keepable` and holds its gradients in fewer
        bytes than formed."""
        if not form.keepable:
            return False
        tensors = held_tensors(form, cached=False)
        # Formed in the dtype of its values (an embedding's row indices are int64, its rows not).
        element_size = max(t.element_size() for t in tensors if t.is_floating_point())
        formed = form.batch_size * math.prod(form.shape) * element_size
        return sum(t.numel() * t.element_size() for t in tensors) < formed

    @classmethod
    def joined(cls, parts):
        """One :class:`Kept` of the samples of consecutive ``parts``, each kept as it was (a
        micro-batch's factors are not formed for being one of several)."""
        return cls([form for part in parts for form in part.forms])

    def dot(self, direction):
        """(N,) ``<G_n, direction>``: in closed form where a form has one (a matrix product of
        its factors, no gradient formed), else from its gradients formed a chunk at a time. A
        resumed run restores the same forms, so it gets the same bits."""
        return torch.cat([_closed_or_formed_dots(form, direction) for form in self.forms])

    def state(self):
        """Each form as it is kept, in dicts (``{"class": its name, **fields}``), lists and its
        tensors: what a checkpoint saves (not the formed gradients, N x the parameter). Without
        ``computed_in``, the dtype the step's sum check read."""

        def state(form, fields):
            return {"class": type(form).__name__, **{name: v for name, v in fields.items() if name != "computed_in"}}

        return [_walked(form, lambda tensor: tensor, state) for form in self.forms]

    @classmethod
    def from_state(cls, state):
        """The :class:`Kept` of a :meth:`state` (its tensors where they are)."""

        def form(item):
            if isinstance(item, dict):
                fields = {name: form(value) for name, value in item.items() if name != "class"}
                if "shape" in fields:  # a tuple in a checkpoint
                    fields["shape"] = torch.Size(fields["shape"])
                return _form_of(cls.FORMS[item["class"]], fields)
            if isinstance(item, (list, tuple)):
                return type(item)(form(value) for value in item)
            return item

        return cls(form(state))


def _closed_or_formed_dots(form, direction):
    dots = form.dot(direction)
    return form.formed_dots(direction) if dots is None else dots


def _form_of(kind, fields):
    """A form of class ``kind`` with ``fields``."""
    form = object.__new__(kind)
    form.__dict__ = fields
    return form


def combine(forms):
    """One form for the sum of ``forms`` (the uses of one parameter in one backward pass)."""
    factored = [f for f in forms if isinstance(f, FactoredGrads)]
    if len(factored) == len(forms) and len({(f.left_size, f.right_size) for f in forms}) == 1:
        joined = factored[0]
        for other in factored[1:]:
            joined = joined.joined(other)
        return joined
    return forms[0] if len(forms) == 1 else SummedGrads(forms)


def stats_rows(form, p_values):
    """:func:`cockpit_fast.ops.per_sample_stats` rows of every sample's gradient, for any number
    of p values: in closed form where the form has one, else from its chunks."""
    rows = form.stats(p_values)
    if rows is None:
        rows = torch.cat([stats_in_groups(chunk, p_values) for chunk in form.chunks()])
    return rows


def stats_in_groups(g, p_values):
    """``per_sample_stats`` rows for any number of p values: one op call per group of at most
    MAX_P_VALUES, the groups' p columns joined."""
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
