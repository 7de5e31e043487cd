"""GradientMetricCollector: per-sample gradient metrics of a loss of shape (N,) in one pass.

Same API and values as gradient-metrics 0.5.0, which runs one backward pass per sample. Here the
per-sample engine (:class:`cockpit_fast.per_sample.Engine`, the cockpit's too) gives every
sample's gradients from the module calls it watched in the forward pass, or from batched
backward passes through the whole graph where those cannot, one
``cockpit_fast.ops.per_sample_stats`` call per (parameter, transform) serves every built-in metric,
and the rows of a metric's parameters merge with ``cockpit_fast.stats.merge``.

Slower routes remain for what the batched one cannot serve, each with a one-time warning:
transforms that ``torch.vmap`` cannot batch run sample by sample; metrics whose class overrides
how it collects get their per-sample gradients one sample at a time; and a batched backward pass
that fails falls back to one backward pass per sample, as in the original.
"""

import math
import warnings
from collections import Counter, defaultdict

import torch

from cockpit_fast import stats as columns
from cockpit_fast.gradient_metrics.metrics import GradientMetric, as_floating
from cockpit_fast.per_sample import DenseGrads, Engine, stats_rows

_warned = set()


def warn_once(message):
    """Warns about a slow route the first time each distinct message comes up."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class GradientMetricCollector:
    """Computes gradient metrics for every sample of a batch.

    The collector watches the forward passes from when it is made (:mod:`cockpit_fast.per_sample`):
    make it before the forward pass whose loss it is handed, or that pass takes the slower
    batched route.

    Under ``torch.distributed`` each process gets the rows of its own samples only: the metrics
    are per sample, so nothing is exchanged, and the first call says so once (a RuntimeWarning).
    Gather the rows yourself (``torch.distributed.all_gather``) to see the global batch.

    Args:
        metrics: A :class:`GradientMetric` or a non-empty list of them.

    Raises:
        ValueError: If ``metrics`` is empty, not a metric, or holds something that is not a metric.
    """

    def __init__(self, metrics):
        if isinstance(metrics, list):
            for metric in metrics:
                if not isinstance(metric, GradientMetric):
                    raise ValueError(
                        "'metrics' needs to be a list of 'GradientMetric' instances. "
                        f"Found {metric.__class__.__name__}"
                    )
            if not metrics:
                raise ValueError("List of metrics is empty!")
        elif not isinstance(metrics, GradientMetric):
            raise ValueError(
                "'metrics' needs to be either a 'GradientMetric' instance or "
                f"a list of 'GradientMetric' instances. Found '{type(metrics)}'"
            )
        self._metrics = [metrics] if isinstance(metrics, GradientMetric) else metrics
        # A metric listed k times is fed every gradient k times, as the original does.
        self._copies = Counter(id(m) for m in self._metrics)
        # Each target once; tensors hash by identity.
        self._params = list(dict.fromkeys(p for m in self._metrics for p in m.target_parameters))
        self._engine = Engine([p for p in self._params if p.requires_grad])

    def __call__(self, loss, retain_graph=False):
        """Gradient metrics of each sample's own loss.

        Args:
            loss: Per-sample losses, shape (N,).
            retain_graph: Whether the graph of ``loss`` survives the call.

        Returns:
            torch.Tensor: Shape (N, dim): the values of every metric, in order, for each sample.

        Raises:
            ValueError: If ``loss`` does not require grad or is not 1-D.
        """
        if not loss.requires_grad:
            raise ValueError("'loss' should require grad in order to extract gradient metrics.")
        if len(loss.shape) != 1:
            raise ValueError(f"'loss' should have shape [N,] but found {loss.shape}")
        if loss.shape[0] == 0:
            raise RuntimeError("'loss' holds no samples, so there are no per-sample metrics to stack")
        self.reset()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            warn_once(
                "GradientMetricCollector: under torch.distributed each process returns the rows of its "
                f"own samples only (rank {torch.distributed.get_rank()} of "
                f"{torch.distributed.get_world_size()}); nothing is gathered across processes"
            )
        frozen = [i for i, p in enumerate(self._params) if not p.requires_grad]
        if frozen:  # as the original's torch.autograd.grad, naming them
            shapes = ", ".join(f"{i} (shape {tuple(self._params[i].shape)})" for i in frozen)
            raise RuntimeError(
                f"One of the differentiated Tensors does not require grad: the metrics' target parameters {shapes} "
                "have requires_grad=False (frozen): leave them out of the metrics' targets"
            )
        # The loss holds its graph: a caller's no_grad() or inference_mode() would stop the passes from it alone.
        with torch.inference_mode(False), torch.enable_grad():
            try:
                grads = self._engine.per_sample(loss, retain_graph=retain_graph)
            except RuntimeError as error:
                if self._engine.capture.unsharded.active:  # per sample, each rank's FSDP2 collectives would differ
                    raise
                warn_once(
                    "GradientMetricCollector: the batched backward pass failed "
                    f"({type(error).__name__}: {error}); running one backward pass per sample instead"
                )
                return self._one_backward_per_sample(loss, retain_graph)
        if any(id(p) not in grads for p in self._params):  # as the original's torch.autograd.grad
            raise RuntimeError(
                "One of the differentiated Tensors appears to not have been used in the graph. "
                "Set allow_unused=True if this is the desired behavior."
            )
        batch_stats = _BatchStats(grads, [m for m in self._metrics if m._serves_batches()])
        blocks = []
        for metric in self._metrics:
            copies = self._copies[id(metric)]
            if metric._serves_batches():
                try:
                    blocks.append(batch_stats.metric_rows(metric, loss.shape[0], copies))
                    continue
                except _RaggedTransform as ragged:
                    warn_once(f"GradientMetricCollector: {ragged}, so its metric is fed one sample at a time")
            else:
                warn_once(
                    f"GradientMetricCollector: {type(metric).__name__} overrides how it collects "
                    "gradients and has no batched formula, so it is fed one sample at a time"
                )
            blocks.append(_feed_sample_by_sample(metric, grads, loss.shape[0], copies))
        return torch.cat(blocks, dim=1)

    def _one_backward_per_sample(self, loss, retain_graph):
        """The original's loop: a backward pass and a metric update per sample."""
        rows = []
        for n, sample_loss in enumerate(loss):
            last = n == loss.shape[0] - 1
            grads = torch.autograd.grad(sample_loss, self._params, retain_graph=retain_graph or not last)
            sample_grads = {id(p): g for p, g in zip(self._params, grads)}
            rows.append(torch.cat([_read_one_sample(m, sample_grads, self._copies[id(m)]) for m in self._metrics]))
        return torch.stack(rows)

    def reset(self):
        """Resets every metric."""
        for metric in self._metrics:
            metric.reset()

    @property
    def data(self):
        """The current values of all metrics, concatenated: shape (dim,)."""
        return torch.cat([metric.data for metric in self._metrics])

    @property
    def dim(self):
        """How many values each sample gets."""
        return self.data.shape[0]


