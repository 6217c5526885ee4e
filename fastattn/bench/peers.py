"""Peers on the same inputs, checked like any backend: PyTorch on CPU when importable, and
the plain NumPy recurrent step of linear attention (decode).

A peer ``NAME`` provides ``NAME_<attention>_call(q, k, v, causal, option, heads=1)`` for
prefill and ``NAME_<attention>_decode_call`` for decode (``option``: the scale, or the
feature map), found by :func:`~.engine.make_call`; :func:`supports` says which it has."""


import importlib.util
import sys

import numpy as np

#: Peer names known to the sweep.
PEERS = ("torch", "numpy")

#: How to add a missing peer, shown by ``fastattn bench`` and the report.
INSTALL_HINT = {
    "torch": 'pip install "fastattn[torch]"  (or: pip install torch)',
    "numpy": "pip install numpy",
}
#: Feature maps the peers' linear attention implements.
PEER_FEATURE_MAPS = (None, "elu", "relu")


def supports(name, attention, regime="prefill", feature_map=None):
    """True if peer ``name`` has a builder for this call (and implements ``feature_map``)."""
    suffix = "_decode" if regime == "decode" else ""
    return (f"{name}_{attention}{suffix}_call" in globals()
            and feature_map in PEER_FEATURE_MAPS)


#: Thread count the peers get when first imported (set by :func:`set_peer_threads`).
_threads = None


def _torch():
    first = "torch" not in sys.modules
    import torch

    if first and _threads is not None:
        torch.set_num_threads(_threads)
    return torch


def available_peers():
    """Peers importable here (without importing them), a tuple of names."""
    return tuple(name for name in PEERS if _findable(name))


def _findable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # blocked, or a half-imported module
        return False


def absent_peers():
    """Peers that are not installed, mapped to how to install them."""
    have = available_peers()
    return {name: INSTALL_HINT[name] for name in PEERS if name not in have}


def set_peer_threads(n_threads):
    """Fix every peer's thread count: now if imported, else when :func:`_torch` imports it."""
    global _threads
    _threads = int(n_threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(_threads)


def peer_threads():
    """Thread counts of the peers, by name: as in force if imported, else as they will be set."""
    counts = {}
    if "torch" in available_peers():
        torch = sys.modules.get("torch")
        counts["torch"] = torch.get_num_threads() if torch is not None else _threads
    return counts


def _as_4d(torch, arrays, heads):
    """``(B, n, d)`` arrays as ``(B / heads, heads, n, d)`` tensors without a copy (SDPA's
    flash kernel takes only 4-D inputs; 3-D falls back to the O(n²) math path)."""
    return tuple(torch.from_numpy(x).view(-1, heads, *x.shape[-2:]) for x in arrays)


def torch_softmax_call(q, k, v, causal, scale, heads=1):
    """A no-argument call of PyTorch's SDPA on C-contiguous ``(B, n, d)`` q, k, v, returning
    ``(B, n_q, d_v)``.  Raises ValueError when ``causal`` and ``n_q != n_k`` (torch's
    mask is top-left aligned, fastattn's bottom-right)."""
    torch = _torch()
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError("torch's is_causal mask equals fastattn's only when n_q == n_k")
    tq, tk, tv = _as_4d(torch, (q, k, v), heads)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out_shape = q.shape[:-1] + v.shape[-1:]

    def call():
        with torch.inference_mode():
            out = sdpa(tq, tk, tv, is_causal=bool(causal), scale=float(scale))
            return out.numpy().reshape(out_shape)

    return call


def torch_linear_call(q, k, v, causal, feature_map="elu", eps=1e-6, heads=1):
    """A no-argument call of linear attention in plain PyTorch (``feature_map`` "elu" or
    "relu"): the product form, or causal (``n_q == n_k``) the cumulative-sum form, whose
    states take ``O(n d_k d_v)`` memory."""
    torch = _torch()
    F = torch.nn.functional
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError("the cumulative-sum form needs n_q == n_k")
    if feature_map == "elu":
        def phi(x):
            return F.elu(x) + 1
    elif feature_map == "relu":
        phi = F.relu
    else:
        raise ValueError(f"feature_map must be 'elu' or 'relu', got {feature_map!r}")
    tq, tk, tv = _as_4d(torch, (q, k, v), heads)
    out_shape = q.shape[:-1] + v.shape[-1:]

    def product_form():
        with torch.inference_mode():
            pq, pk = phi(tq), phi(tk)
            state = pk.transpose(-2, -1) @ tv                  # (..., d_k, d_v)
            norm = pk.sum(dim=-2)                              # (..., d_k)
            numerator = pq @ state
            denominator = (pq @ norm.unsqueeze(-1)) + eps      # (..., n, 1)
            return (numerator / denominator).numpy().reshape(out_shape)

    def cumsum_form():
        with torch.inference_mode():
            pq, pk = phi(tq), phi(tk)
            states = torch.cumsum(pk.unsqueeze(-1) * tv.unsqueeze(-2), dim=-3)  # (..., n, d_k, d_v)
            norms = torch.cumsum(pk, dim=-2)                                     # (..., n, d_k)
            numerator = torch.einsum("...nk,...nkv->...nv", pq, states)
            denominator = (pq * norms).sum(dim=-1, keepdim=True) + eps
            return (numerator / denominator).numpy().reshape(out_shape)

    return cumsum_form if causal else product_form


def torch_softmax_decode_call(q, k, v, causal, scale, heads=1):
    """SDPA for one query ``(B, 1, d_k)`` against ``n`` keys: fastattn's bottom-right causal
    mask lets the newest token see every key, which is SDPA without a mask."""
    return torch_softmax_call(q, k, v, False, scale, heads)


def _numpy_phi(feature_map):
    if feature_map not in ("elu", "relu"):
        raise ValueError(f"feature_map must be 'elu' or 'relu', got {feature_map!r}")
    return (lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))) \
        if feature_map == "elu" else (lambda x: np.maximum(x, 0))


def numpy_linear_decode_call(q, k, v, causal, feature_map="elu", eps=1e-6, heads=1):
    """The plain NumPy recurrent step of linear attention, returning ``(B, 1, d_v)``.

    The state ``S = φ(k)ᵀ v``, ``z = Σ φ(k)`` of the first ``n - 1`` keys is built once;
    each call adds the newest key, ``S += φ(k)ᵀ v; z += φ(k)``, and returns
    ``φ(q) S / (φ(q) · z + eps)`` (in place: each call advances the state one token).
    """
    phi = _numpy_phi(feature_map)
    k0, v0, k1, v1 = k[..., :-1, :], v[..., :-1, :], k[..., -1:, :], v[..., -1:, :]
    pk0 = phi(k0)
    S, z = np.swapaxes(pk0, -1, -2) @ v0, pk0.sum(axis=-2)

    def step():
        pk, pq = phi(k1), phi(q)
        S[...] += np.swapaxes(pk, -1, -2) @ v1
        z[...] += pk[..., 0, :]
        return (pq @ S) / ((pq * z[..., None, :]).sum(axis=-1, keepdims=True) + eps)

    return step


def peer_extra_bytes(name, attention, causal, batch, n, d_k, d_v, itemsize):
    """Bytes a peer call needs beyond its inputs and output (to skip what cannot fit)."""
    if name == "torch" and attention == "linear" and causal:
        return 2 * batch * n * d_k * d_v * itemsize
    return 4 * batch * n * max(d_k, d_v) * itemsize
