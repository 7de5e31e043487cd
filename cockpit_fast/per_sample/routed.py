"""Calls whose rows are not the batch's samples: routed tokens, flattened token rows.

A mixture-of-experts layer flattens the tokens of every sample to rows ``(N * T, D)``, gathers
the rows routed to an expert (``x[index]``, ``index_select``, a boolean mask, row slices or
splits of a sorted copy) and calls the expert on them; a plain MLP may be called on all the
flattened rows. Such a call holds ``R`` rows, not ``N`` samples. Each row's sample is read from
the autograd graph of the call's input, for every step (routing changes): walking back from the
input, a gather maps the rows through its saved indices, a reshape that flattens leading
dimensions repeats each row's sample, elementwise ops and the outputs of other captured calls
(an expert's second layer reads its first's output) keep them, and a tensor holding ``N`` rows
holds the samples. Where the graph says nothing (an input without a graph, an op not known
here) and ``R = k * N``, the rows are taken sample-major (row ``r`` of sample ``r // k``) only
where every sample's loss is at hand, to prove it.

The call is then regrouped into a per-sample call (:class:`Regrouping`): its row-aligned
arguments and output gradients become ``(N, P, ...)`` with ``P`` the most rows any sample has,
zero-padded. A zero output-gradient row adds nothing, so the module's rule (a Linear's
factored gradients over ``P`` positions) and the replay stay exact. The engine's proof checks
the regrouped call like any other (:func:`.capture.mixed_calls`: a row given to the wrong
sample is weighted by another sample's weight in the proof's pass), so a wrong grouping takes
the whole graph, never gives wrong numbers.
"""

import math

import torch

from cockpit_fast.per_sample import shared

_ELEMENTWISE = {  # row by row: a row of the output comes from the same row of the inputs
    "ReluBackward0", "GeluBackward0", "SiluBackward0", "TanhBackward0", "SigmoidBackward0", "EluBackward0",
    "LeakyReluBackward0", "HardtanhBackward0", "SoftplusBackward0", "ThresholdBackward0", "NegBackward0",
    "ExpBackward0", "PowBackward0", "MulBackward0", "DivBackward0", "AddBackward0", "SubBackward0",
    "CloneBackward0", "ToCopyBackward0", "AliasBackward0", "NativeDropoutBackward0",
}
_VIEWS = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"}
# What the graph reads for most calls: row r is sample r, of the batch's N rows. Kept as this
# marker, not as arange(N), until a gather picks rows (a model's every call reads it each step).
EACH_ROW_ITS_SAMPLE = "each row its sample"
# What the graph reads above a transpose or permute that moved dimension 0: rows that may hold
# anything (windows taken window-major), so that no tensor below is taken for the samples by
# its N rows alone.
MOVED = "dimension 0 moved"


class Regrouping:
    """Rows ``(R, ...)`` of a call as ``(N, P, ...)``, each sample's rows in order, zero-padded.

    Args:
        samples (torch.Tensor): ``(R,)`` the sample of each row, in ``[0, n)``.
        n (int): N, the batch's samples.
        guessed (bool): The samples were taken sample-major, not read from the graph.
    """

    def __init__(self, samples, n, guessed=False):
        self.rows, self.n, self.guessed = samples.shape[0], n, guessed
        counts = torch.bincount(samples, minlength=n)
        self.positions = int(counts.max()) if self.rows else 0  # P
        order = torch.argsort(samples, stable=True)
        first_row = torch.cumsum(counts, 0) - counts  # of each sample, in the sorted order
        slot = torch.empty_like(samples)
        slot[order] = torch.arange(self.rows, device=samples.device) - first_row[samples[order]]
        self._destination = samples * self.positions + slot

    def __call__(self, t):
        """``t`` regrouped where it holds the call's rows along dimension 0, else as it is."""
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != self.rows:
            return t
        out = t.new_zeros(self.n * self.positions, *t.shape[1:])
        out.index_copy_(0, self._destination, t.detach())
        return out.view(self.n, self.positions, *t.shape[1:])

    @property
    def samples(self):
        """``(R,)``: the sample of each of the call's rows, in their order."""
        return self._destination // max(1, self.positions)

    def rows_of(self, t):
        """A regrouped ``(N, P, ...)`` tensor's rows as the call had them, ``(R, ...)`` (the
        padding left out); anything else as it is."""
        if not isinstance(t, torch.Tensor) or t.shape[:2] != (self.n, self.positions):
            return t
        return t.flatten(0, 1).index_select(0, self._destination)

    def shape(self, shape):
        """The regrouped shape of a tensor of ``shape`` holding the call's rows."""
        return torch.Size((self.n, self.positions, *shape[1:])) if shape and shape[0] == self.rows else shape


