"""Peers: what a user would otherwise call, measured on the same inputs and checked against
the float64 reference like any backend; each one :class:`Peer` in :data:`PEERS`, optional
(``pip install -e ".[peers]"``) and found without being imported.  A call builder takes
``(q, k, v, causal, option, heads=1)``: C-contiguous ``(B, n, d)`` arrays, ``B = batch *
heads``, ``option`` the scale (softmax) or the feature map (linear); it returns a callable
whose result is the ``(B, n_q, d_v)`` output and whose ``fields``, if any, go into the record
(``compile_s``: its untimed compile; ``peer_path``: what ran).  It raises ValueError for what
it cannot compute as fastattn does, TypeError for a dtype it does not run."""

import importlib.metadata
import importlib.util
import os
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .._threads import blas_threads, default_num_threads

#: Thread count the peers get (set by :func:`set_peer_threads`; None: each one's default).
_threads = None


@dataclass(frozen=True)
class Peer:
    """One peer: the ``modules`` it needs (none imported to find them), the ``install``
    command, its call builders by ``(attention, regime)``, ``set_threads(n)`` and
    ``threads()``, the ``distributions`` whose versions are recorded (default ``modules``),
    its limits, and the ``n_q x n_k``, ``n x d`` (causal linear: ``n x d_k x d_v``) arrays a
    call needs beyond its inputs and output, so what cannot fit is skipped."""

    name: str
    modules: tuple
    install: str
    calls: dict
    set_threads: Callable
    threads: Callable
    distributions: tuple = ()
    float32_only: bool = False
    same_d: bool = False
    feature_maps: tuple = (None, "elu", "relu")
    square_arrays: int = 0
    layouts: int = 4
    causal_states: int = 0
    causal_squares: int = 0

    def available(self):
        return all(_findable(m) for m in self.modules)

    def version(self):
        return _version((self.distributions or self.modules)[0])

    def extra_bytes(self, attention, causal, batch, n_q, n_k, d_k, d_v, itemsize, regime):
        # A decode step: softmax's calls are unmasked (_unmasked); linear keeps no causal state.
        causal = causal and regime != "decode"
        if attention == "linear" and causal and self.causal_states:
            return self.causal_states * batch * n_k * d_k * d_v * itemsize
        squares = self.square_arrays + (self.causal_squares if causal else 0)
        layouts = self.layouts * max(n_q, n_k) * max(d_k, d_v)
        return (squares * n_q * n_k + layouts) * batch * itemsize


def _findable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # blocked, or a half-imported module
        return False


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch():
    """torch, imported with the peers' thread count."""
    first = "torch" not in sys.modules
    import torch
    if first and _threads is not None:
        torch.set_num_threads(_threads)
    return torch


def _set_torch_threads(n):
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def _torch_threads():
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else _threads


def _threads_set():
    """The count given to a peer that takes it when a call is built."""
    return _threads if _threads is not None else default_num_threads()


#: XLA flags that keep JAX's CPU computations on one thread.
_XLA_ONE_THREAD = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")


def _set_jax_threads(n):
    """One thread goes into ``XLA_FLAGS`` before JAX's first import; more leave XLA's
    default (one per usable CPU); once JAX has started the count is fixed."""
    if "jax" not in sys.modules:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in _XLA_ONE_THREAD]
        os.environ["XLA_FLAGS"] = " ".join(flags + (list(_XLA_ONE_THREAD) if n == 1 else []))


def _jax_threads():
    flags = os.environ.get("XLA_FLAGS", "").split()
    return 1 if all(f in flags for f in _XLA_ONE_THREAD) else default_num_threads()


def _set_blas_threads(n):
    from threadpoolctl import threadpool_limits
    threadpool_limits(n, user_api="blas")


