"""Shape-based choices: which backend ``backend="auto"`` runs, and when softmax splits keys.

Pure Python, no backend imported here: the rules read only the call's shape.
"""

import importlib
import math

from . import _api  # only its functions are used, at call time (_api imports this module)

#: Softmax calls with at most this many queries are decode steps: the
#: fast backends split each head's keys across threads (Flash-Decoding).
SPLIT_KEYS_MAX_N_Q = 16

#: Fewest keys in one split (one work item's key range).
SPLIT_KEYS_MIN_KEYS = 512


def use_split_keys(n_q, n_k):
    """Whether a softmax call of ``n_q`` queries over ``n_k`` keys runs the split-key kernel.

    Few queries (``n_q <= SPLIT_KEYS_MAX_N_Q``) over at least two splits'
    worth of keys (``n_k >= 2 · SPLIT_KEYS_MIN_KEYS``): below that one work
    item per head is as fast and the tiled kernel runs.

    Returns
    -------
    bool
    """
    return n_q <= SPLIT_KEYS_MAX_N_Q and n_k >= 2 * SPLIT_KEYS_MIN_KEYS


def split_count(batch, n_k, n_threads):
    """Key ranges per head for the split-key kernel.

    Enough for two work items per thread over the ``batch`` heads, none of
    fewer than ``SPLIT_KEYS_MIN_KEYS`` keys.

    Returns
    -------
    int
        At least 1.
    """
    wanted = -(-2 * n_threads // batch)
    return max(1, min(wanted, n_k // SPLIT_KEYS_MIN_KEYS))


# ---------------------------------------------------------------------------
# backend="auto": the rule, by shape class.
#
# Derived from side-by-side measurements (one process, backends interleaved,
# minimum over 5-7 rounds of each backend's fastest call; float32, d=64,
# 2 threads; Intel Xeon with AVX-512, 2 cores, a loaded machine - load
# average 4-6 - so single points can be off by several ms; ratios below are
# to the fastest backend of the shape, reference/numba/cython):
#
#   step      linear n_q=n_k=1 with a state, H=8:   ref 5.2x  numba 1.00  cython 1.09
#             (H=1: 4.5x, 1.00, 1.00); softmax n=1: ref 2.1-2.4x, numba 1.3-1.4x, cython 1.00
#   tiny      softmax n=1..64, both masks:          ref 1.6-2.4x, numba 1.0-1.4x, cython 1.00-1.10
#             linear  n=1..64:                      cython fastest or within 1.05x
#   decode    softmax n_q=1, n_k=128..65536, H=1 and H=8, both masks:
#             cython fastest at every n_k but one (n_k=8192 H=1: numba 0.165, cython 0.177 ms);
#             numba 1.1-2.4x (n_k=32768 H=8: 10.1 vs 4.2 ms), ref 2-20x
#             linear n_q=1 and 16, n_k=512..32768, H=8: cython 1.00, numba 1.1-1.4x, ref 7-27x
#   short     softmax causal n=128..512:            numba 1.00, cython 1.47 (128), 1.58 (256), 1.04 (512)
#             softmax non-causal n=128..512:        cython 1.00-1.01, numba 1.00-1.5
#             linear causal n=128..512:             numba 1.00, cython 1.56-1.62
#             linear non-causal n=128..512:         cython 1.00, numba 1.2-1.5
#   long      softmax causal n=1024..8192:          cython 1.00, numba 1.5-3.9 (n=4096: 58.6 vs 36.4 ms)
#             softmax non-causal n=1024..8192:      cython 1.00, numba 1.4-1.6
#             linear causal n=1024..8192:           numba 1.00, cython 1.5-1.7 (n=4096: 1.36 vs 2.32 ms)
#             linear non-causal n=1024..8192:       cython 1.00, numba 1.3-1.4
#
# Re-derived 2026-12-01 (11:20 UTC) after the fused Cython decode kernel, side
# by side in one process (backends interleaved, min over 7 rounds; d=64,
# 2 threads; Intel Xeon with AVX-512, 2 cores, load average 3.5-4, so again
# single points can be far off; tools/auto_check.py narrowed to these shapes, with float64),
# float32 | float64, ratio to the fastest:
#
#   short     softmax causal n=128, 256, 512:       cython 1.00 | 1.00-1.01,
#             numba 1.29, 1.36, 1.77 | 1.04, 1.00, 1.31  -> cython first now
#             softmax non-causal n=128, 512:        cython 1.00 | 1.11, 1.00; numba 1.44-1.87 | 1.00, 5.1
#             linear causal n=128:                  numba 1.00, cython 1.22 | 1.28 (unchanged)
#   tiny      softmax n_q=1, n_k=128 and 512, H=1 and 8, both masks (Cython now runs its
#             split-key kernel for n_q <= 16 at any n_k): cython 1.00-1.13, numba 1.00-1.43
#   decode    softmax n_q=1, n_k=8192, H=1:         cython 1.00-1.11, numba 1.00-1.15
#             H=8: cython 1.14-1.82 against numba (both mostly waiting on memory; one
#             thread, side by side: cython/numba 0.98-1.15 at n_k 8192 and 32768)
#
# Re-checked 2026-12-01 (12:33 UTC) on a default `fastattn report` run (2 threads,
# load 0.5-1.4, after the bench engine stopped timing every call with fresh mmap'd
# pages, which had slowed Cython's linear kernels most) and one `fastattn bench`
# run of the issue-12 shapes: Cython's causal linear attention is now the faster
# on every long shape, 1.25-1.5x (n=8192: 2.31 against 3.51 ms; 1x8x2048x64:
# 4.98 against 7.10 ms; n=1024: 0.45 against 0.43 ms) -> cython first; short causal
# linear stays numba first (n=128: 0.11 against 0.22 ms).  With that change the
# rule picks within 1.3x of the fastest on all 42 shapes of the default grid that
# run on two or more backends (worst 1.11, one-token linear steps of 20-40 us).
#
# Re-checked 2026-12-01 (15:05 UTC) on a default `fastattn report` run (2 threads,
# load 1.0-1.7, the run itself) after Cython's linear attention got its own AVX-512
# products: Cython's short causal linear attention is now the faster too, 1.17-1.59x
# (n=128: 0.085 against 0.100 ms; 256: 0.119 against 0.156; 512: 0.136 against
# 0.216) -> cython first; every class now names Cython first.  With that the rule
# picks within 1.3x of the fastest on all 42 shapes of the default grid that run on
# two or more backends (worst 1.24: causal softmax at n=128, 2 threads).
#
# Where two backends are within 1.3x the Cython one is named first: it needs
# no JIT start-up (importing Numba costs 1-2 s in a new process).  The rule is
# per shape class, not per backend version: re-derive it (the commands are in
# the report of this change) when a kernel changes.

#: Calls with at most this many scores (``n_q · n_k`` per head) are "tiny":
#: their time is the per-call cost, not the kernel's.
TINY_SCORES = 64 * 64

#: Calls with at most this many scores per head are "short" (beyond: "long").
SHORT_SCORES = 512 * 512

#: Backend -> module holding its decode kernels: ``linear_forward`` is the
#: recurrent step (one query, one key, elu or relu feature map) and
#: ``cache_softmax_forward`` the split-key softmax over a KV cache's buffer.
RECURRENT_STEP_MODULES = {"numba": "fastattn._numba.decode", "cython": "fastattn._cython.decode"}

#: Feature maps the recurrent step kernels compute.
RECURRENT_STEP_FEATURE_MAPS = ("elu", "relu")

_CYTHON_FIRST = ("cython", "numba", "reference")

#: The rule: (kind, regime, causal) -> backends, fastest first.  ``auto``
#: takes the first that is available (the reference always is).
AUTO_RULE = {
    ("softmax", "step", False): _CYTHON_FIRST,
    ("softmax", "step", True): _CYTHON_FIRST,
    ("linear", "step", False): _CYTHON_FIRST,
    ("linear", "step", True): _CYTHON_FIRST,
    ("softmax", "tiny", False): _CYTHON_FIRST,
    ("softmax", "tiny", True): _CYTHON_FIRST,
    ("linear", "tiny", False): _CYTHON_FIRST,
    ("linear", "tiny", True): _CYTHON_FIRST,
    ("softmax", "decode", False): _CYTHON_FIRST,
    ("softmax", "decode", True): _CYTHON_FIRST,
    ("linear", "decode", False): _CYTHON_FIRST,
    ("linear", "decode", True): _CYTHON_FIRST,
    ("softmax", "short", False): _CYTHON_FIRST,
    ("softmax", "short", True): _CYTHON_FIRST,
    ("linear", "short", False): _CYTHON_FIRST,
    ("linear", "short", True): _CYTHON_FIRST,
    ("softmax", "long", False): _CYTHON_FIRST,
    ("softmax", "long", True): _CYTHON_FIRST,
    ("linear", "long", False): _CYTHON_FIRST,
    ("linear", "long", True): _CYTHON_FIRST,
}


def shape_class(kind, n_q, n_k, causal):
    """The class of a call's shape that the rule of ``backend="auto"`` is written for.

    Parameters
    ----------
    kind : {"softmax", "linear"}
    n_q, n_k : int
    causal : bool

    Returns
    -------
    tuple (kind, regime, causal)
        ``regime``, the first that applies: ``"step"`` (one query and one
        key: a generated token), ``"tiny"`` (at most ``TINY_SCORES`` scores
        per head), ``"decode"`` (at most ``SPLIT_KEYS_MAX_N_Q`` queries over
        more keys), ``"short"`` (at most ``SHORT_SCORES`` scores per head) or
        ``"long"``.
    """
    scores = n_q * n_k
    if n_q == 1 and n_k == 1:
        regime = "step"
    elif scores <= TINY_SCORES:
        regime = "tiny"
    elif n_q <= SPLIT_KEYS_MAX_N_Q:
        regime = "decode"
    elif scores <= SHORT_SCORES:
        regime = "short"
    else:
        regime = "long"
    return (kind, regime, bool(causal))


def auto_backend(kind, batch, n_q, n_k, d_k, d_v, causal, dtype, available=None):
    """The backend ``backend="auto"`` runs for a call of this shape.

    Parameters
    ----------
    kind : {"softmax", "linear"}
    batch : int
        Product of the leading (batch, head) dims.
    n_q, n_k, d_k, d_v : int
    causal : bool
    dtype : numpy.dtype
        Computation dtype (float32 or float64).
    available : sequence of str, optional
        Backends that may be picked; default those that run here and do not
        say they are unsuitable for ``auto`` (``AUTO_UNSUITABLE``, e.g. Numba
        without a disk cache), asked one at a time in the rule's order, so
        only the backend picked and those before it are imported.

    Returns
    -------
    str
        The first backend of ``AUTO_RULE[shape_class(kind, n_q, n_k, causal)]``
        that is available; the rule ends with ``"reference"``, which always is.
    """
    rule = AUTO_RULE[shape_class(kind, n_q, n_k, causal)]
    for name in rule:
        if (name in available) if available is not None else (
                _api._load(name) is not None and name not in _api._not_for_auto):
            return name
    return "reference"


def use_recurrent_step(backend, kind, n_q, n_k, feature_map):
    """Whether a call runs backend ``backend``'s recurrent linear step kernel.

    Linear attention with one query and one key and an elu or relu feature
    map, on a backend that has the kernel.
    """
    return (kind == "linear" and n_q == 1 and n_k == 1 and backend in RECURRENT_STEP_MODULES
            and isinstance(feature_map, str) and feature_map in RECURRENT_STEP_FEATURE_MAPS)


def backend_name_for_call(backend, kind, q, k, v, causal, dtype):
    """The backend a validated call runs on: ``backend``, or the rule's choice for ``"auto"``.

    Raises
    ------
    ValueError
        As :func:`fastattn._api.get_backend`, for an unknown or unavailable backend.
    """
    if isinstance(backend, str) and backend == "auto":   # an array's == is an array
        return auto_backend(kind, math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1],
                            v.shape[-1], causal, dtype)
    _api.get_backend(backend)
    return backend


_step_modules = {}


def backend_for_call(backend, kind, q, k, v, causal, dtype, feature_map=None):
    """The module that runs a validated call (see :func:`backend_name_for_call`).

    A linear call of one query and one key (:func:`use_recurrent_step`) runs
    the backend's recurrent step kernel.

    Raises
    ------
    ValueError
        As :func:`fastattn._api.get_backend`, for an unknown or unavailable backend.
    """
    name = backend_name_for_call(backend, kind, q, k, v, causal, dtype)
    if use_recurrent_step(name, kind, q.shape[-2], k.shape[-2], feature_map):
        module = _step_modules.get(name)
        if module is None:
            module = _step_modules[name] = importlib.import_module(RECURRENT_STEP_MODULES[name])
        return module
    return _api._load(name)
