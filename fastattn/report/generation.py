"""The Generation section: what one generated token costs at context length n (the
``regime="decode"`` curves), and a prompt plus generated tokens end to end."""

from dataclasses import dataclass

import numpy as np

from ..bench.table import format_bytes, format_number, format_seconds
from . import analysis, figures

#: Prompt lengths P and generated lengths T of the end-to-end table.
PROMPTS = (1024, 8192)
GENERATED = (128, 1024, 8192)
NAV = "Generation"


@dataclass(frozen=True)
class EndToEnd:
    """A prompt of ``prompt`` tokens (one causal prefill) then ``generated`` decode steps."""

    attention: str
    prompt: int
    generated: int
    prefill_s: float
    decode_s: float
    prefill_kernel: str
    decode_kernel: str

    total_s = property(lambda self: self.prefill_s + self.decode_s)


def per_token_seconds(curve, contexts):
    """Seconds per token of ``curve`` at ``contexts``, interpolated in log-log between its
    measured n; None when a context lies outside them."""
    contexts = np.asarray(contexts, dtype=np.float64)
    ok = np.isfinite(curve.fit_s) & (curve.fit_s > 0)
    n, t = curve.n[ok].astype(np.float64), curve.fit_s[ok]
    if len(n) == 0 or contexts.min() < n[0] or contexts.max() > n[-1]:
        return None
    return np.exp(np.interp(np.log(contexts), np.log(n), np.log(t)))


def end_to_end(prefill, decode, prompts=PROMPTS, generated=GENERATED):
    """:class:`EndToEnd` per attention, P and T: the fastest fastattn causal prefill at n = P
    plus the fastest fastattn decode curve's times summed over contexts P+1 ... P+T."""
    rows = []
    for attention in ("softmax", "linear"):
        pre = [c for c in prefill if c.attention == attention and c.causal and not c.peer]
        dec = [c for c in decode if c.attention == attention and not c.peer]
        for p in prompts:
            t_pre, c_pre = analysis.fastest_at(pre, p)
            for t in generated if c_pre is not None else ():
                steps = [(per_token_seconds(c, np.arange(p + 1, p + t + 1)), c) for c in dec]
                t_dec, c_dec = min(((float(s.sum()), c) for s, c in steps if s is not None),
                                   key=lambda tc: tc[0], default=(None, None))
                if c_dec is not None:
                    rows.append(EndToEnd(attention, p, t, t_pre, t_dec, c_pre.label,
                                         c_dec.label))
    return rows


def _cell(c, i):
    return {"time": format_seconds(c.measured_s[i]) + (" (stalled)" if c.stalled[i] else ""),
            "median": format_seconds(c.median_s[i]),
            "tokens_s": format_number(1 / c.measured_s[i]) if c.measured_s[i] > 0 else "–",
            "held": format_bytes(c.held_bytes[i]), "limit": c.limit_text(i, c.measured_s)}


def section(m):
    """The Generation block of machine ``m``; None without decode curves."""
    if not (decode := m.decode):
        return None
    label = "context length n (one query against n keys)"
    crossovers = analysis.crossover_rows(decode)
    fits = [text for attention, expected in analysis.EXPECTED_DECODE_EXPONENT.items()
            if (text := analysis.exponent_range(attention, [
                c.time_fit for c in decode if c.attention == attention and not c.peer],
                expected))]
    summary = analysis.sentence(f"Generation, time per token against context length n (n ≥ "
                                f"{analysis.FIT_MIN_N}): ", fits) + analysis.sentence(
        "A linear-attention token is cheaper than a softmax one: ",
        [f"{r.label}: {r.crossover.describe()}" for r in analysis.headline(crossovers)])
    return {
        "time_png": figures.data_uri(figures.scaling_figure(
            [("time per generated token", decode)], "time", 1, xlabel=label)),
        "held_png": figures.data_uri(figures.scaling_figure(
            [("memory held between tokens, per head", decode)], "held", 1, xlabel=label)),
        "fits": decode, "crossovers": crossovers, "columns": [c.label for c in decode],
        "rows": analysis.rows_by_n(decode, _cell), "statistic": decode[0].statistic,
        "limits": any(np.isfinite(c.limit_s).any() for c in decode),
        "summary": summary + [text for text in [analysis.stalled_text(decode)] if text],
        "end_to_end": end_to_end(m.prefill, decode), "prompts": PROMPTS, "generated": GENERATED,
    }
