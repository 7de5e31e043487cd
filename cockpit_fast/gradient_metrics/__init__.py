"""Per-sample gradient metrics compatible with gradient-metrics 0.5.0, from one backward pass.

``GradientMetricCollector(metrics)(loss)`` takes a loss of shape (N,) and returns an (N, dim)
tensor with the same values as gradient-metrics, which runs one backward pass per sample.
"""

from cockpit_fast.gradient_metrics.collector import GradientMetricCollector

__all__ = ["GradientMetricCollector"]
