"""Per-sample gradient metrics compatible with gradient-metrics 0.5.0, from one backward pass.

``GradientMetricCollector(metrics)(loss)`` takes a loss of shape (N,) and returns an (N, dim)
tensor with the same values as gradient-metrics, which runs one backward pass per sample.
"""

__version__ = "0.5.0"  # the gradient-metrics release whose API this package serves

from cockpit_fast.gradient_metrics.general import GradientMetricCollector  # noqa: E402

__all__ = ["GradientMetricCollector"]
