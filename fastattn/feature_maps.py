"""Feature maps of linear attention: one object per map, in one registry.

Linear attention (Katharopoulos et al. 2020) replaces ``exp(qᵀk / √d_k)`` by
``φ(q)ᵀφ(k)`` for a feature map ``φ`` of ``d_k`` to ``D`` features.  fastattn
has these maps (``feature_map=`` of :func:`fastattn.linear_attention`,
:func:`fastattn.attention_weights` and :class:`fastattn.LinearAttentionState`):

========== ===================================================== =====================
name       φ                                                     D
========== ===================================================== =====================
"elu"      ``elu(x) + 1``, elementwise                           ``d_k``
"relu"     ``max(x, 0)``, elementwise                            ``d_k``
"favor"    FAVOR+ positive orthogonal random features            ``m`` (see below)
"taylor"   second-order Taylor map of ``exp(qᵀk/√d_k)`` (Based)  ``1 + d_k + d_k(d_k+1)/2``
callable   the user's own non-negative features                  whatever it returns
========== ===================================================== =====================

Each map is one :class:`FeatureMap` object in :data:`REGISTRY`, which
declares its name, its feature dimension ``D`` for a given ``d_k``
(:meth:`FeatureMap.feature_dim`, cheap: no random draw), its NumPy form
(:meth:`FeatureMap.numpy_features`) and, where it has them, its fused forms
in the compiled backends:

* ``"elu"`` and ``"relu"`` are applied elementwise inside every backend's
  linear kernels, chunk by chunk (:attr:`FeatureMap.elementwise`);
* the other maps' features are formed first, ``φ(q) (B, n_q, D)`` and
  ``φ(k) (B, n_k, D)``, by the backend's own feature kernel where it has one
  (:attr:`FeatureMap.kernel`: ``taylor_features``; FAVOR+'s
  ``favor_key_features`` / ``favor_query_features``), else by the NumPy form,
  and the backend's linear kernels then run on the features (``"identity"``):
  ``O(n · (D + d_v))`` memory, a state ``(S, z)`` of shapes ``(..., D, d_v)``,
  ``(..., D)``.

Adding a map is one :class:`FeatureMap` subclass passed to :func:`register`:
it runs on every backend through the generic path above, and
:data:`NAMES`, :func:`feature_dim`, the API and the generation classes read
the registry.
"""

import contextlib
import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np

from . import _checks, _overflow, reference

#: ``eps`` of ``eps=None`` for elu, relu, taylor and callables.
DEFAULT_EPS = 1e-6
#: ``eps`` of ``eps=None`` for FAVOR+: none, as in the Performer papers and code.  Its
#: features are positive, so the denominator is > 0 unless it underflows (the row is 0);
#: the kernels would apply any eps in the shifted frame (see :class:`FavorFeatures`).
FAVOR_EPS = 0.0
#: Keys and values (the first of each head) from which elu+1's float32 underflow check
#: bounds every product when the first row alone does not clear the bound
#: (``FeatureMap._clearly_above``); the full check reads them all only when neither does.
_BOUND_ROWS = 16

#: A float32 linear call with an eps below this (float32's machine epsilon, 2⁻²³) may have
#: lost a row to underflow: a numerator below 2⁻¹⁴⁹ is 0, and divided by such an eps it
#: could have been a normal number (:meth:`FeatureMap.zero_rows_may_be_lost`).
_SMALL_EPS = 2.0 ** -23


def _bound_clears(k_low, smallest_v, n_k):
    """Whether elu+1 of a key ``k_low`` times a value ``smallest_v`` (lower bounds of every
    feature's and value column's largest) is at least ``n_k · 2⁻¹⁰²``: no product of the
    state underflows beyond the sum's rounding (:meth:`FeatureMap.state_may_underflow`); a
    NaN or a zero value says nothing (False)."""
    phi = k_low + 1 if k_low > 0 else math.exp(k_low)
    return smallest_v > 0 and phi * smallest_v >= n_k * 2.0 ** -102


def default_num_features(d_k):
    """The default number of FAVOR+ features: ``d_k · ln d_k`` rounded, at least ``d_k``.

    ``m = Θ(d_k log d_k)`` is the order Choromanski et al. (2021) show suffices
    for a uniform approximation of the softmax kernel.  ``d_k = 32`` gives 111,
    ``d_k = 64`` gives 266.
    """
    return max(int(d_k), int(round(d_k * math.log(d_k)))) if d_k > 1 else 1


def taylor_num_features(d_k):
    """Feature dimension of the Taylor map: ``1 + d_k + d_k (d_k + 1) / 2``."""
    return 1 + d_k + d_k * (d_k + 1) // 2


@dataclass
class Features:
    """``φ(q) (B, n_q, D)``, ``φ(k) (B, n_k, D)`` and FAVOR+'s frame of each feature ``(B, D)``."""

    q: np.ndarray
    k: np.ndarray
    key_shift: np.ndarray = None

    @property
    def num_features(self):
        return self.q.shape[-1]

    def widened(self):
        """These features in float64 (no frame): for a map whose float32 features already
        hold what its float64 call needs, and which is not formed again."""
        return Features(self.q.astype(np.float64), self.k.astype(np.float64))


