"""Generation, one token at a time: time per token and bytes held at context length n.

The decode regime of issue 11: each generated token's query attends over
everything before it.

* softmax: ``softmax_attention(q1, k, v, causal=True, backend=...)`` with one
  query ``q1 (H, 1, d)`` against a KV cache ``k, v (H, n, d)``: O(n d) work,
  ``2 n d`` values held per head;
* linear: one recurrent step ``linear_attention(q1, k1, v1, causal=True,
  initial_state=state, return_state=True, backend=...)`` (elu + 1 feature
  map) from the state ``(S, z)`` of the ``n - 1`` earlier keys, so the token
  sees ``n`` keys, as softmax's query sees its cache of ``n``: O(d_k d_v) work,
  ``d_k d_v + d_k`` values held per head whatever n.

H = :data:`common.DECODE_HEADS` heads of d = :data:`common.D`; n from 128 to
65536 (:data:`common.DECODE_N`).  Every call goes through the public API (the
per-call floor and the dispatch of ``backend=`` included).  The reference's
decode softmax holds ``1 x n`` scores per head, so it runs over the whole grid.
"""

import inspect

import numpy as np

import fastattn

from .common import (BACKENDS, BATCH, D, DECODE_HEADS, DECODE_N, DTYPES, REGIME_DECODE, engine,
                     fix_threads, peak_bytes, skip_if_no_memory, skip_if_quick,
                     skip_unless_built)

ATTENTIONS = ("softmax", "linear")


def decode_spec(attention, backend, n, dtype):
    """The engine's point of one decode step: ``n_q = 1`` query over ``n_k = n`` keys."""
    return {"attention": attention, "backend": backend, "causal": True, "n_q": 1,
            "n_k": int(n), "d_k": D, "d_v": D, "batch": BATCH, "heads": DECODE_HEADS,
            "dtype": dtype, "feature_map": "elu" if attention == "linear" else None}


def decode_qkv(point):
    """Seeded Gaussian ``q (H, 1, d)``, ``k, v (H, n, d)`` of a decode point."""
    if engine is None:
        rng = np.random.RandomState(point["n_k"])
        shape = (DECODE_HEADS, point["n_k"], D)
        q, k, v = (rng.standard_normal(s).astype(point["dtype"])
                   for s in ((DECODE_HEADS, 1, D), shape, shape))
        return q, k, v
    return engine.make_inputs(point)


class Decode:
    """Seconds per generated token, and bytes held, at context length n (float32, float64).

    ``setup`` skips what cannot run here (backend not built, memory, a commit
    whose ``linear_attention`` carries no state), builds the KV cache or the
    state and makes the step once, so the timed step is the steady-state cost
    of the public function.
    """

    params = ((REGIME_DECODE,), ATTENTIONS, BACKENDS, DECODE_N, DTYPES)
    param_names = ("regime", "attention", "backend", "n", "dtype")
    rounds = 1
    repeat = (2, 10, 4.0)
    warmup_time = 0
    timeout = 300

    def setup(self, regime, attention, backend, n, dtype):
        skip_if_quick(n, DECODE_N[0], dtype)
        skip_unless_built(backend)
        if attention == "linear" and not {"initial_state", "return_state"} <= set(
                inspect.signature(fastattn.linear_attention).parameters):
            raise NotImplementedError("this commit's linear_attention carries no state")
        point = decode_spec(attention, backend, n, dtype)
        skip_if_no_memory(point)
        fix_threads()
        q, k, v = decode_qkv(point)
        if attention == "softmax":
            self.held = (k, v)
            self.args, self.kwargs = (q, k, v), {"causal": True, "backend": backend}
            function = fastattn.softmax_attention
        else:
            function = fastattn.linear_attention
            _, state = function(q, k[:, :-1], v[:, :-1], return_state=True, backend=backend)
            self.held = state
            self.args = (q, k[:, -1:].copy(), v[:, -1:].copy())  # k, v themselves are dropped
            self.kwargs = {"causal": True, "initial_state": state, "return_state": True,
                           "backend": backend}
        self.step = lambda: function(*self.args, **self.kwargs)
        self.step()

    def time_token(self, regime, attention, backend, n, dtype):
        self.step()

    def track_bytes_per_head(self, regime, attention, backend, n, dtype):
        # What grows with the context: the KV cache (k, v), or the state (S, z).
        return sum(x.nbytes for x in self.held) // DECODE_HEADS

    track_bytes_per_head.unit = "bytes"

    def track_peak_bytes(self, regime, attention, backend, n, dtype):
        return peak_bytes(self.step)

    track_peak_bytes.unit = "bytes"
