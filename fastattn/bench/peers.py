"""Peers: what a user would otherwise call, measured on the same inputs.

Each is optional (``pip install -e ".[peers]"`` adds them all, never a
dependency of the kernels) and is found without being imported:

* **torch** (PyTorch on CPU): softmax attention by
  ``torch.nn.functional.scaled_dot_product_attention`` (causal and not), and
  linear attention in its two usual PyTorch forms (Katharopoulos et al.
  2020): the non-causal product ``φ(q) (φ(k)ᵀ v) / (φ(q) Σ_j φ(k_j) + eps)``
  and the causal cumulative-sum form, which materialises the running state
  ``cumsum_j φ(k_j)ᵀ v_j`` of shape ``(B, n, d_k, d_v)``;
* **onnxruntime**: softmax attention by the ``com.microsoft``
  MultiHeadAttention contrib operator, as a one-node ONNX graph
  (``unidirectional=1`` when causal), float32 only;
* **jax**: softmax attention by ``jax.nn.dot_product_attention`` under
  ``jax.jit`` (XLA on CPU), float32 only (its softmax is always float32).

* **numpy**: the plain NumPy recurrent step of linear attention (decode
  only), ``S += φ(k)ᵀv; z += φ(k); out = φ(q)S / (φ(q)·z + eps)``.

A peer is checked against the float64 reference like any backend.  Its
builders, ``(q, k, v, causal, option, heads=1) -> callable`` with ``option``
the scale (softmax) or the feature map (linear), are registered in
:data:`CALLS` by attention and regime; :func:`why_not` says why a peer has
no call for a point, and :func:`fastattn.bench.engine.make_call` looks the
builder up.
"""

import importlib.util
import os
import sys

import numpy as np
from threadpoolctl import threadpool_limits

#: Peer names known to the sweep.
PEERS = ("torch", "onnxruntime", "jax", "numpy")

#: How to add a missing peer, shown by ``fastattn bench`` and the report: with the pip of
#: the README's ``.venv``, run from the fastattn checkout.  torch comes from PyTorch's CPU
#: index, at the version the ``peers`` extra pins (PyPI's Linux torch is a CUDA build of
#: several GB); once it is there, ``pip install -e ".[peers]"`` keeps it.
INSTALL_HINT = {
    "torch": ".venv/bin/pip install torch==2.13.0 --index-url "
             "https://download.pytorch.org/whl/cpu  (in the fastattn checkout)",
    "onnxruntime": ".venv/bin/pip install onnxruntime onnx  (in the fastattn checkout)",
    "jax": ".venv/bin/pip install jax  (in the fastattn checkout)",
    "numpy": "pip install numpy",
}

#: Modules a peer needs, by peer (all must be findable for it to be available).
_MODULES = {"torch": ("torch",), "onnxruntime": ("onnxruntime", "onnx"), "jax": ("jax",),
            "numpy": ("numpy",)}


#: Thread count the peers get when first imported (set by :func:`set_peer_threads`).
_threads = None


def _torch():
    first = "torch" not in sys.modules
    import torch

    if first and _threads is not None:
        torch.set_num_threads(_threads)
    return torch


def available_peers():
    """Peers importable here (without importing them).

    Returns
    -------
    tuple of str
    """
    return tuple(name for name in PEERS if all(_findable(m) for m in _MODULES[name]))


def _findable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # blocked, or a half-imported module
        return False


def absent_peers():
    """Peers that are not installed, mapped to how to install them.

    Returns
    -------
    dict of str to str
    """
    have = available_peers()
    return {name: INSTALL_HINT[name] for name in PEERS if name not in have}


def set_peer_threads(n_threads):
    """Fix the intra-op thread count of every peer, now if imported, else on import.

    Importing a peer takes seconds, so each is only imported when one of its
    points is measured:

    * torch: ``torch.set_num_threads`` (now, or in :func:`_torch`);
    * onnxruntime: ``SessionOptions.intra_op_num_threads`` of every session
      built afterwards (:func:`onnxruntime_softmax_call`);
    * jax: XLA's CPU thread pool is sized when JAX starts, so the count goes
      into ``XLA_FLAGS`` before the first import; one thread is
      ``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``,
      more threads leave XLA's pool at its default (one thread per CPU this
      process may run on).  Once JAX has started the count no longer changes
      and :func:`peer_threads` reports the one in force;
    * numpy: its BLAS (threadpoolctl), for the plain recurrent step.
    """
    global _threads
    _threads = int(n_threads)
    threadpool_limits(_threads, user_api="blas")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(_threads)
    if "jax" not in sys.modules:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in _XLA_ONE_THREAD]
        if _threads == 1:
            flags += list(_XLA_ONE_THREAD)
        os.environ["XLA_FLAGS"] = " ".join(flags)