class FeatureMap:
    """A feature map ``φ`` of linear attention, of ``d_k`` to ``D`` features.

    A subclass sets :attr:`name` and implements :meth:`feature_dim` and
    :meth:`numpy_features`; registered (:func:`register`), it is known by
    its name everywhere and runs on every backend: its features are formed
    once by :meth:`numpy_features` (or by a backend's fused kernel named by
    :attr:`kernel`), then the backend's linear kernels of ``D`` features run.

    Attributes
    ----------
    name : str
        The ``feature_map=`` name.
    elementwise : str or None
        The name the linear kernels of every backend apply elementwise inside
        (``"elu"``, ``"relu"``; ``D = d_k``), or None: features formed first.
    kernel : str or None
        The name of a backend function ``kernel(x (B, n, d_k)) -> (B, n, D)``
        that forms the features (a fused form); a backend without it uses
        :meth:`numpy_features`.
    nonnegative : bool
        Whether every feature is >= 0 (so a state's ``z`` is too); Taylor's
        are not.
    default_eps : float
        The ``eps`` of ``eps=None``.
    """

    name = None
    elementwise = None
    kernel = None
    nonnegative = True
    default_eps = DEFAULT_EPS
    #: Whether the features it forms are checked as a callable's are (shape, ``D``, finite,
    #: sign): every registered map's but those of fastattn's own, whose forms are tested.
    check_features = True

    def feature_dim(self, d_k, num_features=None):
        """``D`` for inputs of key dimension ``d_k``, or None when known only once the map has
        run (a callable); no random features are drawn.  ``num_features`` is FAVOR+'s ``m``."""
        raise NotImplementedError(f"{type(self).__name__} must implement feature_dim(d_k) "
                                  f"(a FeatureMap subclass gives its number of features D)")

    def numpy_features(self, x):
        """The NumPy form: ``φ(x) (B, n, D)`` of ``x (B, n, d_k)``, in ``x``'s dtype."""
        raise NotImplementedError(f"{type(self).__name__} must implement numpy_features(x) "
                                  f"(a FeatureMap subclass with elementwise = None gives its "
                                  f"features of x (B, n, d_k) as (B, n, D))")

    def bind(self, d_k, d_k_of="q and k have"):
        """The map to apply to inputs of key dimension ``d_k`` (``d_k_of`` says whose, in an
        error); ValueError if it cannot be.  Most maps are the same for every ``d_k``."""
        return self

    def features(self, module, q, k, batch_shape, z0=None):
        """``Features`` of ``q (B, n_q, d_k)`` and ``k (B, n_k, d_k)`` (kernel inputs of one
        dtype) formed by ``module``'s fused kernel or the NumPy form; None for an
        elementwise map (the kernels apply it)."""
        if self.elementwise is not None:
            return None
        form = getattr(module, self.kernel, None) if self.kernel else None
        if form is None:
            form = self.numpy_features
        phis = [form(x) for x in (q, k)]
        if self.check_features:   # before a cast could hide a wrong type
            for phi, which in zip(phis, "qk"):
                _check_feature_type(phi, f"feature map {self.name!r} on {which}")
        feats = Features(*(np.require(phi, dtype=x.dtype, requirements=["C", "A"])
                           for phi, x in zip(phis, (q, k))))
        if self.check_features:
            for phi, x, which in ((feats.q, q, "q"), (feats.k, k, "k")):
                self._check(phi, x, which)
        return feats

    def _check(self, phi, x, which):
        """ValueError naming the map unless ``phi`` holds features of ``x (B, n, d_k)``."""
        what = f"feature map {self.name!r} on {which}"
        D = self.feature_dim(x.shape[-1])
        if phi.shape[:-1] != x.shape[:-1] or phi.ndim != 3 or phi.shape[-1] < 1 \
                or (D is not None and phi.shape[-1] != D):
            raise ValueError(f"{what} must give features of shape "
                             f"{_checks.shape_text(*x.shape[:-1], D or 'D')}, got {phi.shape}")
        _check_feature_values(phi, what, self.nonnegative,
                              " (a map whose features may be negative sets nonnegative = False)")

    def forward(self, module, feats, q, k, v, causal, eps, S0, z0):
        """``(out, S, z)``: :meth:`forward_in_dtype`, and a float32 call whose output comes
        out non-finite, whose state may underflow (:meth:`state_may_underflow`) or whose
        finite result may be lost (:meth:`_may_be_lost`), computed in float64, then rounded.

        A float32 numerator ``φ(q)·S`` (or ``S`` itself) overflows where the float64 one
        does not (``q`` of 1e15 against ``v`` of 1e30: the answer is 1e30), and the
        backends then differ (inf, NaN: the order of their sums).  Overflow is always
        visible in the output (an inf in ``S`` or in the numerator makes the row inf or
        NaN, an infinite denominator NaN), so the ordinary call pays one pass over its output,
        ``O(n · d_v)`` beside the kernel's ``O(n · D · d_v)``; only the rare call that
        comes out non-finite is computed again.  Float64 holds every product of float32
        numbers (up to 1e77 for two factors), so the float64 answer, rounded, is the
        float32 answer (inf only where it is beyond 3.4e38).  A NaN or inf given reaches
        the same rows in float64 (those that see it); the others get their answer.
        """
        if q.dtype != np.float32:
            return self.forward_in_dtype(module, feats, q, k, v, causal, eps, S0, z0)
        if self.features_may_overflow(q, k) or self.state_may_underflow(feats, k, v):
            return self._forward_wide(module, feats, q, k, v, causal, eps, S0, z0)
        # The reference warns of the overflow the float64 call below repairs (the compiled
        # backends never warn): quiet, as they are.
        with np.errstate(over="ignore", invalid="ignore") if module is reference \
                else contextlib.nullcontext():
            result = self.forward_in_dtype(module, feats, q, k, v, causal, eps, S0, z0)
        if getattr(module, "output_finite", _overflow.output_finite)(result[0]) \
                and not self._may_be_lost(*result, eps):
            return result
        return self._forward_wide(module, feats, q, k, v, causal, eps, S0, z0)

    def _may_be_lost(self, out, S, z, eps):
        """Whether a finite float32 result may still be wrong where float64 is right: with an
        empty output, a state that overflowed (no output shows it); else
        :meth:`zero_rows_may_be_lost`."""
        if out.size == 0:
            return not (np.isfinite(S).all() and np.isfinite(z).all())
        return self.zero_rows_may_be_lost(out, eps)

    def zero_rows_may_be_lost(self, rows, eps):
        """Whether float32 ``rows`` (an output or weights, ``(..., n_q, n)``, not empty) of an
        elementwise map hold a row of zeros that float64 may not: with ``eps`` below
        ``_SMALL_EPS``, a denominator that underflowed to 0 (relu keys of 1e-40 against a
        query of 1e-20 gave 0 for values of 1e30) or a numerator that did (queries of 1e-40
        against values of 1e-30).  One pass over ``rows``, only for such an ``eps``.  Rows that are 0 in
        float64 too (relu rows with no overlap, causal rows that see no key, values of 0) say
        the same: the caller's float64 call costs time, not a different answer."""
        return (self.elementwise is not None and eps < _SMALL_EPS
                and not rows.any(axis=-1).all())

    def _forward_wide(self, module, feats, q, k, v, causal, eps, S0, z0):
        """``(out, S, z)`` of float32 inputs computed in float64, then rounded to float32."""
        q, k, v, S0, z0 = (None if x is None else x.astype(np.float64) for x in (q, k, v, S0, z0))
        wide = self._wide_features(module, feats, q, k, z0)
        with np.errstate(over="ignore"):   # beyond float32's range: inf, as the dtype says
            return tuple(x.astype(np.float32) for x in
                         self.forward_in_dtype(module, wide, q, k, v, causal, eps, S0, z0))

    def features_may_overflow(self, q, k):
        """Whether float32 features of these ``q``, ``k`` may be wrong in a way the output
        does not show (False here: see :meth:`Favor.features_may_overflow`)."""
        return False

    def state_may_underflow(self, feats, k, v):
        """Whether a float32 state ``S = Σ φ(k_j)ᵀ v_j`` of these inputs may lose products to
        underflow beyond float32's own rounding.

        A product below float32's smallest normal number (2⁻¹²⁶) is rounded to a multiple
        of 2⁻¹⁴⁹ or lost, so a sum of ``n_k`` of them may be off by ``n_k · 2⁻¹²⁶``.  That
        is within the sum's rounding (2⁻²⁴ of its largest term) when, for every feature
        ``f`` and value column ``j`` with any nonzero entry, the largest ``φ(k)_f`` times
        the largest ``|v_j|`` is at least ``n_k · 2⁻¹⁰²``; keys and values of 1e-30 each
        (products of 1e-60) are not, and run in float64, which holds every product of
        float32 numbers.  One pass over ``k`` (or ``φ(k)``) and ``v``; the elementwise
        maps are increasing, so ``φ``'s largest value is ``φ`` of the largest input.
        """
        if 0 in k.shape or 0 in v.shape:
            return False
        if self.elementwise == "elu" and self._clearly_above(k, v):
            return False
        if self.elementwise is not None:
            top = k.max(axis=-2).astype(np.float64)
            phi_top = reference.feature_map(top, self.elementwise)
        else:
            phi_top = feats.k.max(axis=-2).astype(np.float64)
        v_top = np.maximum(v.max(axis=-2), -v.min(axis=-2)).astype(np.float64)
        smallest = [np.where(x > 0, x, np.inf).min(axis=-1) for x in (phi_top, v_top)]
        return bool((smallest[0] * smallest[1] < k.shape[-2] * 2.0 ** -102).any())

    @staticmethod
    def _clearly_above(k, v):
        """True when elu+1's every product is clearly above the bound, from the first key
        and value of each head, or, when those do not clear it (a value of 0, a very
        negative key, a tiny value), from the first ``_BOUND_ROWS``: a column's largest
        over those rows is at most its largest over all, and φ is positive and increasing,
        so φ of the smallest such key column maximum is below every feature's largest, and
        the smallest such column maximum of ``|v|`` below every column's (a NaN says
        nothing: False; :func:`_bound_clears`).  ``O(d)`` work a head, where the full check
        reads ``k`` and ``v`` whole (a fifth of a float32 call of 8 x 16384 x 64 went to
        it).  The first row first because NumPy's reduction over rows costs time by the
        row: the 16 rows of 48 heads of 32 took 42 µs, 5 % of a 2-thread call at
        (4, 12, 512, 32), its other thread idle; the first row 4 µs."""
        n_k = k.shape[-2]
        # Over one row a column's largest is the row: no reduction over rows.
        if _bound_clears(float(k[..., 0, :].min()), float(np.abs(v[..., 0, :]).min()), n_k):
            return True
        rows = min(n_k, _BOUND_ROWS)
        return rows > 1 and _bound_clears(float(k[..., :rows, :].max(axis=-2).min()),
                                          float(np.abs(v[..., :rows, :]).max(axis=-2).min()), n_k)

    def forward_in_dtype(self, module, feats, q, k, v, causal, eps, S0, z0):
        """``module.linear_forward`` on the inputs (an elementwise map) or on ``feats``, in
        their dtype."""
        if feats is None:
            return module.linear_forward(q, k, v, self.elementwise, causal, eps, S0, z0)
        return module.linear_forward(feats.q, feats.k, v, "identity", causal, eps, S0, z0)

    def _wide_features(self, module, feats, q, k, z0):
        """The features of the float64 ``q``, ``k`` (None for an elementwise map)."""
        return None if feats is None else self.features(module, q, k, None, z0)

    def __repr__(self):
        return f"{type(self).__name__}()"


