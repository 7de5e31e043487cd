"""``CockpitPlotter``: Cockpit's training dashboard, drawn from a live cockpit or a written log.

Drop-in for ``cockpit.CockpitPlotter``: same constructor, same ``plot`` arguments, same figure
layout and same saved file names. Without ``show_plot`` no window or GUI backend is involved,
so it runs headless (the figure is rendered with Agg when saved).
"""

import glob
import math
import os
import warnings

from cockpit_fast._optional import require

mpl = require("matplotlib", "matplotlib", "the dashboard", extra="plot")

# The imports below need matplotlib, checked above.
from matplotlib.figure import Figure  # noqa: E402

from cockpit_fast import instruments  # noqa: E402
from cockpit_fast.instruments import DASHBOARD_RC, PanelContext, Theme, TrackingLog, read_output  # noqa: E402

FIGURE_SIZE = (30, 15)  # inches: at FIGURE_DPI, 3000 x 1500 pixels like Cockpit's saved plots
FIGURE_DPI = 100

# Inside each of the three top groups: a margin row, three instruments, a margin row.
GROUP_HEIGHT_RATIOS = [0.0, 1, 1, 1, 0.0]
GROUP_WIDTH_RATIOS = [0.1, 1, 0.1]
CURVATURE_WIDTH_RATIOS = [0.15, 1, 0.0]  # its right margin goes, it is the figure's last column
GROUP_HSPACE = 0.8

# Instruments of each top group, from top to bottom.
STEP_SIZE_PANELS = (instruments.alpha_panel, instruments.distance_panel, instruments.grad_norm_panel)
GRADIENT_PANELS = (
    instruments.gradient_tests_panel,
    instruments.histogram_1d_panel,
    instruments.histogram_2d_panel,
)
CURVATURE_PANELS = (instruments.max_ev_panel, instruments.trace_panel, instruments.tic_panel)
AUXILIARY_PANELS = (
    instruments.mean_gsnr_panel,
    instruments.cabs_panel,
    instruments.early_stopping_panel,
)


