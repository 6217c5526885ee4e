"""The backends: which exist, which run here, which ``backend="auto"`` picks, and their threads.

A backend is a module exposing::

    softmax_forward(q, k, v, causal, scale) -> out (B, n_q, d_v), or (out, finite)
    linear_forward(q, k, v, feature_map, causal, eps, S0, z0) -> (out, S, z)

on validated arrays (see :mod:`fastattn._checks`): ``q (B, n_q, d_k)``,
``k (B, n_k, d_k)``, ``v (B, n_k, d_v)`` of one dtype, C-contiguous;
``S0 (B, D, d_v)`` and ``z0 (B, D)`` None or arrays of that dtype.  ``softmax_forward``
applies :func:`fastattn._overflow.kernel_query` (a scale below 1 multiplies ``q`` first)
itself, and may return ``(out, finite)`` when its kernel checked every element of ``out``
(for :func:`fastattn._overflow.finite_softmax`).
``feature_map`` is a name the kernels apply elementwise (``"elu"``,
``"relu"``) or ``"identity"``: ``q`` and ``k`` are then features of
dimension D, formed first by their map (:mod:`fastattn.feature_maps`), whose
fused feature kernels a backend may also expose (``favor_key_features``,
``taylor_features``, ...).  A backend may expose ``output_finite(out) -> bool``,
an exact check of every element of an output at its own speed, in place of
:func:`fastattn._overflow.output_finite` after a float32 linear call (the Cython
backend's answers for its own last output from its kernel's check of each chunk).
Importing a backend's module raises ImportError
when it cannot run here; a module that runs but should not be picked by
``backend="auto"`` (Numba without a writable disk cache) says why in
``AUTO_UNSUITABLE``.  A backend may expose ``set_num_threads`` /
``get_num_threads``; :mod:`fastattn._threads` applies the process-wide count
when it loads.

A fast backend also has a decode module (:data:`DECODE_MODULES`): its
``linear_forward`` is the recurrent step of one query and one key (a
generated token) for the elementwise maps, and its
``cache_softmax_forward(q, k, v, causal, scale, n_k)`` attends over the
first ``n_k`` keys of a :class:`fastattn.KVCache`'s buffers in place (the same
rule for ``scale``, the same two forms of result).

This module also holds the public thread API: :func:`set_num_threads`,
:func:`get_num_threads`, :class:`num_threads`.
"""

import contextlib
import importlib

import numpy as np

from . import _threads

#: Backend name -> module that implements it.  One lookup dispatches a call.
BACKEND_MODULES = {
    "reference": "fastattn.reference",
    "numba": "fastattn._numba",
    "cython": "fastattn._cython",
}

#: Order in which ``backend="auto"`` tries the backends: the first that runs
#: here and is suitable (not ``AUTO_UNSUITABLE``) is taken.  The reference
#: always runs.
AUTO_ORDER = ("cython", "numba", "reference")

#: Backend -> its decode module: the recurrent linear step (``linear_forward``
#: of one query and one key, elementwise maps) and ``cache_softmax_forward``.
DECODE_MODULES = {"numba": "fastattn._numba.decode", "cython": "fastattn._cython.decode"}

_loaded = {}
_unavailable = {}
_not_for_auto = {}   # name -> why ``auto`` passes over a backend that runs (e.g. no disk cache)
_decode_loaded = {}


def _load(name):
    """The backend module ``name``, or None (with the reason kept) if it cannot run."""
    if name in _loaded:
        return _loaded[name]
    if name in _unavailable:
        return None
    try:
        module = importlib.import_module(BACKEND_MODULES[name])
    except (ImportError, Warning) as exc:  # a Warning: raised under -W error / filterwarnings
        _unavailable[name] = f"{type(exc).__name__}: {exc}"
        return None
    missing = [fn for fn in ("softmax_forward", "linear_forward") if not hasattr(module, fn)]
    if missing:
        _unavailable[name] = f"{BACKEND_MODULES[name]} does not define {missing}"
        return None
    _loaded[name] = module
    _threads.backend_loaded(module)
    reason = getattr(module, "AUTO_UNSUITABLE", None)
    if reason:
        _not_for_auto[name] = reason
    return module


def available_backends():
    """Names of the backends that can run on this machine, in ``auto``'s order.

    Returns
    -------
    tuple of str
        A subset of ``("cython", "numba", "reference")``; ``"reference"`` is
        always present.  A compiled backend is missing when its extension was
        not built; a JIT backend when Numba cannot be imported.  This imports
        every backend.
    """
    return tuple(name for name in AUTO_ORDER if _load(name) is not None)


def unavailable_backends():
    """Backends that cannot run here, mapped to the reason (the ImportError text).

    Returns
    -------
    dict of str to str
    """
    available_backends()
    return dict(_unavailable)