class _Elementwise(FeatureMap):
    """A map the kernels apply elementwise (:attr:`elementwise`): ``D = d_k``, its NumPy form
    the reference's."""

    def feature_dim(self, d_k, num_features=None):
        return int(d_k)

    def numpy_features(self, x):
        return reference.feature_map(x, self.elementwise)


class Elu(_Elementwise):
    """``φ(x) = elu(x) + 1`` elementwise (Katharopoulos et al. 2020), always > 0; ``D = d_k``."""

    name = "elu"
    elementwise = "elu"


class Relu(_Elementwise):
    """``φ(x) = max(x, 0)`` elementwise, ``D = d_k``; a row may have a zero denominator."""

    name = "relu"
    elementwise = "relu"


class Taylor(FeatureMap):
    """The second-order Taylor map of ``exp(qᵀk / √d_k)`` (Based, Arora et al. 2024).

    ``φ(x) = [1, x / d_k^¼, sym(x xᵀ) / (√2 √d_k)]``, whose kernel is
    ``1 + s + s²/2 >= 1/2`` with ``s = qᵀk / √d_k``;
    ``D = 1 + d_k + d_k (d_k + 1) / 2`` (see :func:`fastattn.reference.taylor_features`).
    Its features may be negative.
    """

    name = "taylor"
    kernel = "taylor_features"
    nonnegative = False
    check_features = False

    def feature_dim(self, d_k, num_features=None):
        return taylor_num_features(d_k)

    def numpy_features(self, x):
        return reference.taylor_features(x)


