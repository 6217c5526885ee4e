"""The Quality section: how far linear attention's output lands from softmax's, drawn from
:class:`fastattn.map_quality.QualityResults` (computed there)."""

import numpy as np

from . import figures
from .figures import plt  # pyplot once figures has selected Agg

NAV = "Quality"


def quality_figure(gaussian, minilm):
    """PNG of linear against softmax cosine similarity: Gaussian rows, MiniLM per layer."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.4]},
                             layout="constrained")
    ax = axes[0]
    ax.plot([r.n for r in gaussian], [r.cosine_similarity for r in gaussian], "o-",
            color="#1f77b4")
    figures.n_axis(ax)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("mean cosine similarity")
    ax.set_title("Gaussian inputs (seed-experiment generator)", fontsize=10)
    ax = axes[1]
    layers = np.arange(len(minilm))
    cos = np.array([r.cosine_similarity for r in minilm])
    lo, hi = np.array([r.cos_min for r in minilm]), np.array([r.cos_max for r in minilm])
    ax.bar(layers, cos, color="#ff7f0e", alpha=0.8, label="all heads")
    ax.errorbar(layers, cos, yerr=[cos - lo, hi - cos], fmt="none", ecolor="black", capsize=4,
                label="range over heads")
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1.02)
    ax.set_title("all-MiniLM-L6-v2 activations, per layer", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="y", alpha=0.3)
    return figures.to_png(fig)


def section(page):
    """The Quality block of ``page.quality`` (None: no block) and its summary sentence."""
    if (quality := page.quality) is None:
        return None
    g = [r.cosine_similarity for r in quality.gaussian]
    m = [r.cosine_similarity for r in quality.minilm]
    return {"r": quality,
            "figure": figures.data_uri(quality_figure(quality.gaussian, quality.minilm)),
            "heatmaps": [{"title": h.title, "note": h.note, "png": figures.data_uri(
                figures.weights_figure(h.title, [("softmax attention weights", h.softmax), (
                    "linear (elu+1) attention weights", h.linear)], ncols=2))}
                for h in quality.heatmaps],
            "summary": [f"Linear attention's output against softmax's: mean cosine similarity "
                        f"{min(g):.3f} to {max(g):.3f} on Gaussian inputs, but {min(m):.3f} to "
                        f"{max(m):.3f} per layer on real MiniLM activations."] if g and m else []}
