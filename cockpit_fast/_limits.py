"""Limits of the ops' arguments, written only here: setup.py compiles them into the C++ checks
(csrc/include/cockpit_fast/checks.h) and cockpit_fast/_validation.py checks them in Python.
No imports, so that setup.py can read this file before anything is built."""

#: Most p values one ``per_sample_stats`` call accepts (fixed-size state in the kernels).
MAX_P_VALUES = 8

#: Most cells one histogram may have (int32 slots in the kernels; float32 resolves no more).
MAX_BINS = 2**24
