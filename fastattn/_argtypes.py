"""Argument types shared by the ``fastattn`` subcommands."""

import argparse


def positive_int(text):
    """argparse type: an integer of at least 1, with a message naming the bad value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def nonnegative_int(text):
    """argparse type: an integer of at least 0 (a seed), with a message naming the bad value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def thread_count(text):
    """argparse type: a thread count that :func:`fastattn.set_num_threads` accepts here."""
    from ._threads import check_num_threads

    try:
        return check_num_threads(positive_int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