#: XLA flags that keep JAX's CPU computations on one thread.
_XLA_ONE_THREAD = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")


def _cpus():
    """CPUs this process may run on (XLA's and onnxruntime's default pool size)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _jax_threads():
    """Threads of XLA's CPU pool as ``XLA_FLAGS`` set it (read by JAX once, on start)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return 1 if all(f in flags for f in _XLA_ONE_THREAD) else _cpus()


def peer_threads():
    """Thread counts of the available peers, by name: as in force if imported, else as they will be set.

    Returns
    -------
    dict of str to int
        torch: ``torch.get_num_threads()`` once imported; onnxruntime: the
        ``intra_op_num_threads`` its sessions get (all CPUs when unset);
        jax: the size of XLA's CPU pool from ``XLA_FLAGS``; numpy: the threads
        of its BLAS.
    """
    counts = {}
    have = available_peers()
    if "torch" in have:
        torch = sys.modules.get("torch")
        counts["torch"] = torch.get_num_threads() if torch is not None else _threads
    if "onnxruntime" in have:
        counts["onnxruntime"] = _threads if _threads is not None else _cpus()
    if "jax" in have:
        counts["jax"] = _jax_threads()
    if "numpy" in have:  # its BLAS, as the sweep set it
        from .._threads import blas_threads

        counts["numpy"] = blas_threads()
    return counts


def _as_4d(torch, arrays, heads):
    """Wrap ``(B, n, d)`` arrays without a copy as ``(B / heads, heads, n, d)`` tensors.

    PyTorch's CPU flash kernel of SDPA only takes 4-D (batch, heads, n, d)
    inputs; 3-D inputs fall back to the O(n²) math path.
    """
    return tuple(torch.from_numpy(x).view(-1, heads, *x.shape[-2:]) for x in arrays)


def torch_softmax_call(q, k, v, causal, scale, heads=1):
    """A no-argument callable computing softmax attention with PyTorch's SDPA.

    Parameters
    ----------
    q, k, v : ndarray of shape (B, n, d_k), (B, n, d_k), (B, n, d_v)
        float32 or float64, C-contiguous, ``B = batch * heads``; wrapped
        without a copy and passed as ``(batch, heads, n, d)`` (the layout
        PyTorch's flash kernel needs).
    causal : bool
        PyTorch's ``is_causal`` mask is aligned at the top left, which equals
        fastattn's bottom-right mask only when ``n_q == n_k``.
    scale : float
    heads : int, default 1

    Returns
    -------
    callable
        Returns the output as an ndarray ``(B, n_q, d_v)``.

    Raises
    ------
    ValueError
        If ``causal`` and ``n_q != n_k``, or ``heads`` does not divide ``B``.
    """
    _check_peer_inputs("torch", q, k, v, causal, heads)
    torch = _torch()
    tq, tk, tv = _as_4d(torch, (q, k, v), heads)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out_shape = q.shape[:-1] + v.shape[-1:]

    def call():
        with torch.inference_mode():
            out = sdpa(tq, tk, tv, is_causal=bool(causal), scale=float(scale))
            return out.numpy().reshape(out_shape)

    return call


