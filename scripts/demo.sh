#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the demo: a tracked training run on scikit-learn's digits.
# Extra arguments go to `python -m cockpit_fast demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m cockpit_fast demo "$@"
