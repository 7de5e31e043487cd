"""The dashboard (cockpit_fast.CockpitPlotter) redrawn from logs written by Cockpit 1.0.2 itself.

One short training run of a tiny MLP under Cockpit's "full" configuration (plus the quantities
of the secondary screen) provides a live cockpit and its written JSON log; Cockpit's own
plotter draws the reference dashboard the saved PNGs are compared with.
"""

import json
import os
import warnings

import matplotlib as mpl
import numpy as np
import pytest
import torch

from cockpit_fast.instruments import TrackingLog
from cockpit_fast.plotter import CockpitPlotter
from cockpit_fast.utils.training import training_step

cockpit = pytest.importorskip("cockpit")
backpack = pytest.importorskip("backpack")

STEPS = 8
BATCH_SIZE = 16
ACCURACY_EVERY = 3  # Cockpit.log() is called every few steps only, as in an epoch loop
DASHBOARD_PIXELS = (1500, 3000)  # height, width


def train_under_cockpit(steps=STEPS):
    """A few SGD steps of a tiny MLP tracked by all quantities of the dashboard; returns the cockpit."""
    from cockpit.utils.configuration import configuration

    torch.manual_seed(0)
    model = backpack.extend(
        torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    )
    loss_fn = backpack.extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    every_step = cockpit.utils.schedules.linear(interval=1)
    quantities = [q for q in configuration("full") if not isinstance(q, cockpit.quantities.GradHist2d)]
    quantities.append(cockpit.quantities.GradHist2d(every_step, keep_individual=True))  # layerwise too
    for secondary in (
        cockpit.quantities.MeanGSNR,
        cockpit.quantities.CABS,
        cockpit.quantities.EarlyStopping,
    ):
        quantities.append(secondary(track_schedule=every_step))
    tracker = cockpit.Cockpit(model.parameters(), quantities=quantities)

    batch = torch.randn(BATCH_SIZE, 10), torch.randint(0, 3, (BATCH_SIZE,))
    for step in range(steps):
        _, loss, _ = training_step(
            model, optimizer, batch, individual_loss_fn, loss_fn=loss_fn, cockpit=tracker, step=step, quiet=True
        )
        if step % ACCURACY_EVERY == 0:
            tracker.log(
                step, 0, loss.item(), loss.item(), None, 0.3 + 0.05 * step, 0.25 + 0.04 * step, None, 0.1
            )
    return tracker


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The live cockpit and the path (without .json) of the log it wrote."""
    tracker = train_under_cockpit()
    logpath = str(tmp_path_factory.mktemp("logs") / "mlp" / "run")
    tracker.write(logpath)
    return tracker, logpath


@pytest.fixture(scope="module")
def cockpit_reference_png(run, tmp_path_factory):
    """The primary screen as Cockpit 1.0.2's own plotter saves it for the same log."""
    _, logpath = run
    savedir = tmp_path_factory.mktemp("reference")
    with mpl.rc_context(), warnings.catch_warnings():  # Cockpit's plotter changes global styles
        warnings.simplefilter("ignore")
        cockpit.CockpitPlotter().plot(logpath, show_plot=False, save_plot=True, savedir=str(savedir))
    return read_png(savedir / "cockpit__primary.png")


def read_png(path):
    """RGB pixels of a saved PNG, as floats in [0, 1]."""
    from matplotlib.image import imread

    return imread(str(path))[..., :3]


def assert_looks_like_a_dashboard(pixels):
    """Right size, far from blank: many colours and plenty of non-white area."""
    assert pixels.shape[:2] == DASHBOARD_PIXELS
    painted = np.any(pixels < 0.95, axis=-1).mean()
    assert painted > 0.3
    rgb = np.round(pixels * 255).astype(np.int64)
    distinct_colours = len(np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]))
    assert distinct_colours > 200


def panel_texts(fig):
    """Every text drawn inside the figure's axes (titles, notes), for checking what was drawn."""
    texts = []
    for ax in fig.axes:
        texts.append(ax.get_title())
        texts.extend(text.get_text() for text in ax.texts)
    return texts


def test_redraws_from_the_written_log(run, tmp_path, cockpit_reference_png):
    _, logpath = run
    plotter = CockpitPlotter(secondary_screen=True)
    plotter.plot(logpath, show_plot=False, save_plot=True, savedir=str(tmp_path))

    primary = read_png(tmp_path / "cockpit__primary.png")
    assert_looks_like_a_dashboard(primary)
    assert primary.shape == cockpit_reference_png.shape
    assert_looks_like_a_dashboard(read_png(tmp_path / "cockpit__secondary.png"))
    # Every instrument had data: no placeholders, and one 2D histogram per parameter (4 in the MLP).
    texts = panel_texts(plotter.fig) + panel_texts(plotter.secondary_fig)
    assert not any(text.startswith("No") for text in texts)
    assert sum("(parameter" in text for text in texts) == 4