def auto_backend():
    """The backend ``backend="auto"`` runs: the first of :data:`AUTO_ORDER` that runs here
    and does not say it is unsuitable for ``auto`` (``AUTO_UNSUITABLE``).

    Only the backend picked and those before it are imported.

    Returns
    -------
    str
        ``"reference"`` when no other qualifies: it always runs.
    """
    for name in AUTO_ORDER:
        if _load(name) is not None and name not in _not_for_auto:
            return name
    return "reference"


def backend_name(backend):
    """The name of the backend a call with ``backend=`` runs on, loaded.

    Parameters
    ----------
    backend : str
        ``"auto"`` or a key of :data:`BACKEND_MODULES`.

    Returns
    -------
    str

    Raises
    ------
    ValueError
        If ``backend`` is not a known name, or is known but cannot run here
        (the message lists the available backends and why this one is not).
    """
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKEND_MODULES):
        got = (f"an array of shape {backend.shape}" if isinstance(backend, np.ndarray)
               else repr(backend))
        raise ValueError(
            f"backend must be 'auto' or one of {sorted(BACKEND_MODULES)}, got {got}; "
            f"available here: {list(available_backends())}"
        )
    if backend == "auto":
        return auto_backend()
    if _load(backend) is None:
        raise ValueError(
            f"backend {backend!r} is not available here ({_unavailable[backend]}); "
            f"available: {list(available_backends())}"
        )
    return backend


def get_backend(backend):
    """The module implementing ``backend`` (``"auto"``: :func:`auto_backend`'s).

    Raises
    ------
    ValueError
        As :func:`backend_name`.
    """
    return _load(backend_name(backend))


def decode_module(name):
    """The decode module of backend ``name`` (see :data:`DECODE_MODULES`), or None if it has none.

    The backend itself is loaded first, so it has the process's thread count.
    """
    if name not in DECODE_MODULES or _load(name) is None:
        return None
    module = _decode_loaded.get(name)
    if module is None:
        module = _decode_loaded[name] = importlib.import_module(DECODE_MODULES[name])
    return module


def kernel_module(backend, kind, n_q, n_k, elementwise=None):
    """The module that runs a validated call on ``backend`` (``"auto"`` resolved).

    A linear call of one query and one key with a feature map the kernels apply
    elementwise (``elementwise``: ``"elu"`` or ``"relu"``) runs the backend's
    recurrent step, in its decode module, where it has one.

    Parameters
    ----------
    backend : str
    kind : {"softmax", "linear"}
    n_q, n_k : int
    elementwise : str or None
        The feature map's :attr:`fastattn.feature_maps.FeatureMap.elementwise`.

    Raises
    ------
    ValueError
        As :func:`backend_name`.
    """
    name = backend_name(backend)
    if kind == "linear" and n_q == 1 and n_k == 1 and elementwise is not None:
        step = decode_module(name)
        if step is not None:
            return step
    return _loaded[name]


# ---------------------------------------------------------------------------
# The public thread API (the count is recorded and applied by fastattn._threads).
# ---------------------------------------------------------------------------

def set_num_threads(n_threads):
    """Use ``n_threads`` threads in every backend and in BLAS, from every Python thread.

    The count is process-wide and recorded: a backend that loads later uses
    it too, so this imports no backend.

    Parameters
    ----------
    n_threads : int
        From 1 to 4 per usable core.  Numba cannot use more threads than it
        started with (``NUMBA_NUM_THREADS``, default the core count); larger
        values are clipped there.  In a process forked after a fast kernel
        ran in parallel the kernels run on one thread whatever the count
        (see docs/kernels.md, "Processes and fork").

    Raises
    ------
    TypeError
        If ``n_threads`` is not an integer (a bool is not).
    ValueError
        If it is not in that range.
    """
    _threads.apply(_threads.check_num_threads(n_threads))


def get_num_threads():
    """Thread counts in force, by component.

    Returns
    -------
    dict of str to int
        ``{"requested": ..., "blas": ..., "<backend>": ...}`` for every
        available backend (this loads them); ``requested`` is None until
        :func:`set_num_threads` is called.  In a child forked after an OpenMP
        pool started (:func:`fastattn._threads.forked_from_running_pool`) the
        fast backends report 1: they run serially there, whatever was requested.
    """
    counts = {"requested": _threads.requested()}
    for name in available_backends():
        getter = getattr(_loaded[name], "get_num_threads", None)
        if getter is not None:
            counts[name] = 1 if _threads.forked_from_running_pool() else getter()
    counts["blas"] = _threads.blas_threads()
    return counts


class num_threads(contextlib.ContextDecorator):
    """Context manager: :func:`set_num_threads` inside, the previous setting restored after.

    Parameters
    ----------
    n_threads : int
        As for :func:`set_num_threads`.

    Raises
    ------
    TypeError, ValueError
        As :func:`set_num_threads`, when made.
    """

    def __init__(self, n_threads):
        self._n_threads = _threads.check_num_threads(n_threads)
        self._before = []

    def __enter__(self):
        self._before.append(_threads.requested())
        _threads.apply(self._n_threads)
        return self

    def __exit__(self, *exc):
        _threads.apply(self._before.pop())
        return False
