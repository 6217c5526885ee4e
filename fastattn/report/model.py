"""The section "What a whole model keeps": MiniLM with each attention in every layer, laid
out from :class:`fastattn.model.study.ModelStudy` (measured there, never here)."""

from . import figures
from .figures import plt  # pyplot once figures has selected Agg

#: The page's link to this section.
NAV = "Whole model"

#: What "usable" means here: the issue's bars on held-out texts.
USABLE_COSINE, USABLE_SPEARMAN_GAP = 0.97, 0.03


def quality_cost_figure(rows, seconds, n):
    """PNG: held-out mean cosine to the original model against ms per token at ``n``."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    for r in rows:
        x = seconds[n][r.name] / n * 1e3
        ax.plot(x, r.held_out.mean_cosine, "o", color="#2ca02c" if r.name == "softmax"
                else "#1f77b4")
        ax.annotate(r.name, (x, r.held_out.mean_cosine), textcoords="offset points",
                    xytext=(5, 3), fontsize=8)
    ax.axhline(USABLE_COSINE, color="grey", ls=":", lw=1)
    ax.set_xlabel(f"forward pass, ms per token at n = {n}")
    ax.set_ylabel("held-out mean cosine to the original")
    ax.grid(True, alpha=0.3)
    return figures.to_png(fig)


def section(page):
    """The block of ``page.model``: a :class:`~fastattn.model.study.ModelStudy`, a string
    (why it is missing: the extra to install) or None (not asked for)."""
    study = page.model
    if study is None or isinstance(study, str):
        return None if study is None else {"missing": study}
    softmax = study.rows[0]
    usable = [r.name for r in study.rows[1:]
              if r.held_out.mean_cosine >= USABLE_COSINE
              and r.lee_spearman >= softmax.lee_spearman - USABLE_SPEARMAN_GAP]
    n = max(study.seconds)
    return {"missing": None, "s": study, "usable": usable, "ns": sorted(study.seconds),
            "figure": figures.data_uri(quality_cost_figure(study.rows, study.seconds, n)),
            "summary": [f"A whole model (all-MiniLM-L6-v2) stays usable (held-out cosine >= "
                        f"{USABLE_COSINE}) with " + (", ".join(usable) or "no linear attention")
                        + " in place of softmax attention."]}
