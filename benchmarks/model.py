"""What a whole model costs with each attention: MiniLM's forward pass, and the Hedgehog fit.

all-MiniLM-L6-v2 (6 layers, 12 heads of d_k = 32) in NumPy
(:class:`fastattn.model.MiniLM`) with one attention in every layer, on 8 texts
of the Lee background corpus cut to ``n`` tokens, float32:

* :class:`ModelForward` times ``encode_ids`` per attention (softmax, elu+1,
  relu, Taylor, FAVOR+ at m = 64 d_k, Hedgehog);
* :class:`HedgehogFit` times the fit of one layer's 12 heads (16 calibration
  texts of up to 128 tokens, 20 L-BFGS-B iterations) and tracks the loss it
  reaches (the mean row KL divergence to the model's softmax weights).

Needs the ``model`` extra (``pip install -e ".[model]"``); without it every
combination is skipped in setup.
"""

import warnings

import numpy as np

from .common import fix_threads, skip_if_quick

#: Tokens per text of the forward pass.
MODEL_N = ("128", "512")
#: The attention of every layer (names of the ``fastattn model`` table).
MODEL_ATTENTIONS = ("softmax", "elu+1", "relu", "taylor", "favor m=2048", "hedgehog")
TEXTS = 8


def _model():
    """The MiniLM, or asv's skip naming the extra when it is not installed."""
    try:
        from fastattn.model import MiniLM, MissingExtraError
    except ImportError as exc:   # a commit without the model study
        raise NotImplementedError(f"this commit has no fastattn.model: {exc}") from None
    try:
        return MiniLM()
    except MissingExtraError as exc:
        raise NotImplementedError(str(exc)) from None


def _ids(model, n, texts=TEXTS):
    """Token ids of the first ``texts`` background texts of at least ``n`` tokens, cut to ``n``."""
    from fastattn.model.data import background_split

    calibration, _ = background_split(150)
    with warnings.catch_warnings():   # the texts beyond 512 tokens are cut, as said above
        warnings.simplefilter("ignore", UserWarning)
        ids = [t for t in model.tokenize(calibration) if len(t) >= n][:texts]
    if len(ids) < texts:
        raise NotImplementedError(f"fewer than {texts} calibration texts of {n} tokens")
    return [np.append(t[:n - 1], t[-1]) for t in ids]


class ModelForward:
    """``MiniLM.encode_ids`` of 8 texts of ``n`` tokens with one attention in all 6 layers."""

    params = (MODEL_ATTENTIONS, MODEL_N)
    param_names = ("attention", "n")
    rounds = 1
    repeat = (2, 5, 20.0)
    warmup_time = 0
    timeout = 600

    def setup(self, attention, n):
        skip_if_quick(n, MODEL_N[0])
        from fastattn.model import HedgehogFeatures
        from fastattn.model.study import default_configurations

        self.model = _model()
        fix_threads()
        # Identity maps cost what fitted ones do (the same D = 2 d_k features).
        configs = default_configurations(HedgehogFeatures.identity(32, (6, 2, 12)))
        self.attention = configs[attention]
        self.ids = _ids(self.model, int(n))
        self.model.encode_ids(self.ids[:1], self.attention)   # compile and warm up

    def time_forward(self, attention, n):
        self.model.encode_ids(self.ids, self.attention)


class HedgehogFit:
    """The fit of one layer's 12 Hedgehog heads: its time and the loss it reaches."""

    params = (("separate", "tied"),)
    param_names = ("maps",)
    number = 1
    repeat = 1
    warmup_time = 0
    timeout = 600

    def setup(self, maps):
        skip_if_quick(128, 128)
        from fastattn.model.hedgehog import fit_layer

        model = _model()
        fix_threads()
        captured = {}

        def keep(layer, index, q, k):
            if layer == 0:
                for b, i in enumerate(index):
                    captured[i] = (q[b].copy(), k[b].copy())
        ids = _ids(model, 128, texts=16)
        model.encode_ids(ids, "softmax", hook=keep)
        self.qk = [captured[i] for i in range(len(ids))]
        self.fit = lambda: fit_layer(self.qk, separate=maps == "separate", maxiter=20)

    def time_fit_layer(self, maps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # 20 iterations: not converged
            self.fit()

    def track_fit_loss(self, maps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return self.fit()[2].loss

    track_fit_loss.unit = "nats"
