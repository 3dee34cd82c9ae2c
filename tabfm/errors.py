"""Errors a run raises to stop with a reason a person can act on; `tabfm` prints them in one line (exit 1)."""
from __future__ import annotations


class RunStopped(RuntimeError):
    """A command stopped for the reason its message states (not bad input: that is ValueError, exit 2)."""


class RunDiverged(RunStopped):
    """Training stopped because its losses or gradients stayed non-finite; the message says where
    the last good weights are."""
