"""Linear attention in Numba: non-causal and chunked causal forms.

Katharopoulos et al., "Transformers are RNNs" (ICML 2020)::

    out_i = φ(q_i) S_i / (φ(q_i) · z_i + eps),
    S_i = S0 + Σ_{j seen by i} φ(k_j)ᵀ v_j,    z_i = z0 + Σ_{j seen by i} φ(k_j)

The key axis is cut into segments.  Three passes (1 and 3 parallel):

1. ``segment_states``: per (head, segment) the state increment
   ``ΔS = φ(k_seg)ᵀ v_seg`` and ``Δz = Σ φ(k_seg)`` (BLAS, one thread each);
2. ``prefix_states`` (serial): exclusive prefix sums over segments, starting at
   ``(S0, z0)``: the state before each segment, and the final state;
3. ``chunk_outputs``: per (head, chunk of queries) the output from the state
   before the chunk's keys plus, when causal, the masked quadratic term of
   the keys inside the chunk (as in the chunk form of flash-linear-attention).

Non-causal, every query uses the final state.  Causal, with the bottom-right
aligned mask, query chunk ``t`` (rows ``[i0, i1)``) owns the keys
``[i0 + off, i1 + off)`` (``off = n_k - n_q``, clamped to ``[0, n_k]``): the
segments are those key ranges, after the keys ``[0, off)`` every query sees.
Inside a chunk each row only forms the terms it sees, so an inf or NaN in a
key or value never reaches a row that does not see it.

Time ``O(B n d_k d_v)`` plus ``O(B n c d)`` for the chunks (``c`` =
``LINEAR_CHUNK``); extra memory one ``(d_k, d_v)`` state per segment.
"""

import numpy as np
from numba import njit, prange

from .config import (
    JIT_PARALLEL, JIT_SERIAL, LINEAR_CHUNK, LINEAR_SEGMENT, LINEAR_STEP, wide_vectors,
)
from ._exp import fast_exp, fast_exp_nonpositive
from ._threads import launch

#: Feature map name -> code passed to the kernels (a runtime argument, so one
#: compiled kernel per dtype serves them all).  ``identity``: the inputs are
#: features already (FAVOR+, Taylor, a user's map; see
#: :mod:`fastattn.feature_maps`), of any dimension D.
FEATURE_MAP_CODES = {"elu": 0, "relu": 1, "identity": 2}

#: Rows per work item of the feature kernels (FAVOR+, Taylor).
FEATURE_BLOCK = 128


@njit(**JIT_SERIAL)
def row_scale(d, one, zero, nan):
    """Linear attention's row scale ``one / d``: ``zero`` where the denominator ``d`` is
    exactly 0 (relu with eps = 0: the row becomes ``row * 0``), ``nan`` where it overflowed
    (the row NaN, never a finite ``row / inf`` that looks like an answer), as the
    reference's ``_normalise``.  The NaN is passed in: a ``d - d`` formed here came out 0
    under the kernels' fast-math flags."""
    if d == zero:
        return zero
    return nan if np.isinf(d) else one / d


@njit(**JIT_SERIAL)
def _feature_map(x, out, code, one, zero):
    """``out = φ(x)`` for a 2-D block: ``elu(x) + 1`` (code 0), ``max(x, 0)``
    (code 1) or ``x`` (code 2, features computed beforehand).

    NaN stays NaN (as in the reference); ``elu`` of ``-inf`` is 0.
    """
    wide_vectors()
    rows, cols = x.shape
    if code == 0:
        for i in range(rows):
            for c in range(cols):
                xi = x[i, c]
                out[i, c] = xi + one if xi > zero else fast_exp(xi)
    elif code == 1:
        for i in range(rows):
            for c in range(cols):
                xi = x[i, c]
                out[i, c] = zero if xi <= zero else xi
    else:
        out[:, :] = x


