"""Shared look and building blocks of the dashboard's panels."""

import warnings
from dataclasses import dataclass

import matplotlib as mpl
import numpy as np
from matplotlib import ticker
from matplotlib.colors import LinearSegmentedColormap, to_rgba
from matplotlib.figure import Figure

from cockpit_fast.instruments.tracking_log import TrackingLog

BLUE = (0.29, 0.45, 0.68)
ORANGE = (0.95, 0.50, 0.20)
GREEN = (0.30, 0.60, 0.40)
GUIDE_GRAY = "#ababba"

# Dark axes, no grid, small "paper" fonts: the dashboard's look, applied only while it is drawn.
DASHBOARD_RC = {
    "axes.facecolor": "#eaeaf2",
    "axes.edgecolor": "white",
    "axes.grid": False,
    "axes.axisbelow": True,
    "axes.labelcolor": ".15",
    "axes.spines.top": True,
    "axes.spines.right": True,
    "figure.facecolor": "white",
    "text.color": ".15",
    "xtick.color": ".15",
    "ytick.color": ".15",
    "xtick.direction": "out",
    "ytick.direction": "out",
    "xtick.major.size": 0,
    "ytick.major.size": 0,
    "xtick.minor.size": 0,
    "ytick.minor.size": 0,
    "font.size": 9.6,
    "axes.labelsize": 9.6,
    "axes.titlesize": 9.6,
    "xtick.labelsize": 8.8,
    "ytick.labelsize": 8.8,
    "legend.fontsize": 8.8,
    "lines.linewidth": 1.2,
    "patch.edgecolor": "white",
}


@dataclass(frozen=True)
class Theme:
    """Colours of the dashboard."""

    primary: tuple = BLUE
    secondary: tuple = ORANGE
    tertiary: tuple = GREEN
    group_alpha: float = 0.75
    panel_face: str = "white"
    summary_face: str = GUIDE_GRAY
    guide: str = GUIDE_GRAY
    points_cmap: str = "viridis"
    average_cmap: str = "cool"
    average_decay: float = 0.2

    def group_face(self, color):
        """Translucent version of a group colour, for a group's backdrop."""
        return to_rgba(color, self.group_alpha)

    @property
    def fade_cmap(self):
        """Colour map from transparent to the primary colour (for 2D histograms)."""
        return LinearSegmentedColormap.from_list(
            "fade_to_primary", [to_rgba(self.primary, 0.0), to_rgba(self.primary, 1.0)]
        )


@dataclass
class PanelContext:
    """What every panel needs: the figure to draw on, the data and the look."""

    fig: Figure
    log: TrackingLog
    theme: Theme
    log_iterations: bool = False
    debug: bool = False

    @property
    def iteration_scale(self):
        """Scale of every iteration axis."""
        return "symlog" if self.log_iterations else "linear"


def titled_axes(ctx, slot, title, face=None):
    """New axes at ``slot`` with a bold panel title."""
    ax = ctx.fig.add_subplot(slot)
    ax.set_title(title, fontweight="bold", fontsize="large")
    ax.set_facecolor(ctx.theme.panel_face if face is None else face)
    return ax


def missing_panel(ctx, slot, title, needed):
    """Placeholder for a panel none of whose quantities is in the log: says which it can use."""
    needs = " or ".join(needed)
    if ctx.debug:
        warnings.warn(f"{title}: no data (needs {needs})", stacklevel=2)
    ax = titled_axes(ctx, slot, title, face=(1.0, 1.0, 1.0, 0.6))
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(
        0.5,
        0.5,
        f"No data\nneeds {needs}",
        ha="center",
        va="center",
        transform=ax.transAxes,
        color="0.35",
        fontsize="large",
    )
    return ax


def exponential_average(values, decay):
    """Exponential moving average that starts at the first value."""
    averaged = np.empty_like(values)
    running = values[0] if len(values) else 0.0
    for index, value in enumerate(values):
        running = decay * value + (1.0 - decay) * running
        averaged[index] = running
    return averaged