def regroup(calls, n, guess):
    """Regroups ``calls`` whose rows are not the ``n`` samples into per-sample calls, where each
    row's sample is read from the graph, or taken sample-major where ``n`` divides the rows and
    ``guess(call)`` (the engine: where its proof checks it, or checked it). Calls taken
    time-first, shared by every sample, regrouped already or given packed sequences (whose rows
    are tokens that the batch sizes assign) are left as they are, as are those whose rows cannot
    be told apart (the engine's checks then send them to the whole graph)."""
    if n == 0:
        return
    memo = {}
    for call in calls:
        if call.routed is not None or call.shared or call.packed or call.sample_dim != 0 or not call.output_shapes:
            continue
        rows = call.output_shapes[0][0] if len(call.output_shapes[0]) else None
        # No rows: no sample, whatever the graph says.
        samples, guessed = (torch.zeros(0, dtype=torch.long) if rows == 0 else _call_rows(call, n, memo)), False
        if samples is None and rows is not None and rows != n and rows % n == 0 and guess(call):
            samples, guessed = torch.arange(rows) // (rows // n), True
        elif samples is not None and rows and _count(samples, n) != rows and guess(call):
            # Rows flattened inside the call from its input's (a router's view(-1, D)), sample-major.
            first = next(a for a in call.args if isinstance(a, torch.Tensor))
            samples, guessed = _reshaped(samples, n, first.shape, call.output_shapes[0]), True
        if samples is None or _count(samples, n) != rows or _is_identity(samples, n):
            continue
        device = next((a.device for a in call.args if isinstance(a, torch.Tensor)), samples.device)
        _apply(call, Regrouping(samples.to(device), n, guessed))


def _apply(call, regrouping):
    if regrouping.guessed:  # (what ungroup() takes back, where the proof refutes the guess)
        call.ungrouped = call.args, call.kwargs, call.output_shapes, call.batch_size
    call.args = tuple(regrouping(a) for a in call.args)
    call.kwargs = {k: regrouping(v) for k, v in call.kwargs.items()}
    call.output_shapes = [regrouping.shape(s) for s in call.output_shapes]
    call.batch_size, call.routed, call._replayed = regrouping.n, regrouping, None


def ungroup(call):
    """Takes back a regrouping of ``call``'s rows (one guessed sample-major that the proof then
    refuted: positions looked up once for every sample, as many as a multiple of N)."""
    call.args, call.kwargs, call.output_shapes, call.batch_size = call.ungrouped
    call.ungrouped_from, call.routed, call._replayed = call.routed, None, None


def _is_identity(samples, n):
    if samples is EACH_ROW_ITS_SAMPLE:
        return True
    return samples.shape[0] == n and torch.equal(samples, torch.arange(n, device=samples.device))


def _count(samples, n):
    """The rows ``samples`` (a tensor, or :data:`EACH_ROW_ITS_SAMPLE`) gives a sample."""
    return n if samples is EACH_ROW_ITS_SAMPLE else samples.shape[0]


def _tensor(samples, n):
    """``samples`` as a ``(rows,)`` tensor."""
    return torch.arange(n) if samples is EACH_ROW_ITS_SAMPLE else samples


def _call_rows(call, n, memo):
    """``(R,)`` the sample of each row of ``call``'s first tensor input (or
    :data:`EACH_ROW_ITS_SAMPLE`), or None."""
    if call.input_node is None:
        return None
    node, output_nr = call.input_node
    samples = _rows(node, output_nr, n, memo, 0)
    return None if samples is MOVED else samples


def _rows(node, nr, n, memo, depth):
    """``(rows,)`` the sample of each row (dimension 0) of output ``nr`` of ``node`` (or
    :data:`EACH_ROW_ITS_SAMPLE`), or None (:data:`MOVED` where a transpose above moved them)."""
    if node is None or depth > 256:
        return None
    key = (node, nr, depth > 0)  # the call's own input never defaults to the samples
    if key not in memo:
        memo[key] = None  # a cycle through calls reads nothing
        memo[key] = _read(node, nr, n, memo, depth)
    return memo[key]