def _read_one_sample(metric, sample_grads, copies):
    """Feeds a metric one sample's gradients (``id(param)`` to tensor), each ``copies`` times;
    returns its values, reset."""
    for param in list(metric.target_parameters) * copies:
        metric(sample_grads[id(param)])
    values = metric.data
    metric.reset()
    return values


def _feed_sample_by_sample(metric, grads, n, copies):
    """Per-sample values of a metric that must see each sample's gradients itself."""
    rows = []
    dense = {id(p): grads[id(p)].dense() for p in metric.target_parameters}
    for i in range(n):
        sample_grads = {key: g[i] for key, g in dense.items()}
        rows.append(_read_one_sample(metric, sample_grads, copies))
    return torch.stack(rows)


class _RaggedTransform(Exception):
    """A grad_transform gave samples outputs of different shapes: no (N, D) batch to reduce."""


class _BatchStats:
    """Stats rows of every (parameter, transform) pair the batched metrics read.

    Each pair gets one ``per_sample_stats`` call (one per 8 p values) covering the p values of
    every metric that reads it.

    Args:
        grads: ``id(param)`` to its per-sample gradient form (:mod:`cockpit_fast.per_sample`).
        metrics: The metrics served from stats.
    """

    def __init__(self, grads, metrics):
        self._grads = grads
        self._p_values = defaultdict(dict)  # pair -> ordered set of p
        for metric in metrics:
            for param in metric.target_parameters:
                self._p_values[self._pair(metric, param)].update(dict.fromkeys(metric._stats_p_values()))
        self._rows = {}
        self._merged = {}

    @staticmethod
    def _pair(metric, param):
        # ids: comparing tensors with == would compare their values.
        return id(param), id(metric.grad_transform)

    def metric_rows(self, metric, n, copies=1):
        """The metric's values for every sample: shape (N, dim), in the original's dtype; each
        gradient counted ``copies`` times (the metric is listed that often)."""
        if not metric.target_parameters:  # nothing to collect: the reset values, for every sample
            return metric.data.expand(n, -1)
        params = list(metric.target_parameters) * copies
        # Metrics over the same parameters, transform and p values share one merge.
        key = (tuple(self._pair(metric, param) for param in params), tuple(metric._stats_p_values()))
        if key not in self._merged:
            parts, dtype = [], torch.get_default_dtype()
            for param in params:
                rows, count, grad_dtype = self._stats(metric, param)
                p_columns = [columns.P0 + list(self._p_values[self._pair(metric, param)]).index(p)
                             for p in metric._stats_p_values()]
                parts.append((rows[:, list(range(columns.P0)) + p_columns], count))
                dtype = torch.promote_types(dtype, grad_dtype)
            self._merged[key] = (*columns.merge(parts), dtype)
        merged, count, dtype = self._merged[key]
        return metric._rows_from_stats(merged, count).to(dtype)

    def _stats(self, metric, param):
        """``(rows, values per sample, gradient dtype)`` of one pair, computed on first use."""
        pair = self._pair(metric, param)
        if pair not in self._rows:
            grad, dtype = self._grads[id(param)], param.dtype
            if metric.grad_transform is not None:
                grad = DenseGrads(as_floating(_transform_each(metric.grad_transform, grad.dense())))
                dtype = grad.values.dtype
            rows = stats_rows(grad, list(self._p_values[pair]))
            self._rows[pair] = (rows, math.prod(grad.shape), dtype)
        return self._rows[pair]


def _transform_each(transform, grads):
    """``transform`` applied to each sample's gradient: batched with vmap, else one by one."""
    try:
        return torch.vmap(transform)(grads)
    except Exception as error:  # vmap raises many kinds for what it cannot batch
        name = getattr(transform, "__name__", type(transform).__name__)
        warn_once(
            f"GradientMetricCollector: grad_transform {name} cannot be batched with torch.vmap "
            f"({type(error).__name__}: {error}); applying it one sample at a time"
        )
        outputs = [transform(g) for g in grads]
        if len({out.shape for out in outputs}) > 1:
            raise _RaggedTransform(f"grad_transform {name} gives samples outputs of different shapes") from None
        return torch.stack(outputs)
