"""The log streamed as the run goes (``Cockpit(..., logpath=...)``): each finished step in the file
at once, the file complete JSON after every step (Cockpit 1.0.2's reader and ours), a killed run
keeping every finished step, memory bounded, the same output as a cockpit that keeps it all, and a
run resumed from a checkpoint going on in the same file."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cockpit_fast import Cockpit, CockpitPlotter
from cockpit_fast.log_stream import read_log
from cockpit_fast.utils.configuration import configuration

EVERY = staticmethod(lambda step: True)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _run(cockpit, model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(6, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)) for _ in range(max(steps) + 1)]
    for step in steps:
        x, y = batches[step]
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean(), "optimizer": opt}):
            losses.mean().backward()
        opt.step()


def _economy_run(logpath=None, steps=range(8)):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), logpath=logpath)
    _run(cockpit, model, opt, steps)
    return cockpit, model, opt


def _assert_same_rows(actual, expected):
    assert sorted(actual) == sorted(expected)
    for step in expected:
        assert sorted(actual[step]) == sorted(expected[step]), step
        for name, value in expected[step].items():
            got = actual[step][name]
            if isinstance(value, dict):
                for key in value:
                    np.testing.assert_allclose(np.asarray(got[key], float), np.asarray(value[key], float), rtol=1e-6, err_msg=f"{step} {name}")
            else:
                np.testing.assert_allclose(np.asarray(got, float), np.asarray(value, float), rtol=1e-6, err_msg=f"{step} {name}")


def test_a_streaming_cockpit_gives_the_output_of_one_that_keeps_it_all_and_holds_little(tmp_path):
    json_tricks = pytest.importorskip("json_tricks")
    streaming, _, _ = _economy_run(str(tmp_path / "log"))
    # Every step but the last is in the file already, and only the last row is held.
    written = json.loads((tmp_path / "log.json").read_text())
    assert sorted(int(step) for step in written) == list(range(7))
    assert list(streaming.output) == [7] and all(len(q._output) <= 1 for q in streaming.quantities)
    with open(tmp_path / "log.json") as log_file:
        assert sorted(json_tricks.load(log_file)) == [str(step) for step in range(7)]  # Cockpit 1.0.2's reader
    keeping, _, _ = _economy_run()
    _assert_same_rows(streaming.get_output(), keeping.logged_output())
    streaming.write(str(tmp_path / "log"))  # the last step too; the file is the whole log
    _assert_same_rows(read_log(str(tmp_path / "log.json")), keeping.logged_output())
    plotter = CockpitPlotter()
    plotter.plot(streaming, show_plot=False, save_plot=True, savedir=str(tmp_path))
    assert (tmp_path / "cockpit__primary.png").exists()


def test_memory_stays_bounded_however_long_the_run(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), logpath=str(tmp_path / "log"))
    _run(cockpit, model, opt, range(Cockpit.RECENT_ROWS + 40))
    assert len(cockpit.output) == 1 and len(cockpit._recent) == Cockpit.RECENT_ROWS
    assert len(cockpit._learning_rates) <= 1
    assert all(len(getattr(q, "_output", {})) <= 1 for q in cockpit.quantities)
    assert len(read_log(str(tmp_path / "log.json"))) == Cockpit.RECENT_ROWS + 39


def test_a_killed_run_keeps_every_step_it_finished(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}]
        import test_log_stream as t
        model = t._model()
        opt = t.torch.optim.SGD(model.parameters(), lr=0.1)
        cockpit = t.Cockpit(model.parameters(), quantities=t.configuration("economy"), logpath={str(tmp_path / "log")!r})
        t._run(cockpit, model, opt, range(6))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    log = json.loads((tmp_path / "log.json").read_text())  # complete JSON
    assert sorted(int(step) for step in log) == list(range(5))
    keeping, _, _ = _economy_run(steps=range(6))
    expected = {step: row for step, row in keeping.logged_output().items() if step < 5}
    _assert_same_rows(read_log(str(tmp_path / "log.json")), expected)


def test_a_run_resumed_from_a_checkpoint_goes_on_in_the_same_file(tmp_path):
    logpath = str(tmp_path / "log")
    whole, _, _ = _economy_run(str(tmp_path / "whole"), steps=range(10))
    first, model, opt = _economy_run(logpath, steps=range(5))
    checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict(), "cockpit": first.state_dict()}
    torch.save(checkpoint, tmp_path / "checkpoint.pt")  # as a run saves it: copies of the tensors
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    _run(first, model, opt, range(5, 7))  # steps after the checkpoint, lost with the crash
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    resumed = Cockpit(model.parameters(), quantities=configuration("economy"), logpath=logpath)
    resumed.load_state_dict(checkpoint["cockpit"])
    _run(resumed, model, opt, range(5, 10))
    _assert_same_rows(resumed.get_output(), whole.get_output())
    resumed.write(logpath)
    whole.write(str(tmp_path / "whole"))
    _assert_same_rows(read_log(logpath + ".json"), read_log(str(tmp_path / "whole.json")))


def test_values_logged_for_a_step_already_written_join_its_row(tmp_path):
    cockpit, model, opt = _economy_run(str(tmp_path / "log"), steps=range(4))
    cockpit.log(1, 0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.1)  # an epoch's metrics for step 1, written already
    _run(cockpit, model, opt, [4])
    row = read_log(str(tmp_path / "log.json"))[1]
    assert row["train_accuracy"] == 0.8 and "NormTest" in row and "Alpha" in row


def test_a_checkpoint_whose_log_file_is_gone_is_a_clear_error(tmp_path):
    cockpit, _, _ = _economy_run(str(tmp_path / "log"), steps=range(3))
    state = cockpit.state_dict()
    os.remove(tmp_path / "log.json")
    refused = Cockpit(_model().parameters(), quantities=configuration("economy"))
    with pytest.raises(ValueError, match=r"steps up to 1 are in its log file .*log.json, which is gone"):
        refused.load_state_dict(state)
    assert not refused.get_output()  # nothing restored (before: the quantities and the rows were)


def test_a_checkpoint_of_a_log_given_relative_is_resumed_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cockpit, _, _ = _economy_run("logs/run", steps=range(3))
    state = cockpit.state_dict()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # (before: "... its log file logs/run.json, which is gone")
    resumed = Cockpit(_model().parameters(), quantities=configuration("economy"))
    resumed.load_state_dict(state)
    assert sorted(resumed.get_output()) == [0, 1, 2]


def test_a_log_cut_short_within_a_step_reads_its_whole_steps(tmp_path):
    # (A run killed while a step's line was written, or a reader between two of its writes.)
    from cockpit_fast.log_stream import LogStream

    path = str(tmp_path / "run.json")
    stream = LogStream(path)
    for step in range(3):
        stream.append({step: {"Loss": float(step), "hist": np.arange(3000, dtype=np.float64)}})
    whole = open(path).read()
    for cut, steps in ((len(whole) - 3, [0, 1, 2]), (len(whole) - 2000, [0, 1]), (len(whole) // 2, [0]), (2, [])):
        with open(path, "w") as file:
            file.write(whole[:cut])
        assert sorted(read_log(path)) == steps, cut
    with open(path, "w") as file:
        file.write(whole[:-2000].replace('"Loss"', '"Loss', 1))  # damaged, not cut short: still an error
    with pytest.raises(json.JSONDecodeError):
        read_log(path)


def test_a_log_written_whole_replaces_the_old_one_only_once_written(tmp_path):
    # Before: the file was emptied first; a write that failed (or a run killed) left nothing.
    from cockpit_fast.log_stream import write_log

    path = str(tmp_path / "run.json")
    write_log(path, {0: {"Loss": 1.0}})
    with pytest.raises(TypeError):
        write_log(path, {0: {"Loss": 1.0}, 1: {"Loss": object()}})
    assert read_log(path) == {0: {"Loss": 1.0}} and os.listdir(tmp_path) == ["run.json"]
