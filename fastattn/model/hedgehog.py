"""Hedgehog: a feature map learned so that linear attention mimics a model's own softmax.

Zhang, Bhatia, Kumbong, Ré, "The Hedgehog & the Porcupine: Expressive Linear
Attentions with Softmax Mimicry", ICLR 2024.  Per head, with ``u = W x + b``,

    φ(x) = [softmax(u), softmax(−u)]          (each softmax over the d_k features)

so ``D = 2·d_k``, and the linear attention weights
``â_ij = φ_q(q_i)·φ_k(k_j) / Σ_j φ_q(q_i)·φ_k(k_j)`` are fitted to the model's
softmax weights ``a_ij = softmax_j(q_i·k_j / √d_k)`` by the mean over rows of
``KL(a_i ‖ â_i)``, with ``W`` started at the identity and ``b`` at 0.  Here the
fit is L-BFGS-B (``scipy.optimize.minimize``) with the analytic gradient, in
float64, all heads of a layer at once (their losses add; each head's
parameters touch only its own term).
"""

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..feature_maps import FeatureMap, Features, ReadOnlyAttributes


def _real_array(value, name):
    """``value`` as a float64 array; TypeError naming ``name`` unless it holds real numbers."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:   # ragged nested lists
        raise TypeError(f"{name} must be an array of real numbers: {exc}") from None
    if array.dtype.kind not in "fiu":
        hint = " (ints beyond int64, or None?)" if array.dtype.kind == "O" else ""
        raise TypeError(f"{name} must be an array of real numbers, got dtype {array.dtype}{hint}")
    return np.array(array, dtype=np.float64)


def _softmax(u):
    e = np.exp(u - u.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class HedgehogFeatures(ReadOnlyAttributes, FeatureMap):
    """Hedgehog features ``φ(x) = [softmax(W x + b), softmax(−(W x + b))]``, one map per head.

    Parameters
    ----------
    weight : ndarray of shape (..., d_k, d_k)
        ``W`` of each map; the leading dims ``...`` (for example heads, or
        layers × {query, key} × heads) broadcast against those of ``x``.
    bias : ndarray of shape (..., d_k), optional
        ``b``; default 0.  Both are kept read-only, as attributes of the same
        names that cannot be set again (the casts of each dtype are cached from
        them): another map is another ``HedgehogFeatures``.

    Notes
    -----
    ``D = 2·d_k`` features, each in (0, 1); each half sums to 1, so
    ``φ(q)·φ(k)`` is in (0, 2] and linear attention needs no ``eps`` to stay
    finite.  Cost: ``O(n · d_k²)`` per head for the features.  As a
    ``feature_map=`` of :func:`fastattn.linear_attention`, ``weight``'s
    leading dims must broadcast against the batch dims of ``q`` and ``k`` (for
    per-head maps of shape ``(H, d_k, d_k)``, inputs ``(..., H, n, d_k)``); the
    same map is applied to queries and keys -- for separate maps give
    :class:`fastattn.model.MiniLM` the pair ``(query map, key map)``.  It is a
    :class:`fastattn.feature_maps.FeatureMap`: every backend runs it through
    the generic path (features formed once, then the ``D = 2·d_k`` kernels),
    causal or not, with a state carried between pieces.

    Fitted by :func:`fit_hedgehog`: per head, ``W`` from the identity and ``b``
    from 0, minimising the mean over query rows of ``KL(a_i ‖ â_i)`` between
    the model's softmax weights ``a_i`` and the linear attention weights
    ``â_i`` of these features, by L-BFGS-B with the analytic gradient; cost per
    iteration ``O(T · r · n · H · 4 d_k)`` for ``T`` texts of ``n`` tokens and
    ``r`` query rows each.  Zhang, Bhatia, Kumbong, Ré, "The Hedgehog & the
    Porcupine", ICLR 2024.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> from fastattn.model import HedgehogFeatures
    >>> hh = HedgehogFeatures.identity(32, heads=4)
    >>> q = k = v = np.random.default_rng(0).standard_normal((4, 10, 32))
    >>> fastattn.linear_attention(q, k, v, feature_map=hh).shape
    (4, 10, 32)
    """

    name = "hedgehog"
    check_features = False   # in (0, 1) by construction, from finite weights
    read_only = ("weight", "bias", "_cast")

    def __init__(self, weight, bias=None):
        weight = _real_array(weight, "weight")
        if weight.ndim < 2 or weight.shape[-1] != weight.shape[-2] or weight.shape[-1] < 1:
            raise ValueError(f"weight must have shape (..., d_k, d_k), got {weight.shape}")
        bias = np.zeros(weight.shape[:-1]) if bias is None else _real_array(bias, "bias")
        if bias.shape != weight.shape[:-1]:
            raise ValueError(f"bias must have shape {weight.shape[:-1]} for weight of shape "
                             f"{weight.shape}, got {bias.shape}")
        if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
            raise ValueError("weight and bias must be finite")
        self.weight, self.bias = weight, bias
        self._cast = {}
        # Read-only, the arrays too: the casts of each dtype are kept (_params), so a change
        # in place would be ignored; a new map is HedgehogFeatures(new_weight, new_bias).
        self._freeze()

    @classmethod
    def identity(cls, d_k, heads=()):
        """The starting map: ``W = I``, ``b = 0``, for ``heads`` (an int or shape) of maps."""
        from .. import _checks, reference

        d_k = _checks.check_dim(d_k, "d_k", 1)
        shape = tuple(heads) if isinstance(heads, (tuple, list)) else (heads,)
        shape = tuple(_checks.check_dim(h, "every entry of heads", 0) for h in shape)
        reference.check_fits_in_memory(
            math.prod(shape) * d_k * (d_k + 1) * 8,
            f"HedgehogFeatures.identity({d_k}, heads={shape}), for its weights,",
            advice="give a smaller d_k or fewer heads")
        return cls(np.broadcast_to(np.eye(d_k), shape + (d_k, d_k)))

    @property
    def d_k(self):
        return self.weight.shape[-1]

    def num_features(self, d_k):
        """``D = 2·d_k``; ``d_k`` must be the map's."""
        if d_k != self.d_k:
            raise ValueError(f"this HedgehogFeatures maps d_k={self.d_k}, not {d_k}")
        return 2 * self.d_k

    def feature_dim(self, d_k, num_features=None):
        return self.num_features(d_k)

    def bind(self, d_k, d_k_of="q and k have"):
        if d_k != self.d_k:
            raise ValueError(f"feature_map: this HedgehogFeatures maps d_k={self.d_k}, but "
                             f"{d_k_of} d_k={d_k}")
        return self

    def numpy_features(self, x):
        return self(x)

    def features(self, module, q, k, batch_shape, z0=None):
        """The features of ``q``, ``k (B, n, d_k)``, whose batch dims are ``batch_shape``: the
        maps' leading dims broadcast against those (per-head maps: heads last)."""
        lead = self.weight.shape[:-2]
        try:
            fits = np.broadcast_shapes(lead, tuple(batch_shape)) == tuple(batch_shape)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"feature_map: a HedgehogFeatures of {lead or 'one'} map(s) "
                             f"(weight shape {self.weight.shape}) needs q and k whose batch "
                             f"dims end in {lead}, got batch dims {tuple(batch_shape)}")
        return Features(*(self._batched(x, tuple(batch_shape)) for x in (q, k)))

    def _batched(self, x, batch_shape):
        """Features of ``x (B, n, d_k)`` seen as ``batch_shape + (n, d_k)``, in ``x``'s dtype;
        a float32 ``W x + b`` that overflows is formed in float64 (the features, in (0, 1),
        always fit)."""
        shown = x.reshape(batch_shape + x.shape[1:])
        with np.errstate(over="ignore", invalid="ignore"):   # repaired below
            phi = self(shown)
        if not np.isfinite(phi).all():
            phi = self(shown.astype(np.float64))
        return np.ascontiguousarray(phi.reshape(x.shape[:2] + (2 * self.d_k,)), dtype=x.dtype)

    def _wide_features(self, module, feats, q, k, z0):
        # Features in (0, 1): float32's are float64's to float32's precision.
        return feats.widened()

    def __getitem__(self, index):
        """The maps ``weight[index]`` (index into the leading dims only)."""
        w = self.weight[index]
        if w.ndim < 2 or w.shape[-2:] != self.weight.shape[-2:]:
            raise IndexError(f"index {index!r} must select leading dims of {self.weight.shape}")
        return HedgehogFeatures(w, self.bias[index])

    def _params(self, dtype):
        if dtype not in self._cast:
            self._cast[dtype] = (np.ascontiguousarray(np.swapaxes(self.weight, -1, -2), dtype),
                                 self.bias[..., None, :].astype(dtype))
        return self._cast[dtype]

    def __call__(self, x):
        """Features of ``x (..., n, d_k)``: ndarray ``(..., n, 2·d_k)``, non-negative.

        float32 input gives float32 features, anything else float64.
        """
        x = np.asarray(x)
        if x.dtype != np.float32:
            x = x.astype(np.float64)
        if x.ndim < 2 or x.shape[-1] != self.d_k:
            raise ValueError(f"x must have shape (..., n, {self.d_k}), got {x.shape}")
        wt, b = self._params(x.dtype)
        u = x @ wt + b
        return np.concatenate([_softmax(u), _softmax(-u)], axis=-1)

    def save(self, path):
        """Write ``weight`` and ``bias`` to ``path`` (``.npz``)."""
        np.savez(path, weight=self.weight, bias=self.bias)

    @classmethod
    def load(cls, path, shape=None):
        """Read a map saved by :meth:`save`.

        ``shape``, if given, is the ``weight`` shape expected, e.g.
        ``(6, 2, 12, 32, 32)`` for :func:`fit_hedgehog`'s maps.

        Raises
        ------
        ValueError
            Naming the file and the shape, when the arrays are missing or of the
            wrong shape.
        """
        path = Path(path)
        try:
            archive = np.load(path, allow_pickle=False)
        except ValueError:   # NumPy's words for a file that is no .npy or .npz: "pickled"
            raise ValueError(f"{path}: not a .npz archive (HedgehogFeatures.save writes "
                             "one)") from None
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise ValueError(f"{path}: a .npy array, not the .npz archive HedgehogFeatures.save "
                             "writes")
        with archive as f:
            missing = {"weight", "bias"} - set(f.files)
            if missing:
                raise ValueError(f"{path}: not a HedgehogFeatures file (missing "
                                 f"{sorted(missing)}; holds {sorted(f.files)})")
            weight, bias = f["weight"], f["bias"]
        if shape is not None and weight.shape != tuple(shape):
            raise ValueError(f"{path}: weight has shape {weight.shape}, expected {tuple(shape)}")
        try:
            return cls(weight, bias)
        except ValueError as exc:
            raise ValueError(f"{path}: weight of shape {weight.shape}, bias of shape "
                             f"{bias.shape}: {exc}") from None

    def __repr__(self):
        return f"HedgehogFeatures(weight shape {self.weight.shape}, D={2 * self.d_k})"


