#!/usr/bin/env bash
# Everything a fresh machine needs, and nothing twice: a venv in .venv with the CPU build of torch,
# the originals we test and benchmark against (Cockpit 1.0.2, BackPACK, gradient-metrics 0.5.0),
# the demo's and the tests' packages, and cockpit_fast itself, built and installed in editable
# mode. Packages already installed at a fitting version are not reinstalled, and an extension
# built from the same sources against the same torch is not rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}  # the CPU wheel on this machine's disk

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# Prints the requirements (pip's syntax) that no installed distribution satisfies.
unsatisfied() {
  "$PY" - "$@" <<'PYCODE'
import sys
from importlib import metadata
from pip._vendor.packaging.requirements import Requirement
for spec in sys.argv[1:]:
    requirement = Requirement(spec)
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        print(spec)
        continue
    if not requirement.specifier.contains(version, prereleases=True):
        print(spec)
PYCODE
}
# install_missing [pip options --] REQUIREMENT...: installs only the unsatisfied ones, saying which.
install_missing() {
  local options=()
  if [ "${1:-}" = "--no-deps" ]; then options=(--no-deps); shift; fi
  local wanted
  mapfile -t wanted < <(unsatisfied "$@")
  if [ ${#wanted[@]} -eq 0 ]; then
    echo "   already installed: $*"
  else
    echo "   installing: ${wanted[*]}"
    pip_install "${options[@]}" "${wanted[@]}"
  fi
}

echo "== dependencies in $VENV"
# Cockpit imports pkg_resources, which setuptools 81 removed; torch 2.13 needs 77.0.3 or newer (a
# venv's bundled setuptools is older: left there, torch's install would take the newest).
install_missing pip wheel "setuptools>=77.0.3,<81"
install_missing "$TORCH_SPEC" numpy ninja
# BackPACK requires torchvision, whose PyPI wheel would drag in a multi-GB CUDA torch; BackPACK's
# core never imports it, so the originals go in without their declared dependencies.
install_missing --no-deps backpack-for-pytorch==1.7.1 cockpit-for-pytorch==1.0.2 gradient-metrics==0.5.0
# BackPACK's and Cockpit's own dependencies, the demo's (extra demo) and the tests' (extra test).
install_missing einops unfoldNd json_tricks pandas scipy seaborn matplotlib scikit-learn tqdm tensorboard pytest transformers peft lightning pytorch-lightning

# The build is current when the sources, the torch it was built against and the build flags are
# the same as at the last successful build of this venv (recorded in $STAMP), and it imports.
STAMP="$VENV/.cockpit_fast-build"
fingerprint() {
  {
    cat setup.py pyproject.toml cockpit_fast/_limits.py
    find csrc -type f | LC_ALL=C sort | xargs cat
    "$PY" -c "import torch; print(torch.__version__)"
    echo "FORCE_ONLY_CPU=1"
  } | sha256sum | cut -d' ' -f1
}
current=$(fingerprint)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$current" ] &&
   "$PY" -c "import cockpit_fast, sys; sys.exit(not cockpit_fast.has_extension())" 2>/dev/null; then
  echo "== cockpit_fast is built and installed (sources and torch unchanged): not rebuilding"
else
  echo "== building cockpit_fast's C++ extension (CPU kernels) and installing it in editable mode"
  echo "   compiling $(find csrc -name '*.cpp' | wc -l) files; this takes a few minutes"
  log=$(mktemp)
  # pip -v streams the build's output, indented: ninja prints "[k/n] <compiler command> -c <source> ..."
  # as each file finishes and setuptools "<c++> ... -shared ... -o <library>" as it links. Shown: one
  # line each, sources relative to here; the whole output goes to $log.
  if ! FORCE_ONLY_CPU=1 MAX_JOBS=${MAX_JOBS:-2} PYTHONUNBUFFERED=1 "$PY" -m pip install \
      --disable-pip-version-check -v --no-build-isolation --no-deps -e . < /dev/null 2>&1 |
      tee "$log" | sed -unE \
        -e "s|^ *\[([0-9]+/[0-9]+)\] .* -c ([^ ]+) .*|   compiled [\1] \2|p" \
        -e "s|^ *[^ ]*[+][+] (.* )?-shared .* -o ([^ ]*/)?([^ /]+).*|   linking \3|p" | sed -u "s|$PWD/||"; then
    tail -40 "$log" >&2
    echo "setup.sh: building cockpit_fast failed (the output's end is above; all of it in $log)" >&2
    exit 1
  fi
  rm -f "$log"
  echo "$current" > "$STAMP"
fi
"$PY" -c "import cockpit_fast; assert cockpit_fast.has_extension(), 'extension not built'; print('cockpit_fast', cockpit_fast.__version__, 'ready')"
