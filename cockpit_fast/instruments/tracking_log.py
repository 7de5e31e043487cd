"""Reading Cockpit's output (from a live cockpit or a written JSON log) into a step-indexed table."""

import json
import math
import os

import numpy as np


def read_output(source):
    """Return the raw output dict of ``source``: a cockpit-like object or the path of a log.

    A path may be given with or without its ``.json`` suffix (``Cockpit.write(logpath)``
    writes ``logpath + ".json"``, and the plotter is handed ``logpath``).
    """
    if hasattr(source, "logged_output"):  # cockpit_fast's: what its log holds
        return source.logged_output()
    if hasattr(source, "get_output"):
        return source.get_output()
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):  # Cockpit.write(logpath) wrote logpath + ".json"
            path += ".json"
        with open(path) as log_file:
            text = log_file.read()
        try:
            return json.loads(text, object_hook=_decode_numpy)
        except json.JSONDecodeError:
            for cut in _complete_steps(text):
                try:
                    return json.loads(cut, object_hook=_decode_numpy)
                except json.JSONDecodeError:
                    pass
            raise
    raise ValueError(
        f"Source must be a cockpit (with get_output()) or the path of a .json log. Got {source!r}"
    )


def _complete_steps(text):
    """A streamed log cut short (its run killed, or read while a step's line was written), closed
    after its last line (if whole) or after the line before (a line holds no newline); nothing
    where it is no such log."""
    if not text.startswith("{\n"):
        return []
    end = text.rfind("},\n")
    return [text.rstrip() + "\n}\n", text[: end + 1] + "\n}\n" if end >= 0 else "{}"]


def _decode_numpy(obj):
    """Turn the ``{"__ndarray__": ...}`` records that json_tricks writes back into NumPy arrays."""
    if "__ndarray__" not in obj:
        return obj
    order = "C" if obj.get("Corder", True) else "F"
    array = np.array(obj["__ndarray__"], dtype=obj.get("dtype"))
    return array.reshape(obj.get("shape", array.shape), order=order)


def as_array(value):
    """A float NumPy array from a tensor, array, list or number."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=float)


def _step_number(key):
    """The integer step a key stands for, or ``None`` when it is not a step."""
    if isinstance(key, bool):
        return None
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


class TrackingLog:
    """Cockpit's output as ``{step: {name: value}}``, with sorted steps and per-quantity series.

    Accepts Cockpit's own layout (steps first, as ``Cockpit.get_output()`` returns it and
    ``Cockpit.write`` stores it) as well as the transposed ``{name: {step: value}}``.
    """

    def __init__(self, output):
        if not isinstance(output, dict) or not all(isinstance(v, dict) for v in output.values()):
            raise ValueError("a cockpit log is a JSON object of objects ({step: {quantity: value}})")
        output = dict(output)
        if all(_step_number(key) is not None for key in output):
            records = {_step_number(step): dict(values) for step, values in output.items()}
        else:
            records = {}
            for name, per_step in output.items():
                for step, value in per_step.items():
                    if _step_number(step) is None:
                        raise ValueError(
                            f"a cockpit log is {{step: {{quantity: value}}}} (or {{quantity: {{step: value}}}}): "
                            f"neither {name!r} nor {step!r} is a step number"
                        )
                    records.setdefault(_step_number(step), {})[name] = value
        self._records = dict(sorted(records.items()))

    @property
    def steps(self):
        """All logged steps, ascending."""
        return list(self._records)

    def up_to(self, last_step):
        """A log holding only the steps ``<= last_step``."""
        return TrackingLog({step: values for step, values in self._records.items() if step <= last_step})

    def entries(self, name):
        """``(step, raw value)`` pairs of a quantity, ascending, skipping steps without it."""
        return [
            (step, values[name])
            for step, values in self._records.items()
            if values.get(name) is not None
        ]

    def latest(self, name):
        """The last raw value logged for ``name``, or ``None``."""
        entries = self.entries(name)
        return entries[-1][1] if entries else None

    def series(self, name, combine=None):
        """Finite values of ``name`` as ``(steps, values)`` arrays.

        Per-parameter values (lists or tensors) are reduced to one number with ``combine``;
        without it they are skipped.
        """
        steps, values = [], []
        for step, raw in self.entries(name):
            array = as_array(raw)
            if array.ndim > 0:
                if combine is None:
                    continue
                array = combine(array)
            value = float(array)
            if math.isfinite(value):
                steps.append(step)
                values.append(value)
        return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def root_sum_of_squares(values):
    """Combine per-parameter norms (or distances) into the norm over all parameters."""
    return np.sqrt(np.sum(np.square(values)))