def test_layout_matches_cockpits_own_dashboard(run, tmp_path, cockpit_reference_png):
    """The coloured group backdrops sit where Cockpit puts them (checked in their margins)."""
    _, logpath = run
    CockpitPlotter().plot(logpath, show_plot=False, save_plot=True, savedir=str(tmp_path))
    ours = read_png(tmp_path / "cockpit__primary.png")
    height, width = DASHBOARD_PIXELS
    # (row, column) fractions inside the left margin of STEP SIZE, GRADIENTS and CURVATURE,
    # and the blank strip between the top groups and the bottom row.
    for row, column in [(0.40, 0.13), (0.40, 0.396), (0.40, 0.662), (0.69, 0.5)]:
        y, x = int(row * height), int(column * width)
        np.testing.assert_allclose(ours[y, x], cockpit_reference_png[y, x], atol=0.03)


def test_redraws_from_the_live_cockpit(run, tmp_path):
    tracker, _ = run
    plotter = CockpitPlotter()
    plotter.plot(tracker, show_plot=False, save_plot=True, savedir=str(tmp_path), savename_append="live")

    assert_looks_like_a_dashboard(read_png(tmp_path / "cockpit__primary__live.png"))
    assert plotter.fig.get_suptitle() == "Cockpit for SGD"


def test_live_cockpit_and_written_log_give_the_same_picture(run, tmp_path):
    tracker, logpath = run
    plotter = CockpitPlotter()
    plotter.plot(
        tracker,
        show_plot=False,
        save_plot=True,
        savedir=str(tmp_path),
        savename="live",
        plot_title="Run",
    )
    plotter.plot(
        logpath,
        show_plot=False,
        save_plot=True,
        savedir=str(tmp_path),
        savename="logged",
        plot_title="Run",
    )
    np.testing.assert_array_equal(
        read_png(tmp_path / "live__primary.png"), read_png(tmp_path / "logged__primary.png")
    )


def test_log_with_missing_quantities_and_steps(run, tmp_path):
    """Only loss, gradient norm and the 1D histogram, and not at every step: the rest says so."""
    _, logpath = run
    with open(logpath + ".json") as log_file:
        full = json.load(log_file)
    kept = {"Loss", "GradNorm", "GradHist1d"}
    partial = {
        step: {name: value for name, value in record.items() if name in kept}
        for step, record in full.items()
        if int(step) % 2 == 0
    }
    partial_path = tmp_path / "partial"
    with open(str(partial_path) + ".json", "w") as log_file:
        json.dump(partial, log_file)

    plotter = CockpitPlotter(secondary_screen=True)
    with pytest.warns(UserWarning, match="no data"):
        plotter.plot(
            str(partial_path), show_plot=False, save_plot=True, savedir=str(tmp_path), debug=True
        )

    assert_looks_like_a_dashboard(read_png(tmp_path / "cockpit__primary.png"))
    notes = [text for text in panel_texts(plotter.fig) if text.startswith("No data")]
    assert len(notes) == 8  # all 11 instruments but gradient norm, 1D histogram and performance
    assert any("HessMaxEV" in note for note in notes)
    assert not any("GradNorm" in note or "GradHist1d" in note for note in notes)
    secondary_notes = [text for text in panel_texts(plotter.secondary_fig) if text.startswith("No")]
    assert len(secondary_notes) == 4  # GSNR, CABS, early stopping and the per-parameter histograms


def test_quantity_keyed_output_with_tensors_and_lists():
    """``{name: {step: value}}`` output, histograms as tensors or lists, per-parameter lists."""

    class FakeCockpit:
        _optimizer_name = "Adam"

        def get_output(self):
            edges = torch.linspace(-1, 1, 11)
            return {
                "GradHist1d": {
                    0: {"hist": torch.arange(10.0), "edges": edges},
                    4: {"hist": list(range(10)), "edges": edges.tolist()},
                },
                "GradHist2d": {
                    4: {"hist": torch.ones(10, 6), "edges": (edges, torch.linspace(-2, 2, 7).tolist())}
                },
                "GradNorm": {0: [3.0, 4.0], 2: torch.tensor([0.6, 0.8]), 4: None},
                "HessMaxEV": {2: 1.5},
                "Alpha": {0: -0.5, 1: 0.2, 3: 3.0},
                "TICTrace": {1: 0.9, 3: 1.2},
            }

    plotter = CockpitPlotter()
    plotter.plot(FakeCockpit(), show_plot=False)
    texts = panel_texts(plotter.fig)
    for drawn in (
        "Gradient Norm",
        "Gradient Element Histogram",
        "Gradient/Parameter Element Histogram (all)",
        "Max Eigenvalue",
        "Alpha Distribution",
        "TIC",
    ):
        assert drawn in texts
    notes = [text for text in texts if text.startswith("No data")]
    assert len(notes) == 5  # distance, gradient tests, trace, hyperparameters, performance
    assert plotter.fig.get_suptitle() == "Cockpit for Adam"


