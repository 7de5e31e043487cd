"""``python -m cockpit_fast``: see :mod:`cockpit_fast.cli`."""

import sys

from cockpit_fast.cli import main

sys.exit(main(prog="python -m cockpit_fast"))
