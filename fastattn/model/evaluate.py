"""How much of the model an attention keeps: agreement with human judgement and with the original.

* :func:`human_spearman` -- Spearman's rank correlation of the model's cosine
  similarities with the human judgements of the Lee et al. (2005) pairs;
* :func:`agreement` -- on held-out texts, embeddings against the original
  model's: mean cosine, nearest-neighbour agreement (top 1, overlap of the top
  10) and the Spearman correlation of all pairwise similarities.
"""

from dataclasses import dataclass

import numpy as np


def _unit(e, name):
    e = np.asarray(e, dtype=np.float64)
    if e.ndim != 2 or e.shape[0] < 2:
        raise ValueError(f"{name} must have shape (n_texts >= 2, dim), got {e.shape}")
    if not np.isfinite(e).all():
        raise ValueError(f"{name} holds {np.count_nonzero(~np.isfinite(e))} non-finite values")
    norm = np.linalg.norm(e, axis=1, keepdims=True)
    return e / np.maximum(norm, 1e-300)


def human_spearman(embeddings, judgements=None):
    """Spearman's rho of the cosine similarities of ``embeddings`` with human judgements.

    Parameters
    ----------
    embeddings : ndarray of shape (50, dim)
        Of :func:`fastattn.model.data.lee_documents`, in order.
    judgements : ndarray of shape (50, 50), optional
        Default :func:`fastattn.model.data.lee_similarities`; its upper
        triangle (1,225 pairs) is used.

    Returns
    -------
    float
    """
    from scipy.stats import spearmanr

    if judgements is None:
        from .data import lee_similarities

        judgements = lee_similarities()
    e = _unit(embeddings, "embeddings")
    if judgements.shape != (len(e), len(e)):
        raise ValueError(f"judgements must have shape ({len(e)}, {len(e)}) for {len(e)} "
                         f"embeddings, got {judgements.shape}")
    i, j = np.triu_indices(len(e), 1)
    return float(spearmanr((e @ e.T)[i, j], judgements[i, j]).statistic)


@dataclass(frozen=True)
class Agreement:
    """Agreement of embeddings with the original model's on the same texts.

    Attributes
    ----------
    mean_cosine : float
        Mean over texts of the cosine between a text's embedding and its original.
    min_cosine : float
        The lowest of them.
    top1 : float
        Fraction of texts whose nearest other text is the original's nearest.
    top10_overlap : float
        Mean fraction of a text's 10 nearest others (by the original) also
        among its 10 nearest here.
    spearman : float
        Spearman's rho between all pairwise cosine similarities here and the original's.
    n_texts : int
    """

    mean_cosine: float
    min_cosine: float
    top1: float
    top10_overlap: float
    spearman: float
    n_texts: int


def _neighbours(sim, k):
    s = sim.copy()
    np.fill_diagonal(s, -np.inf)
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


def agreement(embeddings, original, k=10):
    """How far ``embeddings`` agree with the ``original`` model's on the same texts.

    Parameters
    ----------
    embeddings, original : ndarray of shape (n_texts, dim)
        Row ``i`` of both is text ``i``; ``n_texts > k``.
    k : int, default 10
        The neighbourhood of ``top10_overlap``.

    Returns
    -------
    Agreement
    """
    from scipy.stats import spearmanr

    e, o = _unit(embeddings, "embeddings"), _unit(original, "original")
    if e.shape != o.shape:
        raise ValueError(f"embeddings {e.shape} and original {o.shape} must have one shape")
    if len(e) <= k:
        raise ValueError(f"agreement needs more than k={k} texts, got {len(e)}")
    cos = np.sum(e * o, axis=1)
    se, so = e @ e.T, o @ o.T
    ne, no = _neighbours(se, k), _neighbours(so, k)
    overlap = np.mean([len(set(a) & set(b)) / k for a, b in zip(ne, no)])
    i, j = np.triu_indices(len(e), 1)
    return Agreement(
        mean_cosine=float(cos.mean()),
        min_cosine=float(cos.min()),
        top1=float(np.mean(ne[:, 0] == no[:, 0])),
        top10_overlap=float(overlap),
        spearman=float(spearmanr(se[i, j], so[i, j]).statistic),
        n_texts=len(e),
    )