def _check_peer_inputs(name, q, k, v, causal, heads):
    """Refuse what a peer's softmax kernel cannot compute as fastattn does."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v must be (B, n, d) arrays, got shapes {q.shape}, {k.shape}, {v.shape}")
    if heads < 1 or q.shape[0] % heads:
        raise ValueError(f"heads must divide B = {q.shape[0]}, got {heads}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"{name}'s causal mask equals fastattn's only when n_q == n_k")


def _heads_last(x, heads):
    """``(batch * heads, n, d)`` as ``(batch, n, heads * d)`` (a copy when heads > 1)."""
    B, n, d = x.shape
    return np.ascontiguousarray(x.reshape(B // heads, heads, n, d).transpose(0, 2, 1, 3)).reshape(
        B // heads, n, heads * d)


def _heads_first(x, heads):
    """Inverse of :func:`_heads_last`: ``(batch, n, heads * d)`` as ``(batch * heads, n, d)``."""
    batch, n, hd = x.shape
    d = hd // heads
    if heads == 1:
        return x.reshape(batch, n, d)
    return np.ascontiguousarray(x.reshape(batch, n, heads, d).transpose(0, 2, 1, 3)).reshape(
        batch * heads, n, d)


def onnxruntime_softmax_call(q, k, v, causal, scale, heads=1):
    """A no-argument callable computing softmax attention with onnxruntime.

    The graph is one ``com.microsoft`` MultiHeadAttention node (``num_heads``
    = ``heads``, ``scale``, ``unidirectional=1`` when causal), built with
    ``onnx.helper`` and run by a CPU ``InferenceSession`` whose
    ``intra_op_num_threads`` is the count of :func:`set_peer_threads`.

    Parameters
    ----------
    q, k, v : ndarray of shape (B, n_q, d_k), (B, n_k, d_k), (B, n_k, d_v)
        float32 (onnxruntime's CPU kernel has no float64), ``B = batch *
        heads``.  The operator takes ``(batch, n, heads * d)``: the inputs are
        rearranged once here, before any timing (a copy when ``heads > 1``).
    causal : bool
        ``unidirectional=1``; equals fastattn's bottom-right mask when
        ``n_q == n_k``.
    scale : float
    heads : int, default 1

    Returns
    -------
    callable
        Runs the session and returns the output as an ndarray
        ``(B, n_q, d_v)``; when ``heads > 1`` that includes rearranging the
        operator's ``(batch, n_q, heads * d_v)`` output, an ``O(B n d_v)``
        copy beside the ``O(B n_q n_k d)`` attention.

    Raises
    ------
    TypeError
        If the inputs are not float32.
    ValueError
        If ``causal`` and ``n_q != n_k``, or ``heads`` does not divide ``B``.
    """
    _check_peer_inputs("onnxruntime", q, k, v, causal, heads)
    if not all(x.dtype == np.float32 for x in (q, k, v)):
        raise TypeError(f"onnxruntime's MultiHeadAttention runs float32 only, got {q.dtype}")
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    feeds = {"query": _heads_last(q, heads), "key": _heads_last(k, heads),
             "value": _heads_last(v, heads)}
    node = helper.make_node("MultiHeadAttention", ["query", "key", "value"], ["output"],
                            domain="com.microsoft", num_heads=int(heads), scale=float(scale),
                            unidirectional=int(bool(causal)))
    graph = helper.make_graph(
        [node], "fastattn_peer",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(x.shape))
         for name, x in feeds.items()],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT,
                                       [q.shape[0] // heads, q.shape[1], heads * v.shape[2]])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(model)
    options = onnxruntime.SessionOptions()
    if _threads is not None:
        options.intra_op_num_threads = _threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])

    def call():
        return _heads_first(session.run(None, feeds)[0], heads)

    return call


def jax_softmax_call(q, k, v, causal, scale, heads=1):
    """A no-argument callable computing softmax attention with JAX on CPU.

    ``jax.nn.dot_product_attention`` (XLA's implementation) under
    ``jax.jit``, compiled here by one warm-up call; each call waits for the
    result (``block_until_ready``).  XLA's CPU threads are fixed when JAX
    starts (see :func:`set_peer_threads`).

    Parameters
    ----------
    q, k, v : ndarray of shape (B, n_q, d_k), (B, n_k, d_k), (B, n_k, d_v)
        float32 (the operator computes its softmax in float32 whatever the
        inputs' dtype, so float64 would not be float64), ``B = batch *
        heads``; copied to the device once, here.  The operator's
        ``(batch, n, heads, d)`` layout is formed inside the jitted function
        (XLA may fuse it), as is the output's way back.
    causal, scale, heads
        As in :func:`torch_softmax_call` (JAX's ``is_causal`` is aligned at
        the top left too).

    Returns
    -------
    callable
        The output as an ndarray ``(B, n_q, d_v)``.

    Raises
    ------
    TypeError
        If the inputs are not float32.
    ValueError
        If ``causal`` and ``n_q != n_k``, ``heads`` does not divide ``B``, or
        ``d_v != d_k`` (which the operator does not take).
    """
    _check_peer_inputs("jax", q, k, v, causal, heads)
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"jax.nn.dot_product_attention needs d_v == d_k, got d_k={q.shape[-1]}, "
                         f"d_v={v.shape[-1]}")
    if not all(x.dtype == np.float32 for x in (q, k, v)):
        raise TypeError("jax.nn.dot_product_attention computes the softmax in float32 whatever "
                        f"the inputs' dtype; give it float32, got {q.dtype}")
    import jax

    batch = q.shape[0] // heads
    out_shape = q.shape[:-1] + v.shape[-1:]

    def attend(q4, k4, v4):
        # (batch, heads, n, d) -> (batch, n, heads, d), the layout of the operator
        q4, k4, v4 = (x.transpose(0, 2, 1, 3) for x in (q4, k4, v4))
        out = jax.nn.dot_product_attention(q4, k4, v4, scale=float(scale), is_causal=bool(causal),
                                           implementation="xla")
        return out.transpose(0, 2, 1, 3)

    attend = jax.jit(attend)
    args = [jax.device_put(x.reshape(batch, heads, *x.shape[1:])) for x in (q, k, v)]
    attend(*args).block_until_ready()  # compile outside the timing

    def call():
        return np.asarray(attend(*args).block_until_ready()).reshape(out_shape)

    return call


def torch_linear_call(q, k, v, causal, feature_map="elu", eps=1e-6, heads=1):
    """A no-argument callable computing linear attention in plain PyTorch.

    Non-causal: the product form, ``O(n d_k d_v)`` time and ``O(n d + d_k d_v)``
    memory.  Causal: the cumulative-sum form, ``S_i = cumsum_j φ(k_j)ᵀ v_j``
    stored for every position, ``O(n d_k d_v)`` time and memory.

    Parameters
    ----------
    q, k, v : ndarray of shape (B, n, d_k), (B, n, d_k), (B, n, d_v)
    causal : bool
        Requires ``n_q == n_k`` (the cumulative sums run along one sequence).
    feature_map : {"elu", "relu"}
    eps : float
    heads : int, default 1
        Inputs are passed as ``(batch, heads, n, d)`` tensors.

    Returns
    -------
    callable
        Returns the output as an ndarray ``(B, n_q, d_v)``.
    """
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
    if name == "jax" and attention == "softmax":
        return 3 * batch * n * n * itemsize  # XLA forms the scores, their exp and the weights
    if name == "onnxruntime" and attention == "softmax":
        return batch * n * n * itemsize + 8 * batch * n * max(d_k, d_v) * itemsize  # weights; layouts
    return 4 * batch * n * max(d_k, d_v) * itemsize


#: Call builders by (attention, regime), then by peer.
CALLS = {
    ("softmax", "prefill"): {
        "torch": torch_softmax_call,
        "onnxruntime": onnxruntime_softmax_call,
        "jax": jax_softmax_call,
    },
    ("linear", "prefill"): {"torch": torch_linear_call},
    ("softmax", "decode"): {"torch": torch_softmax_decode_call},
    ("linear", "decode"): {"numpy": numpy_linear_decode_call},
}
#: The prefill builders, by peer.
SOFTMAX_CALLS, LINEAR_CALLS = CALLS["softmax", "prefill"], CALLS["linear", "prefill"]

#: Feature maps the peers' linear attention implements (None: the default, elu).
PEER_FEATURE_MAPS = (None, "elu", "relu")


def why_not(name, attention, dtype=None, d_k=None, d_v=None, regime="prefill", feature_map=None):
    """Why peer ``name`` has no call for such a point, or None when it has one.

    Parameters
    ----------
    name : str
        One of :data:`PEERS`.
    attention : {"softmax", "linear"}
    dtype : str or dtype, optional
    d_k, d_v : int, optional
    regime : {"prefill", "decode"}, default "prefill"
    feature_map : str, optional

    Returns
    -------
    str or None
    """
    if name not in CALLS[attention, regime]:
        return f"{name} has no {attention} attention ({regime}) to race"
    if attention == "linear" and feature_map not in PEER_FEATURE_MAPS:
        return f"{name}'s linear attention has no feature map {feature_map!r}"
    if name in ("onnxruntime", "jax") and dtype is not None and np.dtype(dtype) != np.float32:
        return f"{name}'s softmax attention runs in float32 only"
    if name == "jax" and d_k is not None and d_k != d_v:
        return "jax.nn.dot_product_attention needs d_v == d_k"
    return None


def supports(name, attention, regime="prefill", feature_map=None):
    """True if peer ``name`` has a call for this attention, regime and feature map."""
    return why_not(name, attention, regime=regime, feature_map=feature_map) is None
