"""GRADIENTS group: gradient tests and histograms of the individual gradient elements."""

import matplotlib as mpl
import numpy as np

from cockpit_fast.instruments.drawing import add_guides, missing_panel, titled_axes, use_log_scale
from cockpit_fast.instruments.tracking_log import as_array

TEST_WINDOW = 2.0  # the central gradient-test plot shows [-TEST_WINDOW, TEST_WINDOW] in both directions
SYMLOG_THRESHOLD = 0.1
# Intervals between the labels of a log axis within one decade on the small plots (the tests'
# histories, the histograms' marginals): they are a few labels high or wide.
SMALL_PLOT_LABELS = 2
LABEL_LINE = 1.2 * 8.8  # points: a line of DASHBOARD_RC's tick labels


def gradient_tests_panel(ctx, slot):
    """Norm, inner-product and orthogonality tests: latest widths in the centre, history at the sides.

    The norm test is a disc, the inner-product test a horizontal band and the orthogonality test
    a vertical band; the wider they are, the noisier the mini-batch gradient.
    """
    title = "Gradient Tests"
    tests = {name: ctx.log.series(name) for name in ("NormTest", "InnerTest", "OrthoTest")}
    if not any(len(values) for _, values in tests.values()):
        return missing_panel(ctx, slot, title, list(tests))

    theme, fig = ctx.theme, ctx.fig
    frame = fig.add_subplot(slot)
    frame.set_axis_off()
    frame.set_title(title, fontweight="bold", fontsize="large")
    grid = _line_spaced_grid(fig, slot, 3, 3, wspace=0.05)

    center = fig.add_subplot(grid[1:, 1:])
    _format_test_center(center, theme)
    norm_ax = _history_axes(ctx, fig.add_subplot(grid[1, 0]), "Norm", tests["NormTest"])
    inner_ax = _history_axes(ctx, fig.add_subplot(grid[2, 0]), "Inner", tests["InnerTest"])
    ortho_ax = _history_axes(ctx, fig.add_subplot(grid[0, 2]), "Ortho", tests["OrthoTest"], rotated=True)

    steps, radii = tests["NormTest"]
    if len(radii):
        angles = np.linspace(0, 2 * np.pi, 361)
        center.fill(
            radii[-1] * np.cos(angles), radii[-1] * np.sin(angles), color=theme.primary, alpha=0.5
        )
        norm_ax.fill_between(steps, radii, color=theme.primary, alpha=0.5)
        norm_ax.plot(steps, radii, color=theme.primary)
        norm_ax.xaxis.tick_top()

    steps, widths = tests["InnerTest"]
    if len(widths):
        center.axhspan(-widths[-1], widths[-1], color=theme.secondary, alpha=0.5)
        inner_ax.fill_between(steps, widths, color=theme.secondary, alpha=0.5)
        inner_ax.plot(steps, widths, color=theme.secondary)
        inner_ax.invert_yaxis()

    steps, widths = tests["OrthoTest"]
    if len(widths):
        center.axvspan(-widths[-1], widths[-1], color=theme.tertiary, alpha=0.5)
        # Rotated history: width to the right, iterations downwards.
        ortho_ax.fill_betweenx(steps, widths, color=theme.tertiary, alpha=0.5)
        ortho_ax.plot(widths, steps, color=theme.tertiary)
        ortho_ax.invert_yaxis()
    return frame


def _format_test_center(ax, theme):
    """Symlog square around the origin, marked with a cross."""
    ax.set_facecolor(theme.panel_face)
    for set_scale, set_limits in ((ax.set_xscale, ax.set_xlim), (ax.set_yscale, ax.set_ylim)):
        set_scale("symlog", linthresh=SYMLOG_THRESHOLD)
        set_limits(-TEST_WINDOW, TEST_WINDOW)
    ax.yaxis.tick_right()
    ax.grid(linestyle="--")
    ax.plot(0, 0, color="black", marker="+", markersize=18, markeredgewidth=4)


def _history_axes(ctx, ax, label, series, rotated=False):
    """Side axes of one test's history: width (log scale) against iteration, or a note if absent.

    ``rotated`` puts the width on the x-axis and the iterations on the y-axis.
    """
    ax.set_facecolor(ctx.theme.panel_face)
    steps, values = series
    if not len(values):
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(
            0.5, 0.5, f"no {label} test", ha="center", va="center", transform=ax.transAxes, color="0.35"
        )
        return ax
    if rotated:
        ax.set_title(label)
        ax.set_yscale(ctx.iteration_scale)
        use_log_scale(ax, "x", values, labels=SMALL_PLOT_LABELS)
        ax.xaxis.tick_top()
        ax.yaxis.tick_right()
    else:
        ax.set_ylabel(label)
        ax.set_xscale(ctx.iteration_scale)
        use_log_scale(ax, "y", values, labels=SMALL_PLOT_LABELS)
    return ax