def test_tracking_log_reads_both_layouts_and_discards_late_steps():
    by_step = {
        "0": {"Loss": 2.0, "GradNorm": [3.0, 4.0]},
        "5": {"Loss": 1.0},
        "2": {"Loss": None, "GradNorm": np.array([0.6, 0.8])},
    }
    by_name = {"Loss": {0: 2.0, 5: 1.0}, "GradNorm": {0: [3.0, 4.0], 2: [0.6, 0.8]}}
    for output in (by_step, by_name):
        log = TrackingLog(output)
        assert log.steps == [0, 2, 5]
        steps, losses = log.series("Loss")
        np.testing.assert_array_equal(steps, [0, 5])
        np.testing.assert_array_equal(losses, [2.0, 1.0])
        _, norms = log.series("GradNorm", combine=lambda values: np.sqrt(np.sum(values**2)))
        np.testing.assert_allclose(norms, [5.0, 1.0])
        assert log.up_to(2).series("Loss")[1].tolist() == [2.0]


def test_saving_options(run, tmp_path):
    """Default folder (the log path, like Cockpit), other formats; a live cockpit needs a folder."""
    tracker, logpath = run
    plotter = CockpitPlotter()
    plotter.plot(
        logpath,
        show_plot=False,
        save_plot=True,
        savefig_kwargs={"format": "pdf"},
        discard=3,
        show_log_iter=True,
    )
    assert os.path.isfile(os.path.join(logpath, "cockpit__primary.pdf"))
    with pytest.raises(ValueError, match="savedir"):
        plotter.plot(tracker, show_plot=False, save_plot=True)
    with pytest.raises(ValueError, match="Source"):
        plotter.plot(42, show_plot=False)