class CockpitPlotter:
    """Draws the cockpit dashboard; optionally shows it in a window and/or saves it to disk."""

    def __init__(self, secondary_screen=False):
        """``secondary_screen`` adds a second figure with the auxiliary and per-layer instruments."""
        self._secondary_screen = secondary_screen
        self.theme = Theme()
        self.save_format = "png"
        self.fig = None
        self.secondary_fig = None

    def plot(
        self,
        source,
        show_plot=True,
        block=False,
        save_plot=False,
        savedir=None,
        savename="cockpit",
        savename_append=None,
        savefig_kwargs=None,
        show_log_iter=False,
        discard=None,
        plot_title=None,
        debug=False,
    ):
        """Draw the dashboard for everything ``source`` has logged so far.

        Args:
            source: A cockpit (anything with ``get_output()``) or the path a log was written
                to with ``Cockpit.write(path)`` (the ``.json`` suffix may be left out).
            show_plot: Show the figure in a window (skipped where the backend cannot open one).
            block: Whether showing waits until the window is closed.
            save_plot: Save the figure to ``savedir/savename__primary[__savename_append].png``.
            savedir: Folder to save into; defaults to ``source`` when that is a path and is
                required when ``source`` is a cockpit.
            savename: Stem of the saved file name.
            savename_append: Optional suffix of the saved file name.
            savefig_kwargs: Extra arguments for ``Figure.savefig`` (e.g. ``format``, ``dpi``).
            show_log_iter: Use a logarithmic (symlog) iteration axis.
            discard: Only use steps up to this global step.
            plot_title: Figure title; defaults to "Cockpit for <optimizer>" (or "Cockpit").
            debug: Warn about every panel that lacks data.

        Under ``torch.distributed`` a cockpit is drawn by rank 0 only (every rank holds the same
        global output), unless it was made with ``log_all_ranks=True``: then each rank draws, and
        saves with ``_rank<r>`` appended to ``savename``.

        Raises:
            ValueError: If ``source`` is neither a cockpit nor a path, or if a cockpit's
                dashboard should be saved without a ``savedir``.
        """
        if hasattr(source, "is_writer"):
            if not source.is_writer():
                return
            savename += source.rank_suffix
        if save_plot and savedir is None:
            if not isinstance(source, (str, os.PathLike)):
                raise ValueError("Please specify savedir when plotting a Cockpit.")
            savedir = os.fspath(source)

        log = TrackingLog(read_output(source))
        if not log.steps:
            where = f"the log {os.fspath(source)}" if isinstance(source, (str, os.PathLike)) else "the cockpit"
            warnings.warn(f"{where} holds no steps: the dashboard is empty", UserWarning, stacklevel=2)
        if discard is not None:
            log = log.up_to(discard)
        title = plot_title or _default_title(source)

        with mpl.rc_context(DASHBOARD_RC):
            self.fig = _blank_figure("Primary screen", show_plot)
            self._draw_primary(PanelContext(self.fig, log, self.theme, show_log_iter, debug), title)
            screens = {"primary": self.fig}
            if self._secondary_screen:
                self.secondary_fig = _blank_figure("Secondary screen", show_plot)
                self._draw_secondary(
                    PanelContext(self.secondary_fig, log, self.theme, show_log_iter, debug)
                )
                screens["secondary"] = self.secondary_fig
            if save_plot:
                for screen, fig in screens.items():
                    self._save(fig, savedir, savename, screen, savename_append, savefig_kwargs)

        if show_plot:
            _show_windows(self.fig, block)

    # -- primary screen ---------------------------------------------------------------------

    def _draw_primary(self, ctx, title):
        """Three groups of three instruments on top, hyperparameters and performance below.

        +------------------+--------------------+-----------------+
        | STEP SIZE        | GRADIENTS          | CURVATURE       |
        |   alpha          |   gradient tests   |   max eigenval. |
        |   distance       |   1D histogram     |   trace         |
        |   gradient norm  |   2D histogram     |   TIC           |
        +------------------+--------------------+-----------------+
        | hyperparameters  | performance                          |
        +------------------+--------------------------------------+
        """
        outer = ctx.fig.add_gridspec(nrows=2, ncols=3, height_ratios=[3, 1], wspace=0.1, hspace=0.1)
        groups = [
            ("STEP SIZE", self.theme.primary, GROUP_WIDTH_RATIOS, STEP_SIZE_PANELS),
            ("GRADIENTS", self.theme.secondary, GROUP_WIDTH_RATIOS, GRADIENT_PANELS),
            ("CURVATURE", self.theme.tertiary, CURVATURE_WIDTH_RATIOS, CURVATURE_PANELS),
        ]
        for column, (name, color, width_ratios, panels) in enumerate(groups):
            slot = outer[0, column]
            self._group_backdrop(ctx.fig, slot, name, color)
            inner = slot.subgridspec(
                5, 3, width_ratios=width_ratios, height_ratios=GROUP_HEIGHT_RATIOS, hspace=GROUP_HSPACE
            )
            for row, panel in enumerate(panels, start=1):
                panel(ctx, inner[row, 1])
        instruments.hyperparameter_panel(ctx, outer[1, 0])
        instruments.performance_panel(ctx, outer[1, 1:])
        ctx.fig.suptitle(title, fontsize="xx-large", fontweight="bold")

    def _group_backdrop(self, fig, slot, name, color):
        """Coloured, titled background behind a group of instruments."""
        ax = fig.add_subplot(slot)
        ax.set_title(name, fontweight="bold", fontsize="x-large")
        ax.set_facecolor(self.theme.group_face(color))
        ax.set_xticks([])
        ax.set_yticks([])
        return ax

    # -- secondary screen -------------------------------------------------------------------

    def _draw_secondary(self, ctx):
        """Auxiliary instruments (GSNR, CABS, early stopping) above per-parameter 2D histograms."""
        outer = ctx.fig.add_gridspec(nrows=2, ncols=1, height_ratios=[1, 3], wspace=0.1, hspace=0.1)

        self._group_backdrop(ctx.fig, outer[0, 0], "AUXILIARY", self.theme.primary)
        auxiliary = outer[0, 0].subgridspec(
            3, 7, width_ratios=[0.05, 1] * 3 + [0.05], height_ratios=[0.0, 1, 0.0], hspace=GROUP_HSPACE
        )
        for column, panel in zip((1, 3, 5), AUXILIARY_PANELS):
            panel(ctx, auxiliary[1, column])

        backdrop = self._group_backdrop(ctx.fig, outer[1, 0], "LAYERWISE", self.theme.secondary)
        self._draw_layerwise(ctx, outer[1, 0], backdrop)

    def _draw_layerwise(self, ctx, slot, backdrop):
        """One 2D histogram per parameter, on a grid of at least 2 x 2."""
        count = instruments.parameter_count_of_histograms(ctx.log)
        if count == 0:
            backdrop.text(
                0.5,
                0.5,
                "No per-parameter histograms: track GradHist2d(..., keep_individual=True)",
                ha="center",
                va="center",
                transform=backdrop.transAxes,
                fontsize="large",
            )
            return
        columns = max(2, math.ceil(math.sqrt(count)))
        rows = max(2, math.ceil(count / columns))
        # Plots alternate with thin margins in both directions.
        grid = slot.subgridspec(
            2 * rows + 1,
            2 * columns + 1,
            width_ratios=[0.05, 1] * columns + [0.05],
            height_ratios=[0.0, 1] * rows + [0.0],
            hspace=GROUP_HSPACE,
        )
        for parameter in range(count):
            row, column = divmod(parameter, columns)
            instruments.histogram_2d_panel(ctx, grid[2 * row + 1, 2 * column + 1], parameter=parameter)

    # -- output -----------------------------------------------------------------------------

    def _save(self, fig, savedir, savename, screen, savename_append, savefig_kwargs):
        """Save one screen as ``savedir/savename__<screen>[__append].<format>``."""
        savefig_kwargs = dict(savefig_kwargs or {})
        suffix = "" if savename_append is None else "__" + savename_append
        extension = savefig_kwargs.get("format", self.save_format)
        path = os.path.join(savedir, f"{savename}__{screen}{suffix}.{extension}")
        print(f"[cockpit|plot] Saving figure in {path}")
        os.makedirs(savedir, exist_ok=True)
        self.save_figure(fig, path, **savefig_kwargs)

    @staticmethod
    def save_figure(fig, path, **savefig_kwargs):
        """Save a screen drawn by :meth:`plot` (``plotter.fig``) to ``path`` as the dashboard looks
        (tick labels are laid out as the figure is saved, under the dashboard's style)."""
        with mpl.rc_context(DASHBOARD_RC):
            fig.savefig(path, **savefig_kwargs)

    def build_animation(self, logpath, duration=200, loop=0):
        """Turn the frames saved during training (``<logpath>__<screen>__epoch__*.png``) into GIFs.

        Writes ``<logpath>__<screen>.gif`` per screen; ``duration`` is each frame's time in ms,
        ``loop`` the number of repetitions (0: forever).
        """
        from PIL import Image

        stem = os.path.splitext(logpath)[0]
        for screen in ["primary", "secondary"] if self._secondary_screen else ["primary"]:
            frame_paths = sorted(glob.glob(f"{stem}__{screen}__epoch__*.png"))
            if not frame_paths:
                raise FileNotFoundError(f"No saved frames {stem}__{screen}__epoch__*.png to animate.")
            first, *rest = [Image.open(path) for path in frame_paths]
            gif_path = f"{stem}__{screen}.gif"
            print(f"[cockpit|animate] Saving GIF in {gif_path}")
            first.save(
                gif_path, format="GIF", append_images=rest, save_all=True, duration=duration, loop=loop
            )