def _read(node, nr, n, memo, depth):
    shape = node._input_metadata[nr].shape if nr < len(node._input_metadata) else None
    if not shape:
        return None
    name = type(node).__name__
    parents = node.next_functions
    parent = (lambda: _rows(*parents[0], n, memo, depth + 1)) if parents else (lambda: None)  # noqa: E731
    # Gathers first: their rows are their index's, whatever their number.
    if name == "IndexBackward0":
        index = _row_index(node._saved_indices)
        above = None if index is None else parent()
        return above if above is None or above is MOVED else _tensor(above, n)[index.cpu()]
    if name == "IndexSelectBackward0" and node._saved_dim == 0:
        above = parent()
        return above if above is None or above is MOVED else _tensor(above, n)[node._saved_index.cpu()]
    if name == "SliceBackward0" and node._saved_dim == 0:
        above = parent()
        if above is None or above is MOVED or above is EACH_ROW_ITS_SAMPLE and shape[0] == n:  # (all the rows, in order)
            return above
        return _tensor(above, n)[node._saved_start : node._saved_end : node._saved_step]
    if name in ("SplitBackward0", "SplitWithSizesBackward0") and node._saved_dim == 0:
        sizes = node._saved_split_sizes if name == "SplitWithSizesBackward0" else None
        start = sum(sizes[:nr]) if sizes is not None else nr * node._saved_split_size
        above = parent()
        if above is None or above is MOVED or above is EACH_ROW_ITS_SAMPLE and shape[0] == n:
            return above
        return _tensor(above, n)[start : start + shape[0]]
    for ref in node.metadata.get(shared.CALL_TAG, ()):  # the output of a captured call: its input's rows
        call = ref()
        if call is not None and call.input_node is not None:
            above = _rows(*call.input_node, n, memo, depth + 1)
            if above is MOVED or above is not None and _count(above, n) == shape[0]:
                return above
    if name in _VIEWS and parents and parents[0][0] is not None:
        above = parent()
        above = above if above is None or above is MOVED else _reshaped(above, n, parents[0][0]._input_metadata[parents[0][1]].shape, shape)
        if above is not None:
            return above
    if name in _ELEMENTWISE or _keeps_rows(node, name, len(shape)):
        moved = False  # (an input whose rows a transpose moved: read from another, else from none)
        for next_node, next_nr in parents:
            if next_node is not None and _leading(next_node, next_nr) == shape[0]:
                above = _rows(next_node, next_nr, n, memo, depth + 1)
                moved |= above is MOVED
                if above is not None and above is not MOVED:
                    return above
        if moved:
            return MOVED
    if name in ("TransposeBackward0", "PermuteBackward0"):  # (dimension 0 moved: its N rows may be windows)
        return MOVED
    # Rows read from nowhere above: a tensor of N rows holds the samples (but the call's own input).
    return EACH_ROW_ITS_SAMPLE if depth and shape[0] == n else None


def _keeps_rows(node, name, dims):
    """Whether row ``r`` (dimension 0) of ``node``'s output comes from row ``r`` of its inputs
    of as many rows, besides the elementwise ops: a batched product, an expand, a softmax, a
    permute or a transpose that leave dimension 0 in place (attention within an image's
    windows, each window a row)."""
    signed = lambda d: (d - 2**64 if d >= 2**63 else d) % dims  # noqa: E731 (saved dims come unsigned)
    if name in ("BmmBackward0", "ExpandBackward0"):
        return True
    if name in ("SoftmaxBackward0", "LogSoftmaxBackward0"):
        return signed(node._saved_dim) != 0
    if name == "PermuteBackward0":
        return signed(node._saved_dims[0]) == 0
    if name == "TransposeBackward0":
        return 0 not in (signed(node._saved_dim0), signed(node._saved_dim1))
    return False


def _row_index(indices):
    """The 1-D index of rows of ``x[index]`` (a boolean mask as the rows it keeps), else None."""
    if not indices or indices[0] is None or any(i is not None for i in indices[1:]) or indices[0].dim() != 1:
        return None
    index = indices[0]
    return index.nonzero().squeeze(1) if index.dtype == torch.bool else index


def _leading(node, nr):
    meta = node._input_metadata
    return meta[nr].shape[0] if nr < len(meta) and len(meta[nr].shape) else None


def _reshaped(samples, n, before, after):
    """The samples of the rows of a reshape from ``before`` to ``after``, from those of
    ``before``'s rows; None where a row of ``after`` holds several samples."""
    if not before or not after or math.prod(before) == 0:
        return None
    if after[0] == before[0]:  # the same rows
        return samples
    samples = _tensor(samples, n)
    if after[0] % before[0] == 0:  # leading dimensions flattened: each row splits in k
        return samples.repeat_interleave(after[0] // before[0])
    if before[0] % after[0] == 0:  # rows merged: one sample each, or not read
        merged = samples.reshape(after[0], -1)
        return merged[:, 0] if bool((merged == merged[:, :1]).all()) else None
    return None