def hedgehog_attention(maps):
    """``attention=`` for :meth:`fastattn.model.MiniLM.encode` from fitted maps.

    ``maps`` of weight shape ``(layers, 2, H, d_k, d_k)`` (query and key maps
    per layer, as :func:`fit_hedgehog` returns) gives one ``(query map, key
    map)`` pair per layer.
    """
    if maps.weight.ndim != 5 or maps.weight.shape[1] != 2:
        raise ValueError(f"maps must have weight shape (layers, 2, heads, d_k, d_k), got "
                         f"{maps.weight.shape}")
    return [(maps[layer, 0], maps[layer, 1]) for layer in range(maps.weight.shape[0])]


# -- the fit --------------------------------------------------------------------------------


@dataclass
class _Bucket:
    """Texts of similar length, padded: queries (B,H,r,d), keys (B,H,n,d), targets (B,H,r,n)."""

    q: np.ndarray
    k: np.ndarray
    key_mask: np.ndarray     # (B,1,1,n)  1 for a real key
    row_mask: np.ndarray     # (B,1,r,1)  1 for a real query row
    target: np.ndarray       # (B,H,r,n)  softmax weights, 0 at padded keys
    neg_entropy: float       # Σ a log a over the real rows


def _buckets(qk, max_queries, rng, texts_per_bucket=8, dtype=np.float64):
    """Group ``[(q (H,n,d), k (H,n,d)), ...]`` by length into padded :class:`_Bucket`s."""
    order = sorted(range(len(qk)), key=lambda i: qk[i][0].shape[1])
    out = []
    for start in range(0, len(order), texts_per_bucket):
        idx = order[start:start + texts_per_bucket]
        heads, _, d = qk[idx[0]][0].shape
        n = max(qk[i][0].shape[1] for i in idx)
        r = min(max_queries, n)
        b = len(idx)
        q = np.zeros((b, heads, r, d))
        k = np.zeros((b, heads, n, d))
        key_mask = np.zeros((b, 1, 1, n))
        row_mask = np.zeros((b, 1, r, 1))
        target = np.zeros((b, heads, r, n))
        for t, i in enumerate(idx):
            qi, ki = (np.asarray(a, dtype=np.float64) for a in qk[i])
            ni = qi.shape[1]
            rows = np.sort(rng.choice(ni, size=min(r, ni), replace=False))
            ri = len(rows)
            q[t, :, :ri] = qi[:, rows]
            k[t, :, :ni] = ki
            key_mask[t, ..., :ni] = 1
            row_mask[t, :, :ri] = 1
            target[t, :, :ri, :ni] = _softmax(qi[:, rows] @ np.swapaxes(ki, -1, -2) / np.sqrt(d))
        with np.errstate(divide="ignore", invalid="ignore"):
            neg_entropy = float(np.sum(np.where(target > 0, target * np.log(target), 0.0)))
        q, k, key_mask, row_mask, target = (a.astype(dtype)
                                            for a in (q, k, key_mask, row_mask, target))
        out.append(_Bucket(q, k, key_mask, row_mask, target, neg_entropy))
    return out


