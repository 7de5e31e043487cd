"""The cockpit's log on disk: Cockpit 1.0.2's JSON format, one line a step, written whole or
streamed step by step as a run goes.

A log is ``{`` and ``}`` around one ``"<step>":{...}`` line per step. Arrays are the
``{"__ndarray__": values, "dtype", "shape"}`` records that json_tricks (Cockpit 1.0.2's reader)
turns back into arrays, whole numbers are written without a fraction and float32 values with the
digits float32 needs. A :class:`LogStream` appends the lines of finished steps and keeps the
closing ``}`` last, so the file is a complete log after every append: a run killed at any point
keeps every step it finished. A step written again (a value that arrived later) is a line of its
own further down, holding the whole step; readers keep the last (JSON's duplicate keys).
"""

import json
import os

import numpy as np

from cockpit_fast.instruments.tracking_log import read_output

_CLOSING = "\n}\n"


def log_line(step, row):
    """The log's line of ``row`` (``{quantity: value}`` in output form) at ``step``."""
    compact = {"default": _array_record, "separators": (",", ":"), "sort_keys": True}
    return f"{json.dumps(str(step))}:{json.dumps(row, **compact)}"


def write_log(path, output):
    """Write ``output`` (``{step: row}``) to ``path`` as a whole log: into a file beside it, then
    put in its place (a reader, or a run killed meanwhile, finds the old log or the new one)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.partial"
    try:
        with open(partial, "w") as file:
            file.write("{\n" + ",\n".join(log_line(step, output[step]) for step in sorted(output)) + _CLOSING)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def read_log(path):
    """``{step: row}`` of the log at ``path`` (int steps; a step written twice: its last line)."""
    return {int(step): row for step, row in read_output(path).items()}


class LogStream:
    """A log at ``path`` written as the run goes. The file is started anew at the first
    :meth:`append` (or with what a run restored from a checkpoint had written: :meth:`rewrite`).

    Args:
        path (str): The ``.json`` file.
    """

    def __init__(self, path):
        self.path = path
        self.last_step = None  # the largest step written so far
        self._lines = None  # lines in the file; None: not started

    def append(self, output):
        """Append the rows of ``output`` (``{step: row}``), flushed: each step whose line is in
        the log already is written again whole, its earlier values under the new ones."""
        if not output:
            return
        if self._lines is None:
            self.rewrite({})
        earlier = self.read() if self.last_step is not None and min(output) <= self.last_step else {}
        lines = [log_line(step, {**earlier.get(step, {}), **output[step]}) for step in sorted(output)]
        text = ("\n" if not self._lines else ",\n") + ",\n".join(lines) + _CLOSING
        with open(self.path, "r+b") as file:
            end = file.seek(0, os.SEEK_END)
            file.seek(end - len(_CLOSING) - (0 if self._lines else 1))
            file.write(text.encode())
            file.truncate()
            file.flush()
        self._lines += len(lines)
        self.last_step = max(output) if self.last_step is None else max(self.last_step, max(output))

    def read(self):
        """``{step: row}`` of everything written so far."""
        return {} if self._lines is None else read_log(self.path)

    def rewrite(self, output):
        """Make ``output`` (``{step: row}``) the whole log."""
        write_log(self.path, output)
        self._lines = len(output)
        self.last_step = max(output, default=None)


def _array_record(value):
    """json.dumps's default: NumPy values; a float32's str() is its shortest exact form and whole
    numbers (histogram counts) need no fraction."""
    if isinstance(value, np.generic):
        return value.item()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"cannot write a {type(value).__name__} to a cockpit log")
    values = value.ravel().tolist()
    if value.dtype.kind == "f":
        values = [int(x) if x.is_integer() and abs(x) < 2**53 else float(str(x)) for x in value.ravel()]
    nested = np.array(values, dtype=object).reshape(value.shape).tolist()
    record = {"__ndarray__": nested, "dtype": str(value.dtype), "shape": list(value.shape)}
    return {**record, "Corder": True} if value.ndim > 1 else record  # as json_tricks writes them