def _positive_int(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if not 1 <= value <= _checks.LARGEST_DIM:
        raise ValueError(f"{name} must be a positive int (at most {_checks.LARGEST_DIM:,}, an "
                         f"array dimension), got {_checks.number_text(value)}")
    return int(value)


def orthogonal_gaussian_features(d_k, num_features, rng):
    """``ω (num_features, d_k)``: blocks of ``d_k`` orthogonal rows with chi(d_k) norms.

    Each block is the Q factor of a ``d_k x d_k`` Gaussian matrix (orthogonal
    rows); each row is then scaled by the norm of an independent standard
    Gaussian ``d_k``-vector, so that every row is marginally ``N(0, I)``
    while rows of one block stay orthogonal (Choromanski et al. 2021, §2.4).
    """
    blocks = []
    for _ in range(-(-num_features // d_k)):
        g = rng.standard_normal((d_k, d_k))
        qr_q, qr_r = np.linalg.qr(g)
        # Sign fix: makes Q Haar-distributed (numpy's QR leaves it biased).
        blocks.append((qr_q * np.sign(np.diag(qr_r))).T)
    directions = np.concatenate(blocks)[:num_features]
    norms = np.linalg.norm(rng.standard_normal((num_features, d_k)), axis=1)
    return directions * norms[:, None]


class ReadOnlyAttributes:
    """A map whose :attr:`read_only` attributes are fixed once it is made: its kernels' arrays
    are cached from them (FAVOR+'s projections, Hedgehog's casts), so a new value would be
    ignored by some calls and read against the wrong shapes by others.  Their arrays are
    read-only too, in a copy or an unpickled map as well.  A different map is a new object."""

    #: Names fixed by :meth:`_freeze` (a subclass's own attributes stay free).
    read_only = ()

    def _freeze(self):
        for name in self.read_only:
            if isinstance(value := self.__dict__.get(name), np.ndarray):
                value.setflags(write=False)
        object.__setattr__(self, "_frozen", True)

    def __setstate__(self, state):   # pickle and deepcopy: the arrays come back writeable
        self.__dict__.update(state)
        if state.get("_frozen"):
            self._freeze()

    def _check_unfrozen(self, name):
        if name in self.read_only and self.__dict__.get("_frozen"):
            raise AttributeError(f"{type(self).__name__}.{name} is read-only: a map is fixed "
                                 f"when it is made; make a new {type(self).__name__} instead")

    def __setattr__(self, name, value):
        self._check_unfrozen(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        self._check_unfrozen(name)
        object.__delattr__(self, name)


class Favor(FeatureMap):
    """``feature_map="favor"``: FAVOR+ with the default ``m`` and seed of :class:`FavorFeatures`.

    ``D = m`` (default :func:`default_num_features`).  Bound to a ``d_k`` it is
    ``FavorFeatures(d_k)`` (made once per ``d_k``).
    """

    name = "favor"
    default_eps = FAVOR_EPS

    def feature_dim(self, d_k, num_features=None):
        return int(num_features) if num_features else default_num_features(d_k)

    def bind(self, d_k, d_k_of="q and k have"):
        return _default_favor(d_k)

    def features_may_overflow(self, q, k):
        """Whether ``‖k_j‖²`` of a row of the float32 ``k`` may overflow.

        FAVOR+'s key exponent ``ω k' − ‖k'‖² / 2`` is then −inf and the row's features 0: the
        answer comes out 0 and finite (keys of 1e19 and up at ``d_k = 8``), where float64
        holds the norm.  The queries' norms are never formed (constant along a row, they are
        part of its shift), and a ``q`` whose ``q ω`` overflows makes the output NaN, which
        sends the call to float64 anyway.  ``‖k‖² <= d_k max|k|²``, with a factor 2 for the
        rounding of the float32 sum (beyond the limit by up to ``d_k`` roundings), so two
        passes over ``k`` (under 2 % of a float32 call) clear every call whose largest
        ``|k|`` is below ``sqrt(3.4e38 / (2 d_k))``, 4.6e18 at ``d_k = 8``; an inf goes to
        float64 too, a NaN does not (it stays in the rows that see it either way)."""
        limit = math.sqrt(float(np.finfo(np.float32).max) / (2 * max(k.shape[-1], 1)))
        return bool(k.size) and max(float(k.max()), -float(k.min())) >= limit


class FavorFeatures(ReadOnlyAttributes, Favor):
    """FAVOR+ positive orthogonal random features (Performer; Choromanski et al. 2021).

    ``φ(x) = exp(ω x' − ‖x'‖² / 2) / √m`` with ``x' = x / d_k^¼``, so that
    ``E[φ(q)ᵀφ(k)] = exp(qᵀk / √d_k)``, the softmax kernel of
    :func:`fastattn.softmax_attention` at its default scale.  The ``m`` rows
    of ``ω`` are drawn in orthogonal blocks of ``d_k`` rows with
    chi(d_k)-distributed norms (each row marginally ``N(0, I_{d_k})``), which
    lowers the variance against i.i.d. rows.

    Pass the object as ``feature_map=`` to :func:`fastattn.linear_attention`
    or :func:`fastattn.attention_weights`; ``feature_map="favor"`` means
    ``FavorFeatures(d_k)`` with the defaults below.

    Parameters
    ----------
    d_k : int
        Key dimension of the inputs it will be applied to (>= 1).
    num_features : int, optional
        ``m``, the feature dimension ``D``.  Default
        :func:`default_num_features` (``d_k · ln d_k`` rounded, at least
        ``d_k``: 111 for ``d_k = 32``, 266 for ``d_k = 64``).
    random_state : int or numpy.random.Generator, default 0
        Seed (or generator) of ``ω``; a given seed gives the same ``ω``
        everywhere, so a call is reproducible.

    Attributes
    ----------
    omega : ndarray of shape (num_features, d_k), float64, read-only
        The random projection ``ω``.  It and the attributes below are fixed
        once the map is made (setting one raises AttributeError): the
        projections of each dtype are cached from them.  Another ``ω`` is
        another ``FavorFeatures``.
    d_k, num_features : int
    state_shift : float
        ``c = max_r ‖ω_r‖² / 2``, the fixed reference frame of the linear
        attention state (see Notes).

    Raises
    ------
    TypeError
        If ``d_k`` or ``num_features`` is not an int, or ``random_state`` is
        neither an int nor a ``numpy.random.Generator``.
    ValueError
        If ``d_k`` or ``num_features`` is < 1 or beyond an array dimension
        (``2**63 - 1``), or ``random_state`` < 0.

    Notes
    -----
    **Stabilisation.**  The exponent can be far outside the range of
    ``exp`` for large ``‖x‖``, so linear attention uses shifted features
    whose shifts cancel in the ratio ``φ(q)·S / φ(q)·z``:

    * keys: one shift ``c_r`` per feature ``r`` for all keys of one head in
      the call, the feature's largest exponent ``max_j (ω_r k'_j −
      ‖k'_j‖²/2)``; ``φ(k_j)_r = exp(ω_r k'_j − ‖k'_j‖²/2 − c_r) / √m``;
    * queries: the keys' shifts added, and one shift per row,
      ``φ(q_i)_r = exp(ω_r q'_i + c_r − M_i) / √m`` with
      ``M_i = max_r (ω_r q'_i + c_r)`` (``‖q'‖²/2``, constant along the
      row, goes into the same shift).

    Each product ``φ(q_i)_r φ(k_j)_r`` is the unshifted one times
    ``exp(‖q'_i‖²/2 − M_i)``, the same for the whole row, so the ratio is
    unchanged; and the row's largest term is ``1/m`` (feature ``r`` of
    ``M_i`` against the key of ``c_r``).  No finite input overflows, and
    non-causally no denominator underflows, at any norm.  Causally a row
    sees only the keys up to its own, whose features may all underflow in
    the frame of the later keys (``‖k‖² / √d_k`` beyond about 170 in
    float32, 1400 in float64); the rows whose denominator is too small to
    hold its digits (below ``n_k · m · tiny / eps_machine``; none unless a
    head's first key is that far out) are recomputed in float64 from the
    exponents by log-sum-exp, ``O(n_k · m · (d_k + d_v))`` a row.  The
    shifts scale numerator and denominator alike, so they cancel except
    against ``eps``, which is in effect measured in the row's frame
    ``M_i``, per ``1/m``; that frame is known only to the rounding of its
    exponent (``|M_i|`` times 6e-8 in float32), and so is the weight of a
    non-zero ``eps`` at large norms.

    **The state across pieces.**  The returned state ``(S, z)`` is always in
    one fixed reference frame independent of the data,
    ``S = Σ_j exp(ω k'_j − ‖k'_j‖²/2 − state_shift) v_jᵀ / √m`` (and ``z``
    alike): every term is at most ``1/√m`` times ``v_j``, because
    ``ω_r·k' − ‖k'‖²/2 = ‖ω_r‖²/2 − ‖k' − ω_r‖²/2 <= state_shift``, so the
    state never overflows, and states of consecutive pieces simply add.  A
    call given an ``initial_state`` works in the frame
    ``max(c_r, state_shift + ln z0_r)`` of each feature, in which neither the
    earlier keys nor its own overflow, and converts its final state back.
    Chaining pieces therefore equals one pass (exactly with ``eps = 0``, the
    default of :func:`fastattn.linear_attention` for FAVOR+; otherwise up to
    ``eps`` being measured in each piece's frame).  Keys whose every
    exponent lies more than about 87 (float32) / 708 (float64) below
    ``state_shift`` underflow to 0 in the *returned* state, in the dtype the
    call computes in (float32 inputs give a float32 state, whatever state
    is passed in): from ``‖k‖`` of about ``d_k^¼ (√d_k + 13)`` in float32
    and ``d_k^¼ (√d_k + 38)`` in float64 (34 and 84 for ``d_k = 16``),
    less along some directions.  The call's own output still counts them.

    Complexity: features ``O(n · m · d_k)`` (one GEMM and ``n · m`` exps),
    attention ``O(n · m · d_v)``; state ``m · (d_v + 1)`` numbers per head.

    References
    ----------
    K. Choromanski et al., "Rethinking Attention with Performers", ICLR 2021.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> favor = fastattn.FavorFeatures(32, num_features=128, random_state=1)
    >>> favor.omega.shape
    (128, 32)
    >>> q, k, v = (np.random.default_rng(0).standard_normal((64, 32)) for _ in range(3))
    >>> fastattn.linear_attention(q, k, v, feature_map=favor).shape
    (64, 32)
    """

    read_only = ("d_k", "num_features", "random_state", "omega", "state_shift", "_projections")

    def __init__(self, d_k, num_features=None, random_state=0):
        self.d_k = _positive_int(d_k, "d_k")
        self.num_features = (default_num_features(self.d_k) if num_features is None
                             else _positive_int(num_features, "num_features"))
        if isinstance(random_state, np.random.Generator):
            rng = random_state
            self.random_state = random_state
        elif isinstance(random_state, numbers.Integral) and not isinstance(random_state, bool):
            if random_state < 0:
                raise ValueError(f"random_state must be an int >= 0, got {random_state!r}")
            rng = np.random.default_rng(int(random_state))
            self.random_state = int(random_state)
        else:
            raise TypeError(
                "random_state must be an int or a numpy.random.Generator, "
                f"got {type(random_state).__name__}"
            )
        # ω in float64, and the projections of every dtype made from it.
        reference.check_fits_in_memory(
            3 * self.num_features * self.d_k * 8,
            f"FavorFeatures(d_k={self.d_k}, num_features={self.num_features})",
            advice="choose a smaller num_features (a few times d_k to a few thousand)"
            + (f" or d_k (the default num_features grows as d_k ln d_k)"
               if num_features is None else ""))
        omega = orthogonal_gaussian_features(self.d_k, self.num_features, rng)
        self.omega = omega
        self.state_shift = float(np.max(np.sum(omega * omega, axis=1)) / 2)
        self._projections = {}
        self._freeze()

    def projection(self, dtype):
        """``(ω / d_k^¼)ᵀ`` of shape ``(d_k, m)`` in ``dtype``, C-contiguous (cached)."""
        dtype = np.dtype(dtype)
        if dtype not in self._projections:
            w = np.ascontiguousarray((self.omega / self.d_k ** 0.25).T, dtype=dtype)
            w.setflags(write=False)
            self._projections[dtype] = w
        return self._projections[dtype]

    def __call__(self, x):
        """The unshifted features ``exp(ω x' − ‖x'‖²/2) / √m`` in float64.

        Parameters
        ----------
        x : array_like of shape (..., d_k)

        Returns
        -------
        ndarray of shape (..., num_features), float64
            May overflow to inf or underflow to 0 for large ``‖x‖``; linear
            attention uses the stabilised form of the class Notes instead.

        Raises
        ------
        ValueError
            If the last dimension of ``x`` is not ``d_k``.
        """
        x = np.asarray(x, dtype=np.float64)
        if x.ndim < 1 or x.shape[-1] != self.d_k:
            raise ValueError(f"x must have shape (..., {self.d_k}), got {x.shape}")
        xs = x / self.d_k ** 0.25
        with np.errstate(over="ignore", under="ignore"):
            return np.exp(xs @ self.omega.T - 0.5 * np.sum(xs * xs, axis=-1, keepdims=True)) \
                / math.sqrt(self.num_features)

    def feature_dim(self, d_k=None, num_features=None):
        """``D = m``, this object's ``num_features``."""
        return self.num_features

    def bind(self, d_k, d_k_of="q and k have"):
        if self.d_k != d_k:
            raise ValueError(f"feature_map is {self!r}, built for d_k={self.d_k}, but "
                             f"{d_k_of} d_k={d_k}")
        return self

    def numpy_features(self, x):
        """Key features in the keys' own frame (see Notes), the NumPy form."""
        return reference.favor_key_features(x, self.projection(x.dtype))[0]

    def features(self, module, q, k, batch_shape, z0=None):
        """φ(q), φ(k) and the frame of each feature, by ``module``'s FAVOR+ kernels (the
        NumPy forms of :mod:`fastattn.reference` for a backend without them).

        For ``z0 (B, m)`` (the initial state's key sums, or None) the frame of each
        feature is set together with the keys (see Notes), and the query features
        are taken in that frame.
        """
        key_features = getattr(module, "favor_key_features", reference.favor_key_features)
        query_features = getattr(module, "favor_query_features", reference.favor_query_features)
        w = self.projection(q.dtype)
        phi_k, shift = key_features(k, w)
        if z0 is not None:
            phi_k, shift = _state_frame(phi_k, shift, self.state_shift, z0)
        return Features(query_features(q, w, shift), phi_k, shift)

    def forward_in_dtype(self, module, feats, q, k, v, causal, eps, S0, z0):
        """Linear attention from the features in the call's frame (a shift ``c_r`` per feature
        and head); the state is converted from and to the fixed frame :attr:`state_shift`.
        A float32 call that comes out non-finite from finite inputs is computed in float64
        (:meth:`FeatureMap.forward`): its ratio can overflow at the float32 limit."""
        return _favor_forward(self, module, feats, q, k, v, causal, eps, S0, z0)

    def __repr__(self):
        return (f"FavorFeatures(d_k={self.d_k}, num_features={self.num_features}, "
                f"random_state={self.random_state!r})")


@functools.lru_cache(maxsize=None)
def _default_favor(d_k):
    return FavorFeatures(d_k)


class UserMap(FeatureMap):
    """A callable ``feature_map=``: ``fn(x)`` for ``x (..., n, d_k)`` gives finite,
    non-negative float features ``(..., n, D)``, checked at every call."""

    name = "callable"

    def __init__(self, fn):
        self.fn = fn

    def feature_dim(self, d_k, num_features=None):
        return None   # known once it has run

    def _wide_features(self, module, feats, q, k, z0):
        # The features as the callable gave them (checked finite): it is not called again.
        return feats.widened()

    def features(self, module, q, k, batch_shape, z0=None):
        phi_q = _user_features(self.fn, q, batch_shape, q.dtype, "q")
        phi_k = _user_features(self.fn, k, batch_shape, q.dtype, "k")
        if phi_q.shape[-1] != phi_k.shape[-1]:
            raise ValueError(f"feature_map returned D={phi_q.shape[-1]} features for q but "
                             f"D={phi_k.shape[-1]} for k")
        return Features(phi_q, phi_k)

    def __repr__(self):
        return f"UserMap({self.fn!r})"


# ---------------------------------------------------------------------------
# The registry.
# ---------------------------------------------------------------------------

#: Name -> :class:`FeatureMap`: the maps fastattn knows by name.
REGISTRY = {}

#: The names of :data:`REGISTRY` (kept in step by :func:`register`).
NAMES = ()

#: The names of the maps the kernels apply elementwise (``D = d_k``).
ELEMENTWISE = ()


def _names_changed():
    global NAMES, ELEMENTWISE
    NAMES = tuple(REGISTRY)
    ELEMENTWISE = tuple(name for name, fmap in REGISTRY.items() if fmap.elementwise)


def _check_elementwise(fmap):
    """ValueError unless ``fmap.elementwise`` is None or a map the kernels apply."""
    if fmap.elementwise is not None and fmap.elementwise not in BUILTIN_ELEMENTWISE:
        raise ValueError(f"feature map {type(fmap).__name__}: elementwise must be None or one "
                         f"of the maps the kernels apply ({', '.join(BUILTIN_ELEMENTWISE)}), "
                         f"got {fmap.elementwise!r}")


def register(fmap):
    """Make the :class:`FeatureMap` ``fmap`` known by its ``name``; returns it.

    Raises
    ------
    TypeError
        If ``fmap`` is not a FeatureMap.
    ValueError
        If it has no name, or the name is taken.
    """
    if not isinstance(fmap, FeatureMap):
        raise TypeError(f"register takes a FeatureMap, got {type(fmap).__name__}")
    if not isinstance(fmap.name, str) or not fmap.name or fmap.name == UserMap.name:
        raise ValueError(f"a registered feature map needs a name of its own, got {fmap.name!r}")
    if fmap.name in REGISTRY:
        raise ValueError(f"a feature map named {fmap.name!r} is registered already")
    _check_elementwise(fmap)
    if fmap.elementwise is None and all(getattr(type(fmap), m) is getattr(FeatureMap, m)
                                       for m in ("numpy_features", "features", "bind")):
        raise ValueError(f"feature map {fmap.name!r} must implement numpy_features")
    D = fmap.feature_dim(8)
    if D is not None and (isinstance(D, bool) or not isinstance(D, numbers.Integral) or D < 1):
        raise ValueError(f"feature map {fmap.name!r}: feature_dim must give a positive int or "
                         f"None, got {D!r}")
    REGISTRY[fmap.name] = fmap
    _names_changed()
    return fmap


def unregister(name):
    """Forget the map ``name`` (KeyError if none is registered; ValueError for fastattn's own,
    which the defaults and the kernels rely on)."""
    if name in BUILTIN_NAMES:
        raise ValueError(f"{name!r} is one of fastattn's own feature maps; it stays registered")
    del REGISTRY[name]
    _names_changed()


#: The maps the compiled kernels apply elementwise, and fastattn's own maps.
BUILTIN_ELEMENTWISE = ("elu", "relu")
BUILTIN_NAMES = ("elu", "relu", "favor", "taylor")
for _fmap in (Elu(), Relu(), Favor(), Taylor()):
    register(_fmap)
del _fmap


def feature_dim(name, d_k, num_features=None):
    """``D``, the feature dimension of the map ``name`` at head dimension ``d_k``, drawn from
    nothing (no random features are made): ``d_k`` for elu and relu, ``num_features`` (or
    :func:`default_num_features`) for favor, :func:`taylor_num_features` for taylor.

    Raises
    ------
    ValueError
        If ``name`` is not in :data:`REGISTRY`.
    """
    fmap = REGISTRY.get(name) if isinstance(name, str) else None
    if fmap is None:
        raise ValueError(f"feature_map: expected one of {', '.join(NAMES)}, got {name!r}")
    return fmap.feature_dim(d_k, num_features)


def resolve(feature_map, d_k, d_k_of="q and k have"):
    """Validate ``feature_map=`` for inputs of key dimension ``d_k``; return its FeatureMap.

    A name of :data:`REGISTRY`, a :class:`FeatureMap` (e.g. a :class:`FavorFeatures`)
    or a callable.  ``d_k_of`` says whose ``d_k`` it is, in the error for a
    FavorFeatures of another.

    Raises
    ------
    ValueError
        An unknown name (listing the known ones), a :class:`FavorFeatures`
        built for another ``d_k``, or a map whose ``elementwise`` no kernel
        applies.
    """
    if isinstance(feature_map, str):
        if feature_map in REGISTRY:
            return REGISTRY[feature_map].bind(d_k, d_k_of)
    elif isinstance(feature_map, type) and issubclass(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a feature map, got the class "
                        f"{feature_map.__name__}: make one first, e.g. "
                        f"{feature_map.__name__}({d_k}) for d_k = {d_k}")
    elif isinstance(feature_map, FeatureMap):
        _check_elementwise(feature_map)   # a map passed as it is, not registered
        return feature_map.bind(d_k, d_k_of)
    elif callable(feature_map):
        return UserMap(feature_map)
    raise ValueError(
        f"feature_map must be one of {list(NAMES)}, a FeatureMap (a fastattn.FavorFeatures, a "
        f"fastattn.HedgehogFeatures), or a callable "
        f"mapping (..., n, d_k) to non-negative (..., n, D) features; got {feature_map!r}"
    )


def _user_features(fn, x, batch_shape, dtype, which):
    """``fn(x)`` for ``x (B, n, d_k)`` shown to ``fn`` as ``batch_shape + (n, d_k)``, validated."""
    # A read-only view: x may be the caller's own q or k (a C-contiguous array of the
    # computation dtype is passed on as it is), which a map must never change.  Read-only
    # whatever the caller's layout, so a map that writes into its input fails alike for all.
    # Through a read-only buffer: the map cannot set the view writeable again either.
    # O(1), no copy (x is C-contiguous).
    shown = np.asarray(memoryview(x).toreadonly()).reshape(batch_shape + x.shape[1:])
    what = f"feature_map({which})"
    try:
        phi = fn(shown)
    except ValueError as exc:
        if "read-only" not in str(exc):
            raise
        raise ValueError(
            f"{what} wrote into its input, which is read-only (it may be the caller's "
            f"{which}): return new features, e.g. np.maximum(x, 0), not np.maximum(x, 0, out=x) "
            f"({exc})") from exc
    _check_feature_type(phi, what)
    if phi.ndim != shown.ndim or phi.shape[:-1] != shown.shape[:-1] or phi.shape[-1] < 1:
        raise ValueError(
            f"{what} must return features of shape {_checks.shape_text(*shown.shape[:-1], 'D')} "
            f"with D >= 1 for "
            f"{which} of shape {shown.shape}, got {phi.shape}"
        )
    top = _checks.beyond_dtype(phi, dtype)
    if top is not None:
        raise ValueError(f"{what} returned {top:.4g}, beyond the computation dtype {dtype} "
                         f"(at most {np.finfo(dtype).max:.4g}); pass float64 q, k and v")
    phi = np.require(phi.reshape(x.shape[:2] + phi.shape[-1:]), dtype=dtype,
                     requirements=["C", "A", "W"])
    _check_feature_values(phi, what)
    return phi


def _check_feature_type(phi, what):
    """TypeError naming ``what`` unless ``phi`` is a plain float ndarray."""
    if isinstance(phi, np.ma.MaskedArray):
        raise TypeError(
            f"{what} must return a plain numpy.ndarray, got a numpy.ma.MaskedArray whose mask "
            f"would be ignored; return e.g. features.filled(0.0)")
    if not isinstance(phi, np.ndarray):
        raise TypeError(f"{what} must return a numpy.ndarray, got {type(phi).__name__}")
    if phi.dtype.kind != "f":
        raise TypeError(f"{what} must return float features, got dtype {phi.dtype}")


def _check_feature_values(phi, what, nonnegative=True, advice=""):
    """ValueError naming ``what`` unless the features ``phi`` are finite (and, when
    ``nonnegative``, >= 0): the one check of features formed by code fastattn did not write
    (a callable's, a registered map's NumPy form)."""
    finite = np.isfinite(phi)
    if not finite.all():
        raise ValueError(f"{what} returned {np.count_nonzero(~finite)} non-finite values (NaN or "
                         f"inf); features must be finite")
    if nonnegative and (phi < 0).any():
        raise ValueError(f"{what} returned {np.count_nonzero(phi < 0)} negative values "
                         f"(min {float(phi.min()):.6g}); features must be >= 0{advice}")


def _state_frame(phi_k, shift, fixed, z0):
    """The frame ``max(c_r, fixed + ln z0_r)`` of each feature, and ``φ(k)`` brought into it.

    Where the earlier keys (the state) dominate a feature, this call's keys
    are scaled down into their frame; the state is scaled into it by
    :func:`_favor_forward`.  ``shift, z0 (B, m)``, ``phi_k (B, n_k, m)``.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        floor = np.where(z0 > 0, fixed + np.log(z0.astype(np.float64)), -np.inf)
    frame = np.maximum(shift, floor)
    lift = frame > shift
    if lift.any():
        phi_k = phi_k * np.exp(shift - frame).astype(phi_k.dtype)[:, None, :]
    return phi_k, frame


def _favor_forward(favor, module, feats, q, k, v, causal, eps, S0, z0):
    """FAVOR+ from its features, the state converted from and to the fixed frame.

    Causal rows whose denominator may have underflowed are recomputed by
    :func:`_exact_causal_rows`.
    """
    fixed = favor.state_shift
    frame = feats.key_shift
    S0_in, z0_in = S0, z0
    if S0 is not None:
        # In float64, and 0 stays 0: the factor itself may exceed float32 (an earlier
        # state whose keys all underflowed, z0 = 0), while its products never do.
        with np.errstate(over="ignore", invalid="ignore"):
            into = np.exp(fixed - frame)
            S0 = np.where(S0 == 0, 0, S0 * into[:, :, None]).astype(S0.dtype)
            z0 = np.where(z0 == 0, 0, z0 * into).astype(z0.dtype)
    out, S, z = module.linear_forward(feats.q, feats.k, v, "identity", causal, eps, S0, z0)
    if causal:
        _exact_causal_rows(favor, feats, q, k, v, eps, S0_in, z0_in, z0, out)
    back = np.exp(frame - fixed).astype(S.dtype)
    with np.errstate(invalid="ignore", over="ignore"):  # an inf in the state given stays
        return out, S * back[:, :, None], z * back


#: Bytes of the float64 temporaries of the exact rows per block of rows.
_EXACT_BLOCK_BYTES = 1 << 25


def _underflowed_rows(feats, dtype, z0=None, z0_frame=None):
    """``(b, rows)`` of the causal FAVOR+ rows whose denominator may have lost digits.

    A causal row sees only the keys up to its own, while the frame of each
    feature is set by all keys of the call, so the features of every key a
    row sees can underflow (for keys of ``‖k‖² / √d_k`` beyond about 170 in
    float32, 1400 in float64).  A row's denominator ``φ(q_i) · z_i`` is the
    sum of the terms that survive, and each lost term is below ``tiny``: a
    denominator of at least ``n_k · m · tiny / eps_machine`` has lost less
    than one rounding error, and its row is kept.  The others, among the
    rows that see a key or a state, are listed.

    ``z0`` is the initial state's key sums in the fixed frame and
    ``z0_frame`` in the call's frame (both None without one).  Time ``O(m)``
    a head whose first key and state sit within reach of the frame (every
    row's largest feature meets them), else ``O(n · m)``.
    """
    B, n_q, m = feats.q.shape
    n_k = feats.k.shape[1]
    offset = n_k - n_q  # row i sees the keys j <= i + offset
    info = np.finfo(dtype)
    floor = n_k * m * float(info.tiny) / float(info.eps)
    seen_by_all = feats.k[:, 0, :].astype(np.float64)
    if z0_frame is not None:
        seen_by_all = seen_by_all + z0_frame
    # Each row's largest query feature is 1/√m, so den_i >= min_r seen_by_all / √m.
    for b in np.flatnonzero(seen_by_all.min(axis=1) / math.sqrt(m) < floor):
        z_start = np.zeros(m) if z0_frame is None else z0_frame[b].astype(np.float64)
        den = _causal_denominators(feats.q[b], feats.k[b], z_start, offset)
        sees = np.arange(n_q) + offset >= 0
        if z0 is not None and np.any(z0[b] > 0):
            sees[:] = True
        rows = np.flatnonzero((den < floor) & sees)
        if rows.size:
            yield b, rows


def _causal_denominators(phi_q, phi_k, z_start, offset):
    """``φ(q_i) · (z_start + Σ_{j <= i + offset} φ(k_j))`` in float64, keys taken in blocks."""
    n_q, m = phi_q.shape
    n_k = phi_k.shape[0]
    den = np.empty(n_q)
    blind = min(n_q, max(0, -offset))  # rows that see no key
    den[:blind] = phi_q[:blind].astype(np.float64) @ z_start
    block = max(1, _EXACT_BLOCK_BYTES // (8 * m))
    running = z_start
    for j0 in range(0, n_k, block):
        j1 = min(n_k, j0 + block)
        z = running + np.cumsum(phi_k[j0:j1], axis=0, dtype=np.float64)
        i0, i1 = max(0, j0 - offset), min(n_q, j1 - offset)
        if i1 > i0:
            den[i0:i1] = np.einsum("im,im->i", phi_q[i0:i1],
                                   z[i0 + offset - j0:i1 + offset - j0])
        running = z[-1]
    return den


def _key_exponents(favor, k):
    """``e_jr = (ω k'_j)_r − ‖k'_j‖²/2`` of one head's keys ``k (n_k, d_k)``, in float64."""
    k64 = k.astype(np.float64)
    return k64 @ favor.projection(np.float64) - (
        np.einsum("nd,nd->n", k64, k64) / (2 * math.sqrt(favor.d_k)))[:, None]


def _eps_in_frame(eps, m, row_frame, top):
    """``eps`` as the kernels apply it (in the row's frame ``row_frame``, per ``1/m``), for
    a numerator and denominator scaled by ``exp(−top)``; 0.0 for ``eps = 0``."""
    if not eps:
        return 0.0
    with np.errstate(over="ignore"):
        return eps * m * np.exp(row_frame - top)


def _exact_blocks(favor, q, k, rows, offset, frame, eps):
    """Causal FAVOR+ weights of one head's ``rows`` from the exponents, in float64.

    With ``a_ir = (ω q'_i)_r`` and ``e_jr = (ω k'_j)_r − ‖k'_j‖²/2``, the
    kernel ``K_ij = Σ_r exp(a_ir + e_jr)`` is taken by log-sum-exp and
    scaled by ``exp(−L_i)``, ``L_i`` the row's largest log term, so nothing
    underflows.  ``eps`` is measured as the kernels measure it: in the row's
    frame ``M_i = max_r (a_ir + frame_r)`` and per ``1/m``.  Yields, per
    block of rows, ``(part, weights (R, n_seen), eps (R,) or 0.0)``; time
    ``O(n_k · m · d_k)`` a row.
    """
    from scipy.special import logsumexp   # deferred: 0.1 s of import fastattn

    m = favor.num_features
    w = favor.projection(np.float64)
    e = _key_exponents(favor, k)
    block = max(1, _EXACT_BLOCK_BYTES // (8 * m * k.shape[0]))
    for start in range(0, rows.size, block):
        part = rows[start:start + block]
        a = q[part].astype(np.float64) @ w                                   # (R, m)
        n_seen = max(0, int(part[-1]) + offset + 1)
        with np.errstate(under="ignore"):
            log_k = logsumexp(a[:, None, :] + e[None, :n_seen, :], axis=-1)  # (R, n_seen)
        log_k[np.arange(n_seen)[None, :] > part[:, None] + offset] = -np.inf
        top = log_k.max(axis=1, initial=-np.inf)
        scaled_eps = _eps_in_frame(eps, m, (a + frame).max(axis=1), top)
        yield part, np.exp(log_k - top[:, None]), scaled_eps


#: Keys a step of :func:`_stable_causal_head` takes (its quadratic part is this squared).
_STABLE_CHUNK = 64


def _exact_causal_rows(favor, feats, q, k, v, eps, S0, z0, z0_frame, out):
    """Recompute in ``out`` the causal rows of :func:`_underflowed_rows`, by
    :func:`_stable_causal_head` on each head that has any."""
    offset = feats.k.shape[1] - feats.q.shape[1]
    for b, rows in _underflowed_rows(feats, out.dtype, z0, z0_frame):
        state = None if S0 is None else (S0[b], z0[b])
        exact = _stable_causal_head(favor, q[b], k[b], v[b], eps, state, offset,
                                    feats.key_shift[b])
        out[b, rows] = exact[rows]


def _stable_causal_head(favor, q, k, v, eps, state, offset, frame):
    """Causal FAVOR+ of one head in float64 with a frame that follows the keys, chunk by chunk.

    The running state ``(S, z)`` is kept in the frame ``c_r`` of the largest key exponent
    seen so far of each feature (so the largest term of ``z_r`` is 1), and rescaled
    when a chunk of :data:`_STABLE_CHUNK` keys raises it.  A row takes the state
    before its chunk by the features ``exp(a_ir + c_r − M_i)`` (``M_i = max_r (a_ir +
    c_r)``: the largest term is 1, nothing underflows) and the keys of its own chunk
    by ``K_ij = Σ_r exp(a_ir + e_jr)`` in log space (log-sum-exp), each part scaled by
    its own largest log term before the two are added.  ``a_ir = (ω q'_i)_r``,
    ``e_jr = (ω k'_j)_r − ‖k'_j‖²/2``; a state ``(S0, z0)`` in the fixed frame enters
    as ``z_r = z0_r √m e^{state_shift}``.  ``eps`` is measured as the kernels measure
    it, in the row's frame ``max_r (a_ir + frame_r)`` and per ``1/m``.  Time
    ``O(n · m · (chunk + d_k + d_v))``; returns ``(n_q, d_v)`` in ``v``'s dtype.
    """
    from scipy.special import logsumexp   # deferred: 0.1 s of import fastattn

    m = favor.num_features
    v64 = v.astype(np.float64)
    a = q.astype(np.float64) @ favor.projection(np.float64)                   # (n_q, m)
    e = _key_exponents(favor, k)
    n_q, n_k, d_v = a.shape[0], e.shape[0], v.shape[1]
    c = np.full(m, -np.inf)
    S, z = np.zeros((m, d_v)), np.zeros(m)
    if state is not None:
        z0 = state[1].astype(np.float64)
        held = z0 > 0
        c[held] = favor.state_shift + np.log(z0[held] * math.sqrt(m))
        S[held] = state[0][held].astype(np.float64) / z0[held, None]
        z[held] = 1.0
    out = np.zeros((n_q, d_v))
    kernel_frame = (a + frame).max(axis=1)

    def finish(rows, parts):
        """``out[rows]`` from ``(log_scale, num, den)`` parts, each scaled by its own max."""
        top = np.max([p[0] for p in parts], axis=0)
        num, den = np.zeros((len(rows), d_v)), np.zeros(len(rows))
        for scale, p_num, p_den in parts:
            with np.errstate(invalid="ignore", under="ignore"):
                f = np.where(np.isfinite(scale), np.exp(scale - top), 0.0)
            num += f[:, None] * p_num
            den += f * p_den
        scaled_eps = _eps_in_frame(eps, m, kernel_frame[rows], top)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[rows] = np.where((den > 0)[:, None], num / (den + scaled_eps)[:, None], 0.0)

    def through_state(rows):
        """``(log_scale, num, den)`` of the state for ``rows``, or None without one."""
        if not np.isfinite(c).any():
            return None
        shifted = a[rows] + c                                                 # (R, m)
        top = shifted.max(axis=1)
        with np.errstate(invalid="ignore", under="ignore"):
            phi = np.exp(shifted - top[:, None])
        return top, phi @ S, phi @ z

    blind = np.arange(min(n_q, max(0, -offset)))  # rows that see no key: the state alone
    if blind.size and (part := through_state(blind)) is not None:
        finish(blind, [part])
    for j0 in range(0, n_k, _STABLE_CHUNK):
        j1 = min(n_k, j0 + _STABLE_CHUNK)
        rows = np.arange(max(0, j0 - offset), min(n_q, j1 - offset))
        if rows.size:
            with np.errstate(under="ignore"):
                log_k = logsumexp(a[rows, None, :] + e[None, j0:j1, :], axis=-1)  # (R, C)
            log_k[np.arange(j0, j1)[None, :] > rows[:, None] + offset] = -np.inf
            top = log_k.max(axis=1)
            weights = np.exp(log_k - top[:, None])
            parts = [(top, weights @ v64[j0:j1], weights.sum(axis=1))]
            if (part := through_state(rows)) is not None:
                parts.append(part)
            finish(rows, parts)
        # The chunk's keys join the state, in the frame that now includes them.
        c_new = np.maximum(c, e[j0:j1].max(axis=0))
        with np.errstate(invalid="ignore", under="ignore"):
            keep = np.where(np.isfinite(c), np.exp(c - c_new), 0.0)
            phi_k = np.exp(e[j0:j1] - c_new)                                   # (C, m)
        S = S * keep[:, None] + phi_k.T @ v64[j0:j1]
        z = z * keep + phi_k.sum(axis=0)
        c = c_new
    return out.astype(v.dtype)


def exact_causal_weights(favor, feats, q, k, eps, weights):
    """Recompute in ``weights (B, n_q, n_k)`` the causal FAVOR+ rows of :func:`_underflowed_rows`
    by :func:`_exact_blocks` (``O(n_k · m · d_k)`` a row, as the ``n_q x n_k`` weights cost
    ``O(n_k · m)`` a row anyway)."""
    offset = feats.k.shape[1] - feats.q.shape[1]
    for b, rows in _underflowed_rows(feats, weights.dtype):
        for part, w, scaled_eps in _exact_blocks(favor, q[b], k[b], rows, offset,
                                                 feats.key_shift[b], eps):
            weights[b, part] = 0
            weights[b, part, :w.shape[1]] = w / (w.sum(axis=1) + scaled_eps)[:, None]