def _features_and_back(x, w, b):
    """``φ(x)`` for ``x (..., m, d)``, ``w (H, d, d)``, ``b (H, d)``, and what backprop needs."""
    u = x @ np.swapaxes(w, -1, -2) + b[:, None, :]
    p, m = _softmax(u), _softmax(-u)
    return np.concatenate([p, m], axis=-1), p, m


def _back(g, p, m, x):
    """``dL/dW (H,d,d)``, ``dL/db (H,d)`` from ``g = dL/dφ (B,H,m,2d)``."""
    d = p.shape[-1]
    gp, gm = g[..., :d], g[..., d:]
    du = p * (gp - np.einsum("...i,...i->...", gp, p)[..., None]) \
        - m * (gm - np.einsum("...i,...i->...", gm, m)[..., None])
    # One batched (H, d, rows) @ (H, rows, d) product per text: 7x faster here than one
    # product over the texts, whose operands must be transposed into copies first.
    dw = np.swapaxes(du[0], -1, -2) @ x[0]
    for t in range(1, len(du)):
        dw += np.swapaxes(du[t], -1, -2) @ x[t]
    return dw, du.sum(axis=0).sum(axis=1)


def _unpack(theta, heads, d, tied):
    per = heads * d * d + heads * d
    parts = [theta[:per]] if tied else [theta[:per], theta[per:]]
    out = [(p[:heads * d * d].reshape(heads, d, d), p[heads * d * d:].reshape(heads, d))
           for p in parts]
    return out * 2 if tied else out


