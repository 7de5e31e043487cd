"""Where gradient-metrics 0.5.0 defines its collector (``gradient_metrics.general``), beside the
metrics' base class it imports there."""

from cockpit_fast.gradient_metrics.collector import GradientMetricCollector
from cockpit_fast.gradient_metrics.metrics import GradientMetric

__all__ = ["GradientMetric", "GradientMetricCollector"]