@njit(**JIT_PARALLEL)
def _favor_query_exponents(x, w, key_shift, out):
    """``out = exp(x w + c − row max − ln(m)/2)`` block by block, ``c = key_shift (B, m)``."""
    B, n, _ = x.shape
    m = w.shape[1]
    nblk = -(-n // FEATURE_BLOCK)
    half_ln_m = x.dtype.type(0.5 * np.log(m))
    for item in prange(B * nblk):
        b = item // nblk
        i0 = (item % nblk) * FEATURE_BLOCK
        i1 = min(n, i0 + FEATURE_BLOCK)
        e = np.dot(x[b, i0:i1], w)
        c = key_shift[b]
        for i in range(i1 - i0):
            row = e[i]
            top = row[0] + c[0]
            for r in range(m):
                row[r] += c[r]
                top = max(top, row[r])
            top += half_ln_m
            for r in range(m):
                out[b, i0 + i, r] = fast_exp_nonpositive(row[r] - top)


@njit(**JIT_PARALLEL)
def _favor_key_exponents(x, w, out, peaks):
    """``out = x w − ‖x‖²/(2√d_k)`` block by block, and ``peaks[b, t, r]`` = the
    largest exponent of feature ``r`` in block ``t`` (NaN ignored)."""
    B, n, d_k = x.shape
    m = w.shape[1]
    nblk = peaks.shape[1]
    norm_coef = x.dtype.type(0.5 / np.sqrt(d_k))
    for item in prange(B * nblk):
        b = item // nblk
        t = item % nblk
        i0 = t * FEATURE_BLOCK
        i1 = min(n, i0 + FEATURE_BLOCK)
        e = np.dot(x[b, i0:i1], w)
        peak = peaks[b, t]
        for i in range(i1 - i0):
            row = e[i]
            sq = x.dtype.type(0)
            for a in range(d_k):
                sq += x[b, i0 + i, a] * x[b, i0 + i, a]
            sq *= norm_coef
            for r in range(m):  # branch-free, so it vectorises; a NaN is passed over
                er = row[r] - sq
                out[b, i0 + i, r] = er
                peak[r] = er if er > peak[r] else peak[r]


@njit(**JIT_PARALLEL)
def _favor_shift_exp(out, shift, half_ln_m):
    """``out[b, :, r] = exp(out[b, :, r] − shift[b, r] − ln(m)/2)`` in place."""
    B, n, m = out.shape
    h = out.dtype.type(half_ln_m)
    for item in prange(B * n):
        b = item // n
        i = item % n
        c = shift[b]
        row = out[b, i]
        for r in range(m):
            row[r] = fast_exp_nonpositive(row[r] - c[r] - h)


def favor_query_features(x, w, key_shift):
    """FAVOR+ query features ``(B, n, m)``: ``exp(x w + c − row max) / √m``.

    ``x (B, n, d_k)``, ``w = (ω / d_k^¼)ᵀ (d_k, m)`` of ``x``'s dtype, and the
    keys' frame ``key_shift = c (B, m)`` float64; see
    :func:`fastattn.reference.favor_query_features` (the specification).
    """
    B, n, _ = x.shape
    out = np.empty((B, n, w.shape[1]), x.dtype)
    key_shift = np.ascontiguousarray(key_shift, x.dtype)
    if key_shift.shape != (B, w.shape[1]):   # the loop trusts it (no bounds checks)
        raise ValueError(f"key_shift must have shape ({B}, {w.shape[1]}), got {key_shift.shape}")
    with launch(B * -(-n // FEATURE_BLOCK), x.size * w.shape[1]) as pick:
        pick(_favor_query_exponents)(x, w, key_shift, out)
    return out


def favor_key_features(x, w):
    """FAVOR+ key features ``(B, n, m)`` and the shift of each feature ``c (B, m)`` float64.

    ``exp(x w − ‖x‖²/(2√d_k) − c_br) / √m`` with ``c_br`` the largest exponent
    of feature ``r`` over the keys of head ``b``; see
    :func:`fastattn.reference.favor_key_features`.
    """
    B, n, _ = x.shape
    m = w.shape[1]
    out = np.empty((B, n, m), x.dtype)
    peaks = np.full((B, -(-n // FEATURE_BLOCK), m), -np.inf, x.dtype)
    with launch(B * peaks.shape[1], x.size * m) as pick:
        pick(_favor_key_exponents)(x, w, out, peaks)
    peak = peaks.max(axis=1, initial=-np.inf)
    shift = np.where(np.isfinite(peak), peak, 0).astype(x.dtype)
    with launch(B * n, out.size) as pick:
        pick(_favor_shift_exp)(out, shift, 0.5 * np.log(m))
    return out, shift.astype(np.float64)


@njit(**JIT_PARALLEL)
def _taylor_features(x, out):
    B, n, d_k = x.shape
    one = x.dtype.type(1)
    c1 = x.dtype.type(d_k ** -0.25)
    c_diag = x.dtype.type(1 / np.sqrt(2 * d_k))
    c_off = x.dtype.type(1 / np.sqrt(d_k))
    for item in prange(B * n):
        b = item // n
        i = item % n
        row = x[b, i]
        o = out[b, i]
        o[0] = one
        for a in range(d_k):
            o[1 + a] = row[a] * c1
        p = 1 + d_k
        for a in range(d_k):
            xa = row[a]
            o[p] = xa * xa * c_diag
            p += 1
            xs = xa * c_off
            for a2 in range(a + 1, d_k):
                o[p] = xs * row[a2]
                p += 1


def taylor_features(x):
    """Second-order Taylor features ``(B, n, 1 + d_k + d_k (d_k + 1) / 2)``.

    See :func:`fastattn.reference.taylor_features` (the specification).
    """
    B, n, d_k = x.shape
    out = np.empty((B, n, 1 + d_k + d_k * (d_k + 1) // 2), x.dtype)
    with launch(B * n, out.size) as pick:
        pick(_taylor_features)(x, out)
    return out


@njit(**JIT_PARALLEL)
def segment_states(k, v, bounds, code, consts, c, dS, dz):
    """Pass 1: ``dS[b, s] = φ(k_s)ᵀ v_s``, ``dz[b, s] = Σ φ(k_s)`` for the keys
    ``bounds[s]:bounds[s+1]``, taken ``c`` keys at a time."""
    B, n_k, d_k = k.shape
    d_v = v.shape[2]
    nseg = bounds.shape[0] - 1
    one, zero = consts[0], consts[1]
    for item in prange(B * nseg):
        wide_vectors()
        b = item // nseg
        s = item % nseg
        phi = np.empty((c, d_k), dtype=k.dtype)
        tmp = np.empty((d_k, d_v), dtype=k.dtype)
        S = dS[b, s]
        z = dz[b, s]
        S[:] = zero
        z[:] = zero
        for j0 in range(bounds[s], bounds[s + 1], c):
            j1 = min(bounds[s + 1], j0 + c)
            ph = phi[: j1 - j0]
            _feature_map(k[b, j0:j1], ph, code, one, zero)
            np.dot(ph.T, v[b, j0:j1], tmp)
            for r in range(d_k):
                for col in range(d_v):
                    S[r, col] += tmp[r, col]
            for j in range(j1 - j0):
                for r in range(d_k):
                    z[r] += ph[j, r]


@njit(**JIT_SERIAL)
def prefix_states(S0, z0, dS, dz):
    """Pass 2, in place: ``dS[b, s]`` becomes ``S0 + Σ_{s' < s} ΔS_{s'}`` (the
    state before segment ``s``); entry ``nseg`` (left zero by pass 1) becomes the final state."""
    B, nseg1, d_k, d_v = dS.shape
    for item in prange(B * d_k):
        b = item // d_k
        r = item % d_k
        # Row r of every segment's state, walked segment by segment so the
        # inner loop runs over contiguous memory.
        run = S0[b, r].copy()
        for s in range(nseg1):
            row = dS[b, s, r]
            for col in range(d_v):
                inc = row[col]
                row[col] = run[col]
                run[col] += inc
        zrun = z0[b, r]
        for s in range(nseg1):
            inc = dz[b, s, r]
            dz[b, s, r] = zrun
            zrun += inc


@njit(**JIT_PARALLEL)
def chunk_outputs(q, k, v, bounds, first_chunk_segment, causal, code, consts, c, dS, dz):
    """Pass 3: the output of every chunk of ``c`` queries, from the state before its keys
    (``consts``: ``(1, 0, eps, NaN)`` in the dtype)."""
    B, n_q, d_k = q.shape
    n_k, d_v = k.shape[1], v.shape[2]
    one, zero, eps, nan = consts[0], consts[1], consts[2], consts[3]
    off = n_k - n_q
    nseg = bounds.shape[0] - 1
    nchunks = (n_q + c - 1) // c
    out = np.empty((B, n_q, d_v), dtype=q.dtype)
    for item in prange(B * nchunks):
        wide_vectors()
        b = item // nchunks
        t = item % nchunks
        i0 = t * c
        i1 = min(n_q, i0 + c)
        rows = i1 - i0
        phq = np.empty((rows, d_k), dtype=q.dtype)
        num = np.empty((rows, d_v), dtype=q.dtype)
        den = np.empty(rows, dtype=q.dtype)
        _feature_map(q[b, i0:i1], phq, code, one, zero)
        s = first_chunk_segment + t if causal else nseg
        np.dot(phq, dS[b, s], num)
        z = dz[b, s]
        for i in range(rows):
            acc = zero
            for r in range(d_k):
                acc += phq[i, r] * z[r]
            den[i] = acc
        if causal:
            lo = bounds[s]
            hi = bounds[s + 1]
            cols = hi - lo
            if cols > 0:
                phk = np.empty((cols, d_k), dtype=q.dtype)
                _feature_map(k[b, lo:hi], phk, code, one, zero)
                A = np.dot(phq, phk.T)
                vc = v[b, lo:hi]
                finite = True
                for j in range(cols):
                    for col in range(d_v):
                        if not np.isfinite(vc[j, col]):
                            finite = False
                for i in range(rows):
                    lim = max(0, min(cols, i0 + i + off + 1 - lo))
                    acc = zero
                    for j in range(lim):
                        acc += A[i, j]
                    den[i] += acc
                    for j in range(lim, cols):
                        A[i, j] = zero
                if finite:
                    # Masked weights are 0 and every value is finite: one gemm.
                    num += np.dot(A, vc)
                else:
                    # Form only the terms a row sees: 0 * inf must not reach it.
                    for i in range(rows):
                        lim = min(cols, i0 + i + off + 1 - lo)
                        for j in range(lim):
                            a = A[i, j]
                            for col in range(d_v):
                                num[i, col] += a * vc[j, col]
        for i in range(rows):
            r = row_scale(den[i] + eps, one, zero, nan)
            for col in range(d_v):
                out[b, i0 + i, col] = num[i, col] * r
    return out


def _segment_bounds(n_q, n_k, causal):
    """Key boundaries of the segments, and the index of query chunk 0's segment.

    Non-causal: segments of ``LINEAR_SEGMENT`` keys.  Causal: the keys
    ``[0, off)`` every query sees, in segments of ``LINEAR_SEGMENT``, then one
    (possibly empty) segment per query chunk holding the keys on its diagonal.
    """
    if not causal:
        bounds = np.append(np.arange(0, n_k, LINEAR_SEGMENT), n_k)
        return bounds.astype(np.int64), 0
    off = n_k - n_q
    starts = np.clip(np.arange(0, n_q, LINEAR_CHUNK) + off, 0, n_k)
    prefix = np.arange(0, starts[0], LINEAR_SEGMENT)
    bounds = np.concatenate([prefix, starts, [n_k]]).astype(np.int64)
    return bounds, len(prefix)


def linear_forward(q, k, v, feature_map, causal, eps, S0=None, z0=None):
    """Linear attention ``φ(q) S / (φ(q)·z + eps)``, non-causal or chunked causal.

    Parameters
    ----------
    q : ndarray of shape (B, n_q, d_k)
        float32 or float64, C-contiguous (validated by :mod:`fastattn._checks`).
    k : ndarray of shape (B, n_k, d_k)
    v : ndarray of shape (B, n_k, d_v)
    feature_map : {"elu", "relu", "identity"}
        ``elu(x) + 1``, ``max(x, 0)``, or ``x`` (``q`` and ``k`` are
        features already, of any dimension ``D`` in place of ``d_k``).
    causal : bool
        Bottom-right aligned mask (``j <= i + n_k - n_q``).
    eps : float
        Added to the denominator; a row whose denominator is exactly 0 is 0, one
        whose denominator overflowed NaN.
    S0 : ndarray of shape (B, d_k, d_v), optional
        State of earlier keys, seen by every query (default zeros).
    z0 : ndarray of shape (B, d_k), optional

    Returns
    -------
    out : ndarray of shape (B, n_q, d_v)
    S : ndarray of shape (B, d_k, d_v)
        ``S0 + φ(k)ᵀ v``, the state to pass on to the next piece.
    z : ndarray of shape (B, d_k)
        ``z0 + Σ_j φ(k_j)``.

    Notes
    -----
    Time ``O(B n (d_k + c) d_v)`` with chunk ``c = LINEAR_CHUNK`` (the
    ``c`` term only when causal); extra memory ``O(B (n / c) d_k d_v)``
    causal, ``O(B (n / LINEAR_SEGMENT) d_k d_v)`` non-causal.
    Katharopoulos et al. (2020).
    """
    dtype = q.dtype
    B, n_q, d_k = q.shape
    n_k, d_v = k.shape[1], v.shape[2]
    causal = bool(causal)
    S0 = np.zeros((B, d_k, d_v), dtype) if S0 is None else S0
    z0 = np.zeros((B, d_k), dtype) if z0 is None else z0
    code = FEATURE_MAP_CODES[feature_map]
    consts = np.array([1.0, 0.0, eps, np.nan], dtype=dtype)
    bounds, first = _segment_bounds(n_q, n_k, causal)
    # Causal: the quadratic part grows with the chunk; non-causal: larger
    # steps make larger (more efficient) gemms.
    chunk = LINEAR_CHUNK if causal else LINEAR_STEP
    nseg = len(bounds) - 1
    dS = np.zeros((B, nseg + 1, d_k, d_v), dtype)
    dz = np.zeros((B, nseg + 1, d_k), dtype)
    work_items = B * max(nseg, -(-n_q // chunk))
    with launch(work_items, B * (n_q + n_k) * d_k * d_v) as pick:
        pick(segment_states)(k, v, bounds, code, consts, chunk, dS, dz)
        prefix_states(S0, z0, dS, dz)
        out = pick(chunk_outputs)(q, k, v, bounds, first, causal, code, consts, chunk, dS, dz)
    return out, dS[:, nseg].copy(), dz[:, nseg].copy()
