"""Warnings attributed to the user's line, not to fastattn's.

A warning fastattn raises while it is imported (or while it imports a backend
on first use, through :func:`importlib.import_module`) would otherwise name a
line inside fastattn or importlib, several calls deep, as its source;
:func:`warn_user` names the first caller outside both.
"""

import importlib
import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_IMPORTLIB = os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep


def _passed_over(frame):
    """A frame of fastattn or of the import machinery."""
    name = frame.f_code.co_filename
    return (os.path.abspath(name).startswith((_PACKAGE, _IMPORTLIB))
            or name.startswith("<frozen importlib"))


def _skipped_by_warnings(frame):
    """The frames ``warnings`` itself leaves out when it counts ``stacklevel``."""
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def warn_user(message, category=RuntimeWarning):
    """``warnings.warn(message, category)`` attributed to the first frame outside
    fastattn and importlib, so that the filters and the printed source are the
    user's ``import fastattn`` or call."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=(_PACKAGE, _IMPORTLIB))
        return
    # warnings counts stacklevel from this frame (1) over the frames it does not
    # leave out; count those up to the first frame passed over no more.
    level = 1
    frame = sys._getframe(1)
    while frame is not None:
        if not _skipped_by_warnings(frame):
            level += 1
            if not _passed_over(frame):
                break
        frame = frame.f_back
    warnings.warn(message, category, stacklevel=level)