def plot_trend(ctx, ax, steps, values, cmap=None, average_cmap=None, marker_size=12):
    """Values against iteration, coloured by step, overlaid with their exponential average."""
    theme = ctx.theme
    cmap = mpl.colormaps[cmap or theme.points_cmap]
    average_cmap = mpl.colormaps[average_cmap or theme.average_cmap]
    ax.scatter(steps, values, c=steps, cmap=cmap, s=marker_size, linewidths=0, zorder=3)
    averaged = exponential_average(values, theme.average_decay)
    ax.scatter(steps, averaged, c=steps, cmap=average_cmap, s=2, marker="s", linewidths=0, zorder=2)


def format_iteration_axis(ctx, ax, steps):
    """Iteration x-axis: linear or symlog, spanning the logged steps with a little room for markers."""
    ax.set_xscale(ctx.iteration_scale)
    ax.set_xlabel("Iteration")
    if len(steps):
        low, high = float(np.min(steps)), float(np.max(steps))
        room = 0.02 * (high - low) if high > low else 0.5
        ax.set_xlim(low - room, high + room)


def add_guides(ax, color, vertical=(0.0,), horizontal=(0.0,), linewidth=1.5):
    """Thin background lines marking reference values."""
    for x in vertical:
        ax.axvline(x, color=color, linewidth=linewidth, zorder=0)
    for y in horizontal:
        ax.axhline(y, color=color, linewidth=linewidth, zorder=0)


def use_log_scale(ax, direction, values, labels=3):
    """Log scale on ``ax``'s ``direction`` ("x" or "y") if all values are positive, with legible ticks.

    Data within one decade get plain labels at round values and no other (a decade's own label,
    10^0 among 0.8 and 1.2, would overlap them): evenly spaced ones, ``labels`` intervals at most,
    where the data span less than a factor 3 (a log axis is nearly linear there), else 1, 2 or 5
    times a power of ten at least 40% of the span apart on the axis (evenly spaced labels,
    1.5 and 3, crowd the top of a log axis from 0.3 to 3); data across decades are labelled at the
    decades only.
    """
    values = np.asarray(values, dtype=float)
    if not len(values) or np.any(values <= 0):
        return
    getattr(ax, f"set_{direction}scale")("log")
    axis = getattr(ax, f"{direction}axis")
    low, high = values.min(), values.max()
    if high < 10 * low:
        locator = ticker.MaxNLocator(labels) if high < 3 * low else ticker.FixedLocator(_spread_round_values(low, high))
        axis.set_major_locator(locator)
        axis.set_major_formatter(ticker.FormatStrFormatter("%.3g"))
    axis.set_minor_formatter(ticker.NullFormatter())


def _spread_round_values(low, high):
    """1, 2 or 5 times a power of ten in [low, high], each at least 40% of log(high / low) above
    the one before: two or three labels on a small plot."""
    gap = 0.4 * np.log10(high / low)
    exponents = range(int(np.floor(np.log10(low))), int(np.ceil(np.log10(high))) + 1)
    candidates = sorted(m * 10.0**k for k in exponents for m in (1, 2, 5) if low <= m * 10.0**k <= high)
    chosen = []
    for value in candidates:
        if not chosen or np.log10(value / chosen[-1]) >= gap:
            chosen.append(value)
    return chosen


def legend_with_latest(ax, percentage=False, **legend_kwargs):
    """Legend whose labels end with each line's last value."""
    lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    template = "{}: ({:.2%})" if percentage else "{}: ({:.1E})"
    labels = [template.format(line.get_label(), line.get_ydata()[-1]) for line in lines]
    ax.legend(lines, labels, **legend_kwargs)


def trend_panel(ctx, slot, title, quantity, ylabel, combine=None, y_scale="linear"):
    """Panel of one scalar quantity against iteration (with its moving average).

    ``y_scale="log"`` falls back to linear when some values are not positive.
    """
    steps, values = ctx.log.series(quantity, combine=combine)
    if not len(values):
        return missing_panel(ctx, slot, title, [quantity])
    ax = titled_axes(ctx, slot, title)
    plot_trend(ctx, ax, steps, values)
    if y_scale == "log":
        use_log_scale(ax, "y", values)
    ax.set_ylabel(ylabel)
    format_iteration_axis(ctx, ax, steps)
    return ax
