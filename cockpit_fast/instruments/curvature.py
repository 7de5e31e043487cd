"""CURVATURE group: Hessian's largest eigenvalue, Hessian trace and the TIC."""

import numpy as np

from cockpit_fast.instruments.drawing import (
    format_iteration_axis,
    missing_panel,
    plot_trend,
    titled_axes,
    trend_panel,
)


def max_ev_panel(ctx, slot):
    """Largest Hessian eigenvalue (the sharpest direction) against iteration."""
    return trend_panel(ctx, slot, "Max Eigenvalue", "HessMaxEV", "Max eigenvalue", y_scale="log")


def trace_panel(ctx, slot):
    """Hessian trace (the total curvature), summed over parameters, against iteration."""
    return trend_panel(ctx, slot, "Trace", "HessTrace", "Trace", combine=np.sum)


def tic_panel(ctx, slot):
    """Takeuchi information criterion: diagonal approximation (left axis), trace one (right)."""
    title = "TIC"
    diagonal = ctx.log.series("TICDiag")
    trace = ctx.log.series("TICTrace")
    if not len(diagonal[1]) and not len(trace[1]):
        return missing_panel(ctx, slot, title, ["TICDiag", "TICTrace"])

    ax = titled_axes(ctx, slot, title)
    all_steps = np.concatenate([diagonal[0], trace[0]])
    if len(diagonal[1]):
        plot_trend(ctx, ax, *diagonal)
        ax.set_ylabel("TIC (diagonal)")
    if len(trace[1]):
        # Alone, the trace version takes the main axis; next to the diagonal one, a twin axis.
        trace_ax = ax.twinx() if len(diagonal[1]) else ax
        plot_trend(ctx, trace_ax, *trace, cmap="plasma", average_cmap="spring")
        trace_ax.set_ylabel("TIC (trace)")
    format_iteration_axis(ctx, ax, all_steps)
    return ax
