"""STEP SIZE group: step length on the local parabola, distances travelled, gradient norm."""

import math

import numpy as np

from cockpit_fast.instruments.drawing import (
    add_guides,
    format_iteration_axis,
    missing_panel,
    plot_trend,
    titled_axes,
    trend_panel,
)
from cockpit_fast.instruments.tracking_log import root_sum_of_squares

ALPHA_LIMIT = 1.5  # the alpha axis shows [-ALPHA_LIMIT, ALPHA_LIMIT]
ALPHA_BINS = 30


def alpha_panel(ctx, slot):
    """Distribution of the local step lengths (alpha) drawn over the normalised parabola.

    An alpha of -1 is the start of a step, 0 the parabola's minimum, 1 the opposite side.
    Gray: all steps; blue: the last tenth of them.
    """
    title = "Alpha Distribution"
    _, alphas = ctx.log.series("Alpha")
    if not len(alphas):
        return missing_panel(ctx, slot, title, ["Alpha"])

    theme = ctx.theme
    ax = titled_axes(ctx, slot, title)
    grid = np.linspace(-ALPHA_LIMIT, ALPHA_LIMIT, 201)
    ax.plot(grid, grid**2, color=theme.secondary, linewidth=2)
    ax.set_xlim(-ALPHA_LIMIT, ALPHA_LIMIT)
    ax.set_ylim(0, 1.75)
    add_guides(ax, theme.guide, vertical=(-1.0, 0.0, 1.0), horizontal=(0.0,))
    ax.axhline(1.0, color=theme.guide, linewidth=0.5, zorder=0)
    ax.set_xlabel(r"Local step length $\alpha$")
    ax.set_ylabel("Stand. loss")

    recent = alphas[-math.ceil(len(alphas) / 10) :]
    density_ax = ax.twinx()
    _draw_distribution(density_ax, alphas, "gray", "all")
    _draw_distribution(density_ax, recent, theme.primary, "last 10 %")
    density_ax.set_ylim(bottom=0)
    density_ax.set_ylabel(r"$\alpha$ density")
    density_ax.legend(loc="upper right")
    _point_at_outliers(ax, alphas, recent, theme.primary)
    return ax


def _draw_distribution(ax, sample, color, label):
    """Histogram (as fraction per bin) of ``sample`` on the alpha range, with a smoothed curve."""
    edges = np.linspace(-ALPHA_LIMIT, ALPHA_LIMIT, ALPHA_BINS + 1)
    clipped = np.clip(sample, -ALPHA_LIMIT, ALPHA_LIMIT)
    weights = np.full(len(sample), 1.0 / len(sample))
    ax.hist(
        clipped,
        bins=edges,
        weights=weights,
        color=color,
        alpha=0.5,
        label=rf"{label} ($\mu$={np.mean(sample):.2f})",
    )
    spread = np.std(sample)
    if len(sample) > 1 and spread > 0:
        bandwidth = 1.06 * spread * len(sample) ** -0.2  # Silverman's rule of thumb
        grid = np.linspace(-ALPHA_LIMIT, ALPHA_LIMIT, 301)
        kernels = np.exp(-0.5 * ((grid[:, None] - sample[None, :]) / bandwidth) ** 2)
        density = kernels.sum(axis=1) / (len(sample) * bandwidth * math.sqrt(2 * math.pi))
        ax.plot(grid, density * (edges[1] - edges[0]), color=color)


def _point_at_outliers(ax, alphas, recent, recent_color):
    """Arrows at the axis edges when alphas fall outside the shown range."""
    for side in (-1, 1):
        if not np.any(side * alphas > ALPHA_LIMIT):
            continue
        color = recent_color if np.any(side * recent > ALPHA_LIMIT) else "gray"
        tip = side * (ALPHA_LIMIT - 0.02)
        ax.annotate(
            "",
            xy=(tip, 0.3),
            xytext=(tip - side * 0.3, 0.3),
            arrowprops=dict(color=color, width=2, headwidth=8),
        )


def distance_panel(ctx, slot):
    """Distance from the initial parameters (left axis) and size of each update (right axis)."""
    title = "Distance"
    distance = ctx.log.series("Distance", combine=root_sum_of_squares)
    update = ctx.log.series("UpdateSize", combine=root_sum_of_squares)
    if not len(distance[1]) and not len(update[1]):
        return missing_panel(ctx, slot, title, ["Distance", "UpdateSize"])

    ax = titled_axes(ctx, slot, title)
    all_steps = np.concatenate([distance[0], update[0]])
    if len(distance[1]):
        plot_trend(ctx, ax, *distance)
        ax.set_ylabel("Distance")
    if len(update[1]):
        update_ax = ax.twinx()
        plot_trend(ctx, update_ax, *update, cmap="viridis_r", average_cmap="cool_r", marker_size=6)
        update_ax.set_ylabel("Update size")
    format_iteration_axis(ctx, ax, all_steps)
    return ax


def grad_norm_panel(ctx, slot):
    """Norm of the mini-batch gradient over all parameters."""
    return trend_panel(
        ctx, slot, "Gradient Norm", "GradNorm", "Gradient norm", combine=root_sum_of_squares
    )
