"""Installing the package as a user would, and what a user sees when something is missing.

``test_fresh_venv_*`` build and install the source tree into a new virtual environment
(non-editable, without build isolation as the README says; with isolation the build must stop
with one message naming the fix) and use it from another folder. They compile the extension
once (minutes): marked ``install``, deselect them with ``-m "not install"``. The venv holds
torch and numpy only, so it also shows the one-line messages for the packages it lacks.
"""

import importlib.machinery
import os
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest
import torch

import cockpit_fast
from cockpit_fast import cli, ops
from cockpit_fast._optional import MissingDependency, require

REPOSITORY = Path(__file__).resolve().parent.parent
SOURCES = ("setup.py", "pyproject.toml", "README.md", "csrc", "cockpit_fast")
BUILD_HINT = "pip install --no-build-isolation ."


# -- the one-line messages -------------------------------------------------------------------


def missing(monkeypatch, *modules):
    """Make ``import module`` fail as if the package were not installed."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_require_names_the_package_and_the_extra(monkeypatch):
    missing(monkeypatch, "sklearn")
    with pytest.raises(MissingDependency) as error:
        require("sklearn", "scikit-learn", "the demo", extra="demo")
    assert str(error.value) == (
        "the demo needs scikit-learn, which is not installed: pip install scikit-learn "
        "(or pip install 'cockpit-fast[demo]')"
    )


def test_require_lets_an_installed_package_raise_its_own_import_error(monkeypatch, tmp_path):
    (tmp_path / "needs_more.py").write_text("import not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as error:
        require("needs_more", "needs-more", "this test")
    assert not isinstance(error.value, MissingDependency)
    assert error.value.name == "not_installed_anywhere"


def test_cockpit_without_backpack_names_backpack_for_pytorch(monkeypatch):
    missing(monkeypatch, "backpack")
    with pytest.raises(MissingDependency, match=r"cockpit_fast.Cockpit needs backpack-for-pytorch.*whl/cpu"):
        cockpit_fast.__getattr__("Cockpit")


def test_hess_max_ev_with_lanczos_without_scipy_says_so_when_made(monkeypatch):
    from cockpit_fast.quantities import HessMaxEV
    from cockpit_fast.utils.schedules import linear

    missing(monkeypatch, "scipy", "scipy.sparse", "scipy.sparse.linalg")
    with pytest.raises(MissingDependency, match=r"^HessMaxEV\(use_power=False\) needs scipy"):
        HessMaxEV(linear(1), use_power=False)
    HessMaxEV(linear(1))  # power iteration needs no SciPy


@pytest.mark.parametrize(
    "module, package", [("sklearn", "scikit-learn"), ("tqdm", "tqdm"), ("matplotlib", "matplotlib")]
)
def test_demo_without_its_packages_is_one_line(monkeypatch, capsys, tmp_path, module, package):
    missing(monkeypatch, module)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--device", "cpu", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("cockpit-fast: error: the demo")
    assert f"needs {package}, which is not installed: pip install {package} (or pip install 'cockpit-fast[demo]')" in err
    assert not (tmp_path / "run").exists()  # checked before anything runs


def test_plot_without_matplotlib_is_one_line(monkeypatch, capsys, tmp_path):
    log = tmp_path / "log.json"
    log.write_text("{}")
    missing(monkeypatch, "matplotlib", "matplotlib.figure")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plot", str(log)])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == (
        "cockpit-fast: error: plot needs matplotlib, which is not installed: pip install matplotlib "
        "(or pip install 'cockpit-fast[plot]')\n"
    )


def test_demo_without_tensorboard_skips_the_event_files_with_a_note(monkeypatch, capsys, tmp_path):
    from cockpit_fast.demo import tensorboard_export

    missing(monkeypatch, "tensorboard")
    assert tensorboard_export(str(tmp_path), ["weight"]) is None
    assert capsys.readouterr().out == (
        "Skipping the event files: the demo's TensorBoard event files needs tensorboard, which is not "
        "installed: pip install tensorboard (or pip install 'cockpit-fast[demo]')\n"
    )


# -- the extension warning -------------------------------------------------------------------

SUFFIX = ".cpython-311-x86_64-linux-gnu.so"  # one of EXTENSION_SUFFIXES on the test machines


@pytest.mark.parametrize(
    "files, error, expected",
    [
        ([], "No module named 'cockpit_fast._C'", "the C++ extension cockpit_fast._C is not built (no _C.* in"),
        (
            ["_C.cpython-39-x86_64-linux-gnu.so"],
            "No module named 'cockpit_fast._C'",
            "the C++ extension cockpit_fast._C was built for another Python (_C.cpython-39-x86_64-linux-gnu.so)",
        ),
        (
            ["_C" + SUFFIX],
            "_C.so: undefined symbol: _ZN3c1017RegisterOperators",
            "the C++ extension cockpit_fast._C was built for another version of torch than the installed "
            f"{torch.__version__} (_C.so: undefined symbol: _ZN3c1017RegisterOperators)",
        ),
        (["_C" + SUFFIX], "_C.so: file too short", "the C++ extension cockpit_fast._C failed to load (_C.so: file too short)"),
    ],
    ids=["not built", "another Python", "another torch", "failed to load"],
)
def test_extension_warning_says_what_happened_and_how_to_build(files, error, expected):
    if SUFFIX not in importlib.machinery.EXTENSION_SUFFIXES:
        pytest.skip("the file names assume CPython 3.11 on x86-64 Linux")
    why = ops._why_not_loaded(ImportError(error), [os.path.join("pkg", name) for name in files])
    assert why.startswith(expected)
    assert why.endswith(f"Build it against the installed torch: `{BUILD_HINT}` in the source tree, "
                        "or `python setup.py build_ext --inplace` for a checkout used in place")
    assert "circular import" not in why


# -- a fresh virtual environment -------------------------------------------------------------


def run(command, cwd, **kwargs):
    """Run ``command``; returns the finished process (output captured as text)."""
    # Not this checkout on the path: the venv must find its own installed copy.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(MAX_JOBS=os.environ.get("MAX_JOBS", "2"), FORCE_ONLY_CPU="1")
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """A new venv with this torch version, numpy and ninja (parallel compiles), a copy of the
    source tree, and a folder outside both to run from; removed afterwards (it holds a torch
    install, over a gigabyte, and CI's later CUDA stage needs the disk)."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    for name in SOURCES:
        origin = REPOSITORY / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("_C*.so", "__pycache__", "*.pyc"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(origin, source / name)
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    torch_spec = "torch==" + torch.__version__.split("+")[0]
    installed = run([python, "-m", "pip", "install", "-q", torch_spec, "numpy", "setuptools", "ninja"], cwd=root)
    assert installed.returncode == 0, installed.stderr
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    yield python, source, elsewhere
    shutil.rmtree(root)


@pytest.mark.install
def test_fresh_venv_isolated_build_stops_with_one_message_naming_the_fix(fresh_venv):
    python, source, elsewhere = fresh_venv
    process = run([python, "-m", "pip", "install", "--no-deps", str(source)], cwd=elsewhere)
    assert process.returncode != 0
    output = process.stdout + process.stderr
    assert "cockpit_fast cannot be built: torch is not installed in this build environment" in output
    assert f"Install torch first, then build against it: {BUILD_HINT}" in output
    assert "Traceback" not in output


@pytest.fixture(scope="module")
def installed(fresh_venv):
    """The fresh venv after ``pip install --no-build-isolation --no-deps <source>`` (compiles)."""
    python, source, elsewhere = fresh_venv
    process = run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", str(source)], cwd=elsewhere)
    assert process.returncode == 0, process.stdout + process.stderr
    return fresh_venv


def venv_python(installed, code):
    python, _, elsewhere = installed
    return run([python, "-W", "error::RuntimeWarning", "-c", textwrap.dedent(code)], cwd=elsewhere)


@pytest.mark.install
def test_fresh_venv_installed_package_imports_from_elsewhere_with_its_extension(installed):
    process = venv_python(
        installed,
        """
        import sys, torch, cockpit_fast
        from cockpit_fast import ops, reference
        assert "site-packages" in cockpit_fast.__file__, cockpit_fast.__file__
        assert cockpit_fast.has_extension()
        g = torch.randn(8, 30)
        assert torch.equal(ops.hist1d(g, bins=10), reference.hist1d(g, 10, (-2.0, 2.0), 1.0))
        print(cockpit_fast.__version__)
        """,
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == cockpit_fast.__version__


@pytest.mark.install
def test_fresh_venv_declares_what_the_package_imports(installed):
    process = venv_python(
        installed,
        """
        from importlib import metadata
        print("\\n".join(metadata.requires("cockpit-fast")))
        """,
    )
    assert process.returncode == 0, process.stderr
    required = [line for line in process.stdout.splitlines() if "extra ==" not in line]
    assert sorted(required) == ["backpack-for-pytorch>=1.6", "numpy", "torch>=2.4"]
    extras = {line.split("extra == ")[1].strip("'\"") for line in process.stdout.splitlines() if "extra ==" in line}
    assert extras == {"plot", "demo", "test"}


@pytest.mark.install
def test_fresh_venv_console_script_and_its_messages(installed):
    python, _, elsewhere = installed
    script = python.parent / "cockpit-fast"
    version = run([script, "--version"], cwd=elsewhere)
    assert version.returncode == 0 and version.stdout.strip() == f"cockpit_fast {cockpit_fast.__version__}"
    (elsewhere / "log.json").write_text("{}")
    # The venv has neither scikit-learn, matplotlib nor the benchmarks: one line each.
    expected = {
        ("demo",): "cockpit-fast: error: the demo (its digits data set) needs scikit-learn",
        ("plot", "log.json"): "cockpit-fast: error: plot needs matplotlib, which is not installed",
        ("bench",): "cockpit-fast: error: the benchmarks live in the source repository",
    }
    for arguments, start in expected.items():
        process = run([script, *arguments], cwd=elsewhere)
        assert process.returncode == 1
        assert process.stderr.startswith(start) and len(process.stderr.splitlines()) == 1, process.stderr
    cockpit = venv_python(installed, "from cockpit_fast import Cockpit")
    assert cockpit.stderr.strip().splitlines()[-1].startswith(
        "cockpit_fast._optional.MissingDependency: cockpit_fast.Cockpit needs backpack-for-pytorch"
    )
