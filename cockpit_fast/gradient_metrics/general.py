"""Where gradient-metrics 0.5.0 defines its collector (``gradient_metrics.general``)."""

from cockpit_fast.gradient_metrics.collector import GradientMetricCollector

__all__ = ["GradientMetricCollector"]