def layer_loss(theta, buckets, heads, d, tied=False):
    """The mean over heads and query rows of ``KL(a_i ‖ â_i)``, and its gradient (float64).

    Computed in the buckets' dtype; the smallest normal number of that dtype is
    added to each ``φ(q_i)·φ(k_j)`` inside the log, so that a product that
    underflows to 0 where the softmax weight is not 0 costs a large finite
    loss, not inf.

    ``theta`` holds ``[W_q, b_q, W_k, b_k]`` flattened (``[W, b]`` when
    ``tied``), each ``W (heads, d, d)``, ``b (heads, d)``.
    """
    dtype = buckets[0].q.dtype
    tiny = np.finfo(dtype).tiny
    (wq, bq), (wk, bk) = ((w.astype(dtype), b.astype(dtype))
                          for w, b in _unpack(theta, heads, d, tied))
    rows = sum(float(bk_.row_mask.sum()) for bk_ in buckets)
    loss = 0.0
    gwq, gbq, gwk, gbk = (np.zeros(a.shape) for a in (wq, bq, wk, bk))
    for bu in buckets:
        key_rows = np.swapaxes(bu.key_mask, -1, -2)           # (B,1,n,1)
        fq, pq, mq = _features_and_back(bu.q, wq, bq)
        fk, pk, mk = _features_and_back(bu.k, wk, bk)
        fk *= key_rows
        s = fq @ np.swapaxes(fk, -1, -2)                     # (B,H,r,n)
        s += tiny                                            # an underflow costs, finitely
        total = s.sum(axis=-1, keepdims=True) - tiny * (1 - bu.key_mask).sum(-1, keepdims=True)
        s += 1 - bu.key_mask                                 # 1 at padded keys: log 0
        # The targets are 0 at padded keys and rows: Σ a log s needs no mask.
        loss += bu.neg_entropy - float(np.vdot(bu.target, np.log(s))) \
            + float(np.sum(bu.row_mask * np.log(total), dtype=np.float64))
        g = (bu.row_mask / total) * bu.key_mask
        g -= bu.target / s
        a, c = _back(g @ fk, pq, mq, bu.q)
        gwq += a
        gbq += c
        a, c = _back(np.swapaxes(g, -1, -2) @ fq * key_rows, pk, mk, bu.k)
        gwk += a
        gbk += c
    grads = [gwq + gwk, gbq + gbk] if tied else [gwq, gbq, gwk, gbk]
    norm = rows * heads
    return loss / norm, np.concatenate([x.ravel() for x in grads]) / norm


