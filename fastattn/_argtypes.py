"""Argument types shared by the ``fastattn`` subcommands."""

import argparse

from ._threads import check_num_threads


#: The largest count a command takes: beyond it a count is no longer exact as a float, and
#: the results file refuses it (so a run would measure nothing it could keep).
MAX_COUNT = 2**53


def _int(text, what):
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _int_at_least(text, low, what):
    value = _int(text, what)
    if not low <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected {what} up to 2**53, got {text}")
    return value


def int_between(low, high):
    """argparse type: an integer from ``low`` to ``high``, with a message naming the bad value."""
    def parse(text):
        value = _int(text, "an integer")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {value}")
        return value
    return parse


def positive_int(text):
    """argparse type: an integer of at least 1, with a message naming the bad value."""
    return _int_at_least(text, 1, "a positive integer")


def seed(text):
    """argparse type: a NumPy seed, 0 to 2**32 - 1, with a message naming the bad value."""
    value = _int(text, "a seed, an integer from 0 to 2**32 - 1")
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to 2**32 - 1, got {value}")
    return value


def thread_count(text):
    """argparse type: a thread count that :func:`fastattn.set_num_threads` accepts here."""
    try:
        return check_num_threads(positive_int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
