"""The dashboard's panels, one module per group; each panel is ``panel(ctx, slot)``.

``ctx`` is a :class:`PanelContext` (figure, log, theme) and ``slot`` the ``SubplotSpec`` to fill.
A panel whose quantities are not in the log draws a note saying which ones it needs.
"""

from cockpit_fast.instruments.auxiliary import cabs_panel, early_stopping_panel, mean_gsnr_panel
from cockpit_fast.instruments.curvature import max_ev_panel, tic_panel, trace_panel
from cockpit_fast.instruments.drawing import DASHBOARD_RC, PanelContext, Theme
from cockpit_fast.instruments.gradients import (
    gradient_tests_panel,
    histogram_1d_panel,
    histogram_2d_panel,
    parameter_count_of_histograms,
)
from cockpit_fast.instruments.overview import hyperparameter_panel, performance_panel
from cockpit_fast.instruments.step_size import alpha_panel, distance_panel, grad_norm_panel
from cockpit_fast.instruments.tracking_log import TrackingLog, read_output

__all__ = [
    "DASHBOARD_RC",
    "PanelContext",
    "Theme",
    "TrackingLog",
    "read_output",
    "alpha_panel",
    "distance_panel",
    "grad_norm_panel",
    "gradient_tests_panel",
    "histogram_1d_panel",
    "histogram_2d_panel",
    "parameter_count_of_histograms",
    "max_ev_panel",
    "trace_panel",
    "tic_panel",
    "hyperparameter_panel",
    "performance_panel",
    "mean_gsnr_panel",
    "cabs_panel",
    "early_stopping_panel",
]