@dataclass
class LayerFit:
    """The fit of one layer's maps: the loss (mean row KL over heads and rows) before and after."""

    layer: int
    initial_loss: float
    loss: float
    iterations: int
    converged: bool
    message: str
    seconds: float
    cpu_seconds: float


@dataclass
class HedgehogFit:
    """What :func:`fit_hedgehog` did: one :class:`LayerFit` per layer and the total time.

    ``seconds`` is wall time, ``cpu_seconds`` the process's CPU time (all its
    threads), both including the forward passes that capture the activations.
    """

    layers: list = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    separate: bool = True
    sequential: bool = False
    num_texts: int = 0

    @property
    def converged(self):
        return all(f.converged for f in self.layers)


def fit_layer(qk, *, separate=True, max_queries=32, maxiter=100, seed=0, layer=0,
              dtype=np.float32):
    """Fit one layer's Hedgehog maps to its softmax weights.

    Parameters
    ----------
    qk : list of (q, k), each of shape (heads, n, d_k)
        The layer's queries and keys on each calibration text.
    separate : bool, default True
        Separate maps for queries and keys (else one map for both).
    max_queries : int, default 32
        Query rows drawn per text (all keys are kept: each row's
        normalisation needs them).
    maxiter : int, default 100
        L-BFGS-B iterations.
    dtype : {numpy.float32, numpy.float64}, default float32
        The precision of the loss and gradient (the optimiser's state is float64).

    Returns
    -------
    weight : ndarray of shape (2, heads, d_k, d_k)
    bias : ndarray of shape (2, heads, d_k)
    fit : LayerFit
        A fit that stops before convergence warns and keeps the best weights
        it saw (never NaN).
    """
    from scipy.optimize import minimize

    t0, c0 = time.perf_counter(), time.process_time()
    heads, _, d = qk[0][0].shape
    buckets = _buckets(qk, max_queries, np.random.default_rng(seed), dtype=dtype)
    one = np.concatenate([np.broadcast_to(np.eye(d), (heads, d, d)).ravel(),
                          np.zeros(heads * d)])
    theta0 = one if not separate else np.concatenate([one, one])
    best = {"loss": np.inf, "theta": theta0}

    def fun(theta):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            loss, grad = layer_loss(theta, buckets, heads, d, tied=not separate)
        if not (np.isfinite(loss) and np.isfinite(grad).all()):
            return np.inf, np.zeros_like(theta)
        if loss < best["loss"]:
            best["loss"], best["theta"] = loss, theta.copy()
        return loss, grad

    initial = fun(theta0)[0]
    res = minimize(fun, theta0, jac=True, method="L-BFGS-B",
                   options={"maxiter": maxiter, "maxcor": 20})
    converged = bool(res.success) and np.isfinite(best["loss"])
    if not converged:
        warnings.warn(f"Hedgehog fit of layer {layer} did not converge in {maxiter} iterations "
                      f"({res.message}); kept the best weights seen (loss {best['loss']:.4g}, "
                      f"from {initial:.4g})", RuntimeWarning, stacklevel=2)
    (wq, bq), (wk, bk) = _unpack(best["theta"], heads, d, tied=not separate)
    fit = LayerFit(layer, float(initial), float(best["loss"]), int(res.nit), converged,
                   str(res.message), time.perf_counter() - t0, time.process_time() - c0)
    return np.stack([wq, wk]), np.stack([bq, bk]), fit