def histogram_1d_panel(ctx, slot):
    """Histogram of the individual gradient elements at the last logged step."""
    title = "Gradient Element Histogram"
    entry = ctx.log.latest("GradHist1d")
    if entry is None:
        return missing_panel(ctx, slot, title, ["GradHist1d"])

    counts, edges = as_array(entry["hist"]), as_array(entry["edges"])
    ax = titled_axes(ctx, slot, title)
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color=ctx.theme.primary, linewidth=0)
    ax.set_xlim(edges[0], edges[-1])
    use_log_scale(ax, "y", counts[counts > 0])
    ax.set_ylim(bottom=0.5 if ax.get_yscale() == "log" else 0)
    ax.set_xlabel("Gradient element value")
    ax.set_ylabel("Frequency")
    return ax


def parameter_count_of_histograms(log):
    """How many per-parameter 2D histograms the last ``GradHist2d`` entry holds."""
    entry = log.latest("GradHist2d") or {}
    return sum(1 for key in entry if str(key).startswith("param_") and key != "param_groups")


def histogram_2d_panel(ctx, slot, parameter=None):
    """Joint histogram of (parameter, gradient) element pairs at the last logged step, with marginals.

    ``parameter`` picks the histogram of one parameter (``GradHist2d(keep_individual=True)``);
    ``None`` shows the one over all parameters.
    """
    title = "Gradient/Parameter Element Histogram " + (
        "(all)" if parameter is None else f"(parameter {parameter})"
    )
    entry = ctx.log.latest("GradHist2d")
    if parameter is not None and entry is not None:
        entry = entry.get(f"param_{parameter}")
    if entry is None:
        return missing_panel(ctx, slot, title, ["GradHist2d"])

    counts = as_array(entry["hist"])  # rows: gradient bins, columns: parameter bins
    gradient_edges, parameter_edges = (as_array(edges) for edges in entry["edges"])
    theme, fig = ctx.theme, ctx.fig

    frame = fig.add_subplot(slot)
    frame.set_axis_off()
    frame.set_title(title, fontweight="bold", fontsize="large")
    grid = _line_spaced_grid(fig, slot, 3, 3, wspace=0)

    joint = fig.add_subplot(grid[1:, :2])
    joint.set_facecolor(theme.panel_face)
    shade = np.log10(counts + 1)  # empty bins transparent, the fullest bin in the primary colour
    joint.pcolormesh(
        parameter_edges, gradient_edges, shade, cmap=theme.fade_cmap, vmin=0, shading="flat"
    )
    add_guides(joint, theme.guide)
    joint.set_xlabel("Parameter element value")
    # The default pad below the lowest y label, which reaches half a line below the corner.
    joint.tick_params(axis="x", pad=mpl.rcParams["xtick.major.pad"] + LABEL_LINE / 2)
    joint.set_ylabel("Gradient element\nvalue")

    parameter_marginal, gradient_marginal = counts.sum(axis=0), counts.sum(axis=1)
    top = fig.add_subplot(grid[0, :2], sharex=joint)
    top.bar(
        parameter_edges[:-1],
        parameter_marginal,
        width=np.diff(parameter_edges),
        align="edge",
        color=theme.primary,
        linewidth=0,
    )
    top.tick_params(labelbottom=False)
    use_log_scale(top, "y", parameter_marginal[parameter_marginal > 0], labels=SMALL_PLOT_LABELS)

    side = fig.add_subplot(grid[1:, 2], sharey=joint)
    side.barh(
        gradient_edges[:-1],
        gradient_marginal,
        height=np.diff(gradient_edges),
        align="edge",
        color=theme.primary,
        linewidth=0,
    )
    side.tick_params(labelleft=False)
    side.xaxis.tick_top()  # below, its first label would run into the joint plot's last one
    use_log_scale(side, "x", gradient_marginal[gradient_marginal > 0], labels=SMALL_PLOT_LABELS)
    joint.set_xlim(parameter_edges[0], parameter_edges[-1])
    joint.set_ylim(gradient_edges[0], gradient_edges[-1])
    return frame



def _line_spaced_grid(fig, slot, rows, columns, **kwargs):
    """``slot`` split into ``rows`` x ``columns`` with a line of tick labels between the rows: the
    y labels centred on the bottom edge of one plot and on the top edge of the one below it would
    overlap without it."""
    height = slot.get_position(fig).height * fig.get_figheight() * 72  # points
    # GridSpec's hspace is the gap in units of the average plot height.
    hspace = rows * LABEL_LINE / max(height - (rows - 1) * LABEL_LINE, LABEL_LINE)
    return slot.subgridspec(rows, columns, hspace=hspace, **kwargs)
