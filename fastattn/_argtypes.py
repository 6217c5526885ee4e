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