def fit_hedgehog(model, texts, *, separate=True, sequential=False, max_queries=32,
                 maxiter=100, seed=0, max_tokens=None, dtype=np.float32, progress=None):
    """Fit Hedgehog maps for every layer and head of ``model`` on calibration ``texts``.

    Parameters
    ----------
    model : fastattn.model.MiniLM
    texts : list of str
        Calibration texts (never the held-out ones).
    separate : bool, default True
        Separate maps for queries and keys.
    sequential : bool, default False
        Fit layer ``l`` on the activations of the model whose layers below
        ``l`` already run the fitted maps (else all layers on the original
        model's activations, captured in one forward pass).
    max_queries, maxiter, seed, dtype
        As :func:`fit_layer`.
    max_tokens : int, optional
        Fit on each text's first ``max_tokens`` tokens ([SEP] kept last): the
        fit's cost grows with the square of the length.
    progress : callable, optional
        Called with each layer's :class:`LayerFit` as it is done.

    Returns
    -------
    maps : HedgehogFeatures
        Weight shape ``(layers, 2, heads, d_k, d_k)``: per layer, the query map
        then the key map (equal when not ``separate``); pass
        :func:`hedgehog_attention(maps) <hedgehog_attention>` to
        :meth:`~fastattn.model.MiniLM.encode`.
    fit : HedgehogFit

    Notes
    -----
    Cost per L-BFGS iteration and layer: ``O(T · r · n · H · 4 d_k)`` for ``T``
    texts of ``n`` tokens and ``r = max_queries`` rows, plus the forward
    passes that capture the activations (one, or one per layer when
    ``sequential``).
    """
    from .minilm import NUM_LAYERS

    t0, c0 = time.perf_counter(), time.process_time()
    ids = model.tokenize(texts)
    if max_tokens is not None:
        if max_tokens < 3:
            raise ValueError(f"max_tokens must be >= 3, got {max_tokens}")
        ids = [t if len(t) <= max_tokens else np.append(t[:max_tokens - 1], t[-1]) for t in ids]
    report = HedgehogFit(separate=separate, sequential=sequential, num_texts=len(ids))
    weights, biases = [], []
    captured = None
    if not sequential:
        captured = [[None] * len(ids) for _ in range(NUM_LAYERS)]

        def keep(layer, index, q, k):
            for b, i in enumerate(index):
                captured[layer][i] = (q[b].copy(), k[b].copy())

        model.encode_ids(ids, "softmax", hook=keep)
    for layer in range(NUM_LAYERS):
        if sequential:
            below = [(HedgehogFeatures(weights[j][0], biases[j][0]),
                      HedgehogFeatures(weights[j][1], biases[j][1])) for j in range(layer)]
            qk = model.attention_inputs(ids, layer, below + ["softmax"] * (NUM_LAYERS - layer))
        else:
            qk = captured[layer]
        w, b, fit = fit_layer(qk, separate=separate, max_queries=max_queries, maxiter=maxiter,
                              seed=seed + layer, layer=layer, dtype=dtype)
        weights.append(w)
        biases.append(b)
        report.layers.append(fit)
        if progress:
            progress(fit)
    report.seconds = time.perf_counter() - t0
    report.cpu_seconds = time.process_time() - c0
    return HedgehogFeatures(np.stack(weights), np.stack(biases)), report


# -- the fit, cached by its inputs ----------------------------------------------------------


def default_cache_dir():
    """``$XDG_CACHE_HOME/fastattn`` (``~/.cache/fastattn`` when it is not set)."""
    import os

    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "fastattn"


def _inputs_digest(model):
    """What the fit depends on beyond its texts and options: the model's weights, its
    truncation and dtype, and the code of the fit and of the forward pass."""
    import hashlib

    from . import minilm

    h = hashlib.sha256()
    with open(model.path / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    for source in (minilm.__file__, __file__):
        h.update(Path(source).read_bytes())
    h.update(f"{model.max_length} {model.dtype}".encode())
    return h.hexdigest()


def _fit_for_cache(model, digest, texts, options, progress):
    return fit_hedgehog(model, texts, progress=progress, **options)


def cached_fit_hedgehog(model, texts, *, cache_dir=None, progress=None, **options):
    """:func:`fit_hedgehog`, kept on disk by its inputs so a second call does not refit.

    The key is the texts, the options, the model's weights file, its
    ``max_length`` and dtype, and the source of the fit and the forward pass;
    the store is :class:`joblib.Memory` in ``cache_dir`` (default
    :func:`default_cache_dir`).

    Returns
    -------
    maps : HedgehogFeatures
    fit : HedgehogFit
        Of the run that fitted them (its times are that run's).
    cached : bool
        Whether they were read from the cache.
    """
    from ._extra import require

    joblib = require("joblib", purpose="the cache of the Hedgehog fit")
    memory = joblib.Memory(str(cache_dir or default_cache_dir()), verbose=0)
    fit = memory.cache(_fit_for_cache, ignore=["model", "progress"])
    args = (model, _inputs_digest(model), list(texts), dict(sorted(options.items())), progress)
    cached = fit.check_call_in_cache(*args)
    maps, report = fit(*args)
    return maps, report, cached
