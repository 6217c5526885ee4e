"""Linear attention's feature maps: time and peak extra memory of each map as n grows.

The feature maps of issue 13, each through the public
:func:`fastattn.linear_attention` with ``feature_map=...`` and ``backend=...``
on q, k, v of shape (1, n, 64), float32:

* ``elu`` (elu + 1) and ``relu``: ``D = d_k`` features, applied inside the kernels;
* ``favor``: FAVOR+ positive orthogonal random features (Choromanski et al.
  2021), ``D = m``: one ``n x d_k x m`` GEMM and ``n m`` exps, then attention
  in O(n m d_v).  :class:`FeatureMaps` runs it at fastattn's default m
  (``d_k ln d_k``, 266) and :class:`Favor` at
  ``FavorFeatures(d_k, num_features=m, random_state=0)`` for m in d_k, 4 d_k,
  16 d_k, 64 d_k, the convergence to softmax's cost;
* ``taylor``: the second-order Taylor map of exp (Based, Arora et al. 2024),
  ``D = 1 + d_k + d_k (d_k + 1) / 2`` (2145 for d_k = 64).

A map this commit does not have is skipped in setup.
"""

import functools

import fastattn

from .common import (BACKENDS, CAUSAL, D, DTYPES, FAVOR_M, FAVOR_N, FEATURE_MAPS, FEATURE_N,
                     FEATURE_REFERENCE_MAX_WORK, REFERENCE_MAX_N, fix_threads, peak_bytes, qkv,
                     skip_if_no_memory, skip_if_quick, skip_unless_built, spec)


def feature_dim(feature_map):
    """``D``, the number of features of ``feature_map`` (a name or a FavorFeatures) at d_k = D."""
    if feature_map == "taylor":
        return 1 + D + D * (D + 1) // 2
    if feature_map == "favor":
        return fastattn.feature_maps.default_num_features(D)
    return getattr(feature_map, "num_features", D)


def favor_features(m):
    """``FavorFeatures(d_k, num_features=m, random_state=0)``; a skip on a commit without it."""
    favor = getattr(fastattn, "FavorFeatures", None)
    if favor is None:
        raise NotImplementedError("this commit has no fastattn.FavorFeatures (FAVOR+)")
    return favor(D, num_features=int(m), random_state=0)


class _FeatureMapSuite:
    """Time and peak extra memory of ``linear_attention`` with one feature map.

    ``setup`` skips what cannot run here, fixes the threads and warms the
    kernel up at n = 64, so the timed call is the steady-state cost of the
    public function, the features included.
    """

    rounds = 1
    repeat = (2, 10, 4.0)
    warmup_time = 0
    timeout = 300

    def prepare(self, feature_map, backend, n, causal, dtype):
        """The setup of one combination: ``feature_map`` is the argument of the call (the
        quick run's skip comes first, in ``setup``)."""
        skip_unless_built(backend)
        work = int(n) ** 2 * feature_dim(feature_map)
        if backend == "reference" and causal and (int(n) > REFERENCE_MAX_N or
                                                  work > FEATURE_REFERENCE_MAX_WORK):
            raise NotImplementedError(
                f"the reference's causal linear attention is the masked n x n form, n^2 D = "
                f"{work:.2g} multiply-adds; bounded at {FEATURE_REFERENCE_MAX_WORK:.2g} and n <= "
                f"{REFERENCE_MAX_N} (FASTATTN_ASV_REFERENCE_MAX_N)")
        skip_if_no_memory(spec("linear", backend, n, causal, dtype))
        fix_threads()
        self.call = functools.partial(fastattn.linear_attention, feature_map=feature_map,
                                      causal=bool(causal), backend=backend)
        self.call(*qkv(64, dtype, seed=1))
        self.inputs = qkv(int(n), dtype)


class FeatureMaps(_FeatureMapSuite):
    """``linear_attention(q, k, v, feature_map=..., causal=..., backend=...)``, shape (1, n, 64)."""

    params = (FEATURE_MAPS, BACKENDS, FEATURE_N, CAUSAL, DTYPES[:1])
    param_names = ("feature_map", "backend", "n", "causal", "dtype")

    def setup(self, feature_map, backend, n, causal, dtype):
        skip_if_quick(n, FEATURE_N[0], dtype)
        known = getattr(getattr(fastattn, "feature_maps", None), "NAMES", ("elu", "relu"))
        if feature_map not in known:
            raise NotImplementedError(f"this commit has no feature map {feature_map!r}")
        self.prepare(feature_map, backend, n, causal, dtype)

    def time_forward(self, feature_map, backend, n, causal, dtype):
        self.call(*self.inputs)

    def track_peak_bytes(self, feature_map, backend, n, causal, dtype):
        return peak_bytes(lambda: self.call(*self.inputs))

    track_peak_bytes.unit = "bytes"


class Favor(_FeatureMapSuite):
    """FAVOR+ as its number of features m grows: ``feature_map=FavorFeatures(64, num_features=m)``."""

    params = (FAVOR_M, BACKENDS, FAVOR_N, CAUSAL, DTYPES[:1])
    param_names = ("m", "backend", "n", "causal", "dtype")

    def setup(self, m, backend, n, causal, dtype):
        skip_if_quick(n, FAVOR_N[0], dtype, also=int(m) == int(FAVOR_M[0]))
        self.prepare(favor_features(m), backend, n, causal, dtype)

    def time_forward(self, m, backend, n, causal, dtype):
        self.call(*self.inputs)

    def track_peak_bytes(self, m, backend, n, causal, dtype):
        return peak_bytes(lambda: self.call(*self.inputs))

    track_peak_bytes.unit = "bytes"
