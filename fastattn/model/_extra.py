"""The ``model`` extra: its packages, imported when first needed, named when missing."""

import importlib

#: The install command every missing-package error ends with, on a line of its own.
INSTALL = 'in the checkout of fastattn:\n    pip install -e ".[model]"'


class MissingExtraError(ImportError):
    """A package of the ``model`` extra is not installed; the message names it and the extra."""


def require(module, package=None, purpose="the model study"):
    """Import ``module`` (the PyPI ``package``), or raise :class:`MissingExtraError` naming it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{purpose}: needs the package {package or module!r} (module {module!r}), which is "
            f"not installed ({exc}); fastattn's model extra installs it, {INSTALL}"
        ) from exc