def _blank_figure(name, show_plot):
    """An empty dashboard-sized figure: a pyplot window to show, else a plain (Agg) figure."""
    if not show_plot:
        return Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI)
    import matplotlib.pyplot as plt

    try:
        fig = plt.figure(num=name, figsize=FIGURE_SIZE, dpi=FIGURE_DPI)
    except ImportError:  # the configured GUI backend cannot run here (no display)
        plt.switch_backend("agg")
        fig = plt.figure(num=name, figsize=FIGURE_SIZE, dpi=FIGURE_DPI)
    fig.clf()
    return fig


def _default_title(source):
    """Dashboard title, naming the optimizer when the cockpit knows it."""
    optimizer = getattr(source, "_optimizer_name", "")
    return f"Cockpit for {optimizer}" if optimizer else "Cockpit"


def _show_windows(fig, block):
    """Show pyplot's windows, unless the backend cannot open any (headless Agg)."""
    import matplotlib.pyplot as plt

    if fig.canvas.required_interactive_framework is None:
        print("[cockpit|plot] No display for showing the Cockpit: use save_plot=True to keep it.")
        return
    print(
        "[cockpit|plot] Showing current Cockpit."
        + (" Blocking. Close plot to continue." if block else "")
    )
    plt.show(block=block)
    if not block:
        plt.pause(0.001)
