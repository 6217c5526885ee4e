"""The section "What a whole model keeps": MiniLM with each attention in every layer, laid
out from :class:`fastattn.model.study.ModelStudy` (measured there, never here)."""

from . import figures
from .figures import plt  # pyplot once figures has selected Agg

#: The page's link to this section.
NAV = "Whole model"

#: What "usable" means here: the issue's bars on held-out texts.
USABLE_COSINE, USABLE_SPEARMAN_GAP = 0.97, 0.03
#: Lengths the attention's share of the forward pass is projected to.
PROJECTED_NS = (2048, 8192, 32768)
#: The time exponent of an attention kind where the scaling section fitted none.
THEORY_EXPONENT = {"softmax": 2.0, "linear": 1.0}


def scaling_exponents(curves):
    """``{kind: (exponent, where from)}``: the median fitted time exponent of the scaling
    section's fastattn curves of each attention kind (non-causal prefill), else theory's."""
    out = {}
    for kind, theory in THEORY_EXPONENT.items():
        fits = sorted(c.time_fit.slope for c in curves
                      if c.attention == kind and not c.peer and not c.causal and c.time_fit
                      and (c.key.get("regime") or "prefill") == "prefill")
        out[kind] = ((fits[len(fits) // 2], f"fitted ({len(fits)} curves)") if fits
                     else (theory, "theory (no fit in this run)"))
    return out


def projected_shares(seconds, attention, exponents, ns=PROJECTED_NS):
    """The attention's share of one text's forward pass at each of ``ns`` tokens, from its
    ``seconds`` at the measured length and the ``attention`` seconds in it by kind: each kind
    scaled by ``(n / n_0)^exponent``, the rest (projections, feed-forward, LayerNorm) by
    ``n / n_0``.  A projection, not a measurement: MiniLM's positions stop at 512 tokens."""
    n0, out = seconds[0], []
    rest = seconds[1] - sum(attention.values())
    for n in ns:
        f = n / n0
        attn = sum(s * f ** exponents[kind][0] for kind, s in attention.items())
        out.append(attn / (attn + rest * f))
    return out


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
    exponents = scaling_exponents(page.curves or [])
    shares = [{"name": name, "measured": sum(a.values()) / study.seconds[n][name],
               "projected": projected_shares((n, study.seconds[n][name]), a, exponents)}
              for name, a in study.attention_seconds.get(n, {}).items() if a]
    return {"missing": None, "s": study, "usable": usable, "ns": sorted(study.seconds),
            "share_n": n, "shares": shares, "projected_ns": PROJECTED_NS,
            "exponents": exponents,
            "figure": figures.data_uri(quality_cost_figure(study.rows, study.seconds, n)),
            "summary": [f"A whole model (all-MiniLM-L6-v2) stays usable (held-out cosine >= "
                        f"{USABLE_COSINE}) with " + (", ".join(usable) or "no linear attention")
                        + " in place of softmax attention."]}