def test_show_plot_without_a_display_does_not_block(run, capsys):
    import matplotlib.pyplot as plt

    _, logpath = run
    backend = mpl.get_backend()
    plt.switch_backend("agg")
    try:
        CockpitPlotter().plot(logpath, show_plot=True, block=True)
        assert "No display" in capsys.readouterr().out
    finally:
        plt.close("all")
        plt.switch_backend(backend)


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    """A cockpit_fast cockpit after a few steps of the MLP under the full configuration, and its log path."""
    from cockpit_fast import Cockpit
    from cockpit_fast.utils.configuration import configuration

    torch.manual_seed(0)
    model = backpack.extend(torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
    loss_fn = backpack.extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = Cockpit(model.parameters(), quantities=configuration("full"))
    batch = torch.randn(BATCH_SIZE, 10), torch.randint(0, 3, (BATCH_SIZE,))
    for step in range(4):
        training_step(
            model, optimizer, batch, individual_loss_fn, loss_fn=loss_fn, cockpit=tracker, step=step, quiet=True
        )
    tracker.log(3, 0, 1.5, 1.6, None, 0.5, 0.4, None, 0.1)
    logpath = str(tmp_path_factory.mktemp("fast") / "run")
    tracker.write(logpath)
    return tracker, logpath


def assert_same_values(expected, actual):
    """Equal nested output: same keys, same numbers, NumPy arrays of the same dtype and values."""
    if isinstance(expected, dict):
        assert {str(key) for key in expected} == {str(key) for key in actual}
        lookup = {str(key): value for key, value in actual.items()}
        for key, value in expected.items():
            assert_same_values(value, lookup[str(key)])
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype
        np.testing.assert_array_equal(actual, expected)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for e, a in zip(expected, actual):
            assert_same_values(e, a)
    else:
        assert actual == expected


def test_written_log_reads_back_exactly_with_cockpits_reader_and_ours(fast_run):
    """Plain JSON that json_tricks (Cockpit 1.0.2's reader) and ours both turn back into the output."""
    json_tricks = pytest.importorskip("json_tricks")
    from cockpit_fast.instruments.tracking_log import read_output

    tracker, logpath = fast_run
    with open(logpath + ".json") as log_file:
        assert_same_values(tracker.logged_output(), json_tricks.load(log_file))
    assert_same_values(tracker.logged_output(), read_output(logpath))


def test_cockpits_own_plotter_draws_our_log(fast_run, tmp_path):
    _, logpath = fast_run
    with mpl.rc_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cockpit.CockpitPlotter().plot(logpath, show_plot=False, save_plot=True, savedir=str(tmp_path))
    assert_looks_like_a_dashboard(read_png(tmp_path / "cockpit__primary.png"))


def test_written_log_is_compact(fast_run):
    """One line per step, no indentation, counts without fractions: a tenth of an indented dump."""
    tracker, logpath = fast_run
    text = open(logpath + ".json").read()
    assert len(text.splitlines()) == len(tracker.get_output()) + 2
    assert ", " not in text and ": " not in text and "\n " not in text
    hist = np.asarray(json.loads(text)["0"]["GradHist1d"]["hist"]["__ndarray__"])
    assert hist.dtype == np.int64  # whole float32 counts written as integers
    indented = json.dumps(json.loads(text), indent=4)
    assert len(text) < len(indented) / 5


def test_write_to_a_bare_file_name(fast_run, tmp_path, monkeypatch):
    """``cockpit.write("log")`` writes ./log.json (the directory part is empty)."""
    tracker, _ = fast_run
    monkeypatch.chdir(tmp_path)
    tracker.write("log")
    assert (tmp_path / "log.json").is_file()


def panel_axes(fig, title):
    """The axes of the dashboard's panel ``title``: the one titled so and those drawn inside it
    (side plots, marginals)."""
    box = next(ax for ax in fig.axes if ax.get_title() == title).get_position()
    inside = lambda b: b.x0 >= box.x0 - 1e-9 and b.y0 >= box.y0 - 1e-9 and b.x1 <= box.x1 + 1e-9 and b.y1 <= box.y1 + 1e-9  # noqa: E731
    return [ax for ax in fig.axes if inside(ax.get_position())]


def drawn_tick_labels(ax):
    """The major tick labels of ``ax`` that are drawn: on a visible axis, at a tick within its
    view (matplotlib keeps labels of ticks beyond the limits, not drawn), not empty."""
    if not ax.axison:
        return []
    drawn = []
    for axis in (ax.xaxis, ax.yaxis):
        low, high = sorted(axis.get_view_interval())
        slack = 1e-9 * max(abs(low), abs(high), 1.0)
        for loc, label in zip(axis.get_majorticklocs(), axis.get_majorticklabels()):
            if axis.get_visible() and label.get_visible() and label.get_text() and low - slack <= loc <= high + slack:
                drawn.append(label)
    return drawn


@pytest.mark.parametrize("low, high", [(0.8, 1.2), (0.3, 3.0), (0.5, 4.0), (0.04, 0.35), (2.0, 19.0), (1e-3, 1e2)])
def test_gradient_panels_tick_labels_do_not_overlap(low, high):
    """The gradient tests' side plots are a few lines high: their labels must not run into each
    other (nor the 2D histogram's marginals into the joint plot) at the saved size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from cockpit_fast.instruments import DASHBOARD_RC

    rng = np.random.default_rng(0)
    steps = 200
    edges = np.linspace(-2, 2, 41)
    joint = rng.integers(0, 10**4, size=(40, 40)) * (rng.random((40, 40)) < 0.3)

    class FakeCockpit:
        def get_output(self):
            tests = {name: rng.uniform(low, high, steps) for name in ("NormTest", "InnerTest", "OrthoTest")}
            return {
                step: {
                    **{name: float(values[step]) for name, values in tests.items()},
                    "GradHist2d": {"hist": joint, "edges": (edges, edges)},
                }
                for step in range(steps)
            }

    plotter = CockpitPlotter()
    plotter.plot(FakeCockpit(), show_plot=False)
    canvas = FigureCanvasAgg(plotter.fig)
    with mpl.rc_context(DASHBOARD_RC):  # as save_figure lays the labels out
        canvas.draw()
        renderer = canvas.get_renderer()
        for title in ("Gradient Tests", "Gradient/Parameter Element Histogram (all)"):
            labels = [label for ax in panel_axes(plotter.fig, title) for label in drawn_tick_labels(ax)]
            assert len(labels) > 10, title  # the panel was drawn with its axes
            # A pixel of room around each: labels that touch read as one.
            boxes = [(label.get_text(), label.get_window_extent(renderer).padded(1)) for label in labels]
            overlapping = [
                (text_a, text_b)
                for index, (text_a, box_a) in enumerate(boxes)
                for text_b, box_b in boxes[index + 1 :]
                if box_a.overlaps(box_b)
            ]
            assert not overlapping, (title, overlapping)