def _check_inputs(name, q, k, v, causal, heads, float32_why=None):
    """Refuse what a peer's softmax cannot compute as fastattn does (given ``float32_why``,
    any dtype but float32); return the output's shape."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v must be (B, n, d) arrays, got shapes {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if heads < 1 or q.shape[0] % heads:
        raise ValueError(f"heads must divide B = {q.shape[0]}, got {heads}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"{name}'s causal mask equals fastattn's only when n_q == n_k")
    if float32_why and not all(x.dtype == np.float32 for x in (q, k, v)):
        raise TypeError(f"{name} runs float32 only ({float32_why}), got {q.dtype}")
    return q.shape[:-1] + v.shape[-1:]


def _as_4d(torch, arrays, heads):
    """``(B, n, d)`` arrays as ``(B / heads, heads, n, d)`` tensors, no copy: SDPA's CPU
    flash kernel takes 4-D inputs only (3-D fall back to the O(n²) path)."""
    return tuple(torch.from_numpy(x).view(-1, heads, *x.shape[-2:]) for x in arrays)


def torch_softmax_call(q, k, v, causal, scale, heads=1):
    """Softmax attention by PyTorch's SDPA, float32 or float64, ``is_causal`` aligned at the
    top left."""
    out_shape = _check_inputs("torch", q, k, v, causal, heads)
    torch = _torch()
    tq, tk, tv = _as_4d(torch, (q, k, v), heads)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call():
        with torch.inference_mode():
            out = sdpa(tq, tk, tv, is_causal=bool(causal), scale=float(scale))
            return out.numpy().reshape(out_shape)

    return call


def torch_flex_call(q, k, v, causal, scale, heads=1):
    """Softmax attention by FlexAttention under ``torch.compile(dynamic=False)`` (inductor's
    C++ template), float32 only, causal by a top-left block mask.  Compiled here for these
    shapes (``compile_s``; ``peer_path`` says if inductor's cache had the code), on a code
    object of its own: dynamo keeps graphs per code object, so no other build's shapes count
    against its recompile limit or replace its graph."""
    out_shape = _check_inputs("torch_flex", q, k, v, causal, heads,
                              "FlexAttention on the CPU takes float32, float16, bfloat16")
    torch = _torch()
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def attend(q4, k4, v4, block_mask):
        return flex_attention(q4, k4, v4, block_mask=block_mask, scale=float(scale))

    own = types.FunctionType(attend.__code__.replace(), attend.__globals__, None, None,
                             attend.__closure__)  # a new code object: see above
    attend = torch.compile(own, dynamic=False)
    tq, tk, tv = _as_4d(torch, (q, k, v), heads)
    with torch.inference_mode():
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, q.shape[1], k.shape[1],
                                 device="cpu") if causal else None
        start, hits = time.perf_counter(), counters["inductor"]["fxgraph_cache_hit"]
        attend(tq, tk, tv, mask)
        compile_s = time.perf_counter() - start
    cached = counters["inductor"]["fxgraph_cache_hit"] > hits

    def call():
        with torch.inference_mode():
            return attend(tq, tk, tv, mask).numpy().reshape(out_shape)

    call.fields = {"compile_s": compile_s, "peer_path": "torch.compile(flex_attention, dynamic="
                   "False), compiled per shape: inductor's C++ flex template" + (
                       ", its code from inductor's FX graph cache" if cached else "")}
    return call


def openvino_softmax_call(q, k, v, causal, scale, heads=1):
    """Softmax attention by one opset13 ScaledDotProductAttention node compiled for OpenVINO's
    CPU plugin (peers' threads, one stream, f32), float32 only, reading the inputs in place.
    ``peer_path``: whether the runtime graph kept the SDPA node, then its computing nodes'
    layer/primitive types (``Subgraph``: a Snippets kernel; ``+Softmax``: holds the softmax)."""
    out_shape = _check_inputs("openvino", q, k, v, causal, heads,
                              "its CPU plugin computes f64 inputs in f32")
    import openvino as ov
    import openvino.opset13 as ops

    arrays = [x.reshape(-1, heads, *x.shape[1:]) for x in (q, k, v)]
    params = [ops.parameter(x.shape, ov.Type.f32, name=n) for n, x in zip("qkv", arrays)]
    sdpa = ops.scaled_dot_product_attention(*params, None, ops.constant(np.float32(scale)),
                                            causal=bool(causal))
    config = {"INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": 1,
              "INFERENCE_NUM_THREADS": _threads_set()}
    start = time.perf_counter()
    compiled = ov.Core().compile_model(ov.Model([sdpa], params, "fastattn_peer"), "CPU", config)
    compile_s, request = time.perf_counter() - start, compiled.create_infer_request()
    for i, x in enumerate(arrays):
        request.set_input_tensor(i, ov.Tensor(x, shared_memory=True))
    ran = [{key: value.astype(str) for key, value in op.get_rt_info().items()}
           for op in compiled.get_runtime_model().get_ordered_ops()]
    ran = [f"{r['layerType']}/{r['primitiveType']}" + ("+Softmax" if "Softmax" in
           r.get("originalLayersNames", "") else "") for r in ran
           if r["layerType"] not in ("Input", "Output", "Const")]
    kept = any(node.startswith("ScaledDotProductAttention/") for node in ran)

    def call():
        request.infer()
        return request.get_output_tensor().data.reshape(out_shape).copy()

    call.fields = {"compile_s": compile_s, "peer_path": ("SDPA node: " if kept else
                                                         "SDPA decomposed: ") + ", ".join(ran)}
    call.inputs = arrays  # what the request reads: an ov.Tensor does not keep it alive
    return call


def _heads_moved(x, heads, last=True):
    """``(batch * heads, n, d)`` as ``(batch, n, heads * d)``, or back when not ``last``."""
    b, n, d = x.shape
    moved = np.ascontiguousarray(x.reshape((b // heads, heads, n, d) if last else
                                           (b, n, heads, d // heads)).transpose(0, 2, 1, 3))
    return moved.reshape(b // heads, n, heads * d) if last else moved.reshape(b * heads, n, -1)


def onnxruntime_softmax_call(q, k, v, causal, scale, heads=1):
    """Softmax attention by one ``com.microsoft`` MultiHeadAttention node (``unidirectional``
    when causal) in a CPU ``InferenceSession`` on the peers' threads, float32 only.  Its input
    layout is made once, untimed; each call moves its output back (``O(B n d_v)``)."""
    _check_inputs("onnxruntime", q, k, v, causal, heads, "MultiHeadAttention")
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    feeds = dict(zip(("query", "key", "value"), (_heads_moved(x, heads) for x in (q, k, v))))
    node = helper.make_node("MultiHeadAttention", list(feeds), ["output"],
                            domain="com.microsoft", num_heads=int(heads), scale=float(scale),
                            unidirectional=int(bool(causal)))
    info = helper.make_tensor_value_info
    graph = helper.make_graph([node], "fastattn_peer", [
        info(name, TensorProto.FLOAT, list(x.shape)) for name, x in feeds.items()],
        [info("output", TensorProto.FLOAT, [q.shape[0] // heads, q.shape[1], heads * v.shape[2]])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(model)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = _threads_set(), 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    return lambda: _heads_moved(session.run(None, feeds)[0], heads, last=False)


def jax_softmax_call(q, k, v, causal, scale, heads=1):
    """Softmax attention by ``jax.nn.dot_product_attention`` (XLA) under ``jax.jit``, compiled
    here by a warm-up call; float32 only, ``d_v == d_k``, causal aligned at the top left."""
    out_shape = _check_inputs("jax", q, k, v, causal, heads, "its softmax is float32 always")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"jax.nn.dot_product_attention needs d_v == d_k, got d_k={q.shape[-1]}, "
                         f"d_v={v.shape[-1]}")
    import jax

    @jax.jit
    def attend(q4, k4, v4):
        q4, k4, v4 = (x.transpose(0, 2, 1, 3) for x in (q4, k4, v4))
        out = jax.nn.dot_product_attention(q4, k4, v4, scale=float(scale), is_causal=bool(causal),
                                           implementation="xla")
        return out.transpose(0, 2, 1, 3)

    args = [jax.device_put(x.reshape(-1, heads, *x.shape[1:])) for x in (q, k, v)]
    attend(*args).block_until_ready()  # compile outside the timing
    return lambda: np.asarray(attend(*args).block_until_ready()).reshape(out_shape)


def torch_linear_call(q, k, v, causal, feature_map="elu", eps=1e-6, heads=1):
    """Linear attention in plain PyTorch (Katharopoulos et al. 2020): non-causal, the product
    form ``φ(q) (φ(k)ᵀ v) / (φ(q) Σ_j φ(k_j) + eps)``; causal (``n_q == n_k``), the
    cumulative-sum form storing every ``S_i``, ``O(n d_k d_v)`` memory."""
    torch = _torch()
    F = torch.nn.functional
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError("the cumulative-sum form needs n_q == n_k")
    if feature_map not in ("elu", "relu"):
        raise ValueError(f"feature_map must be 'elu' or 'relu', got {feature_map!r}")
    phi = (lambda x: F.elu(x) + 1) if feature_map == "elu" else F.relu
    tq, tk, tv = _as_4d(torch, (q, k, v), heads)
    out_shape = q.shape[:-1] + v.shape[-1:]

    def call():
        with torch.inference_mode():
            pq, pk = phi(tq), phi(tk)
            if causal:  # S_i of every position, (..., n, d_k, d_v)
                states = torch.cumsum(pk.unsqueeze(-1) * tv.unsqueeze(-2), dim=-3)
                numerator = torch.einsum("...nk,...nkv->...nv", pq, states)
                denominator = (pq * torch.cumsum(pk, dim=-2)).sum(dim=-1, keepdim=True) + eps
            else:
                numerator = pq @ (pk.transpose(-2, -1) @ tv)                  # S: (..., d_k, d_v)
                denominator = (pq @ pk.sum(dim=-2).unsqueeze(-1)) + eps      # (..., n, 1)
            return (numerator / denominator).numpy().reshape(out_shape)

    return call


def numpy_linear_decode_call(q, k, v, causal, feature_map="elu", eps=1e-6, heads=1):
    """The plain NumPy recurrent step of linear attention: ``S = φ(k)ᵀ v``, ``z = Σ φ(k)`` of
    the first ``n - 1`` keys, built once; each call adds the newest key in place and returns
    ``φ(q) S / (φ(q) · z + eps)``, ``(B, 1, d_v)``."""
    if feature_map not in ("elu", "relu"):
        raise ValueError(f"feature_map must be 'elu' or 'relu', got {feature_map!r}")
    phi = (lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))) \
        if feature_map == "elu" else (lambda x: np.maximum(x, 0))
    k0, v0, k1, v1 = k[..., :-1, :], v[..., :-1, :], k[..., -1:, :], v[..., -1:, :]
    pk0 = phi(k0)
    S, z = np.swapaxes(pk0, -1, -2) @ v0, pk0.sum(axis=-2)

    def step():
        pk, pq = phi(k1), phi(q)
        S[...] += np.swapaxes(pk, -1, -2) @ v1
        z[...] += pk[..., 0, :]
        return (pq @ S) / ((pq * z[..., None, :]).sum(axis=-1, keepdims=True) + eps)

    return step


def _unmasked(build):
    """``build``'s decode step: unmasked, as fastattn's bottom-right mask shows it every key."""
    return lambda q, k, v, causal, scale, heads=1: build(q, k, v, False, scale, heads)


#: torch at the ``peers`` extra's pin, from PyTorch's CPU index (PyPI's is a CUDA build).
_TORCH = ".venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
#: Every peer, by name (in the order of the tables).
PEERS = {peer.name: peer for peer in (
    Peer("torch", ("torch",), _TORCH,
         {("softmax", "prefill"): torch_softmax_call, ("linear", "prefill"): torch_linear_call,
          ("softmax", "decode"): _unmasked(torch_softmax_call)},
         _set_torch_threads, _torch_threads, causal_states=2),
    Peer("torch_flex", ("torch",), _TORCH, {("softmax", "prefill"): torch_flex_call,
                                            ("softmax", "decode"): _unmasked(torch_flex_call)},
         _set_torch_threads, _torch_threads, float32_only=True, layouts=2),
    Peer("onnxruntime", ("onnxruntime", "onnx"), ".venv/bin/pip install onnxruntime onnx",
         {("softmax", "prefill"): onnxruntime_softmax_call}, lambda n: None, _threads_set,
         float32_only=True, square_arrays=1, layouts=8),  # the weights; the layouts
    Peer("openvino", ("openvino",), ".venv/bin/pip install openvino",
         {("softmax", "prefill"): openvino_softmax_call,
          ("softmax", "decode"): _unmasked(openvino_softmax_call)}, lambda n: None, _threads_set,
         float32_only=True, causal_squares=1),  # its decomposition's causal mask
    Peer("jax", ("jax",), ".venv/bin/pip install jax", {("softmax", "prefill"): jax_softmax_call},
         _set_jax_threads, _jax_threads, ("jax", "jaxlib"), float32_only=True, same_d=True,
         square_arrays=3, layouts=0),  # XLA forms the scores, their exp and the weights
    Peer("numpy", ("numpy",), "pip install numpy",
         {("linear", "decode"): numpy_linear_decode_call}, _set_blas_threads, blas_threads),
)}

#: How to add a missing peer, by name: a command to paste in the fastattn checkout.
INSTALL_HINT = {name: peer.install for name, peer in PEERS.items()}


def available_peers():
    """Peers importable here (without importing them), as a tuple of names."""
    return tuple(name for name, peer in PEERS.items() if peer.available())


def absent_peers():
    """Peers that are not installed, as a dict of name to the command that installs it."""
    return {name: peer.install for name, peer in PEERS.items() if not peer.available()}


def set_peer_threads(n_threads):
    """Fix every peer's intra-op thread count, now if imported, else on import."""
    global _threads
    _threads = int(n_threads)
    for peer in PEERS.values():
        peer.set_threads(_threads)


def peer_threads():
    """Thread counts of the available peers, by name: in force, or as they will be set."""
    return {name: PEERS[name].threads() for name in available_peers()}


def why_not(name, attention, dtype=None, d_k=None, d_v=None, regime="prefill", feature_map=None):
    """Why peer ``name`` has no call for such a point, or None when it has one."""
    peer = PEERS[name]
    if (attention, regime) not in peer.calls:
        return f"{peer.name} has no {attention} attention ({regime}) to race"
    if attention == "linear" and feature_map not in peer.feature_maps:
        return f"{peer.name}'s linear attention has no feature map {feature_map!r}"
    if peer.float32_only and dtype is not None and np.dtype(dtype) != np.float32:
        return f"{peer.name}'s softmax attention runs in float32 only"
    if peer.same_d and d_k is not None and d_k != d_v:
        return f"{peer.name}'s softmax attention needs d_v == d_k"
    return None
