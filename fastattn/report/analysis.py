"""What several sections state, from results records only: labelled curves against ``n``
(``n_k``), exponent fits and crossovers, finished for figures and the page."""

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from scipy import stats

from ..bench.engine import roof_for
from ..bench.schema import CURVE_KEYS, DEFAULT_REGIME, point_key
from ..bench.table import (above_roof as _above_roof, format_limit, format_seconds, mask_name,
                           plural)

#: Scaling exponents are fitted on the points with ``n >= FIT_MIN_N``.
FIT_MIN_N = 1024


def split_records(records):
    """``environments, roofs, points``; a point re-measured (resumed run) keeps its last record."""
    environments, roofs, by_key = [], [], {}
    for record in records:
        kind = record.get("record")
        if kind == "environment":
            environments.append(record)
        elif kind == "roof":
            roofs.append(record)
        elif kind == "point":
            by_key[(record.get("machine"),) + point_key(record)] = record
    return environments, roofs, list(by_key.values())


#: The exponent each attention type should show on time (prefill; a decode token: 1 and 0).
EXPECTED_TIME_EXPONENT = {"softmax": 2, "linear": 1}
EXPECTED_DECODE_EXPONENT = {"softmax": 1, "linear": 0}
#: A fitted time exponent further than this from the expected one is flagged.
EXPONENT_SLACK = 0.35
#: Backends whose causal linear attention is the masked n x n form, so its time grows as n**2.
QUADRATIC_CAUSAL_LINEAR = ("reference",)


def expected_exponent(key):
    """The time exponent a curve of ``key`` should show (None for an unknown attention)."""
    attention = key.get("attention")
    if key.get("regime") == "decode":
        return EXPECTED_DECODE_EXPONENT.get(attention)
    if attention == "linear" and key.get("causal") and not key.get("peer") \
            and key.get("backend") in QUADRATIC_CAUSAL_LINEAR:
        return 2
    return EXPECTED_TIME_EXPONENT.get(attention)


@dataclass(frozen=True)
class Fit:
    """``y = exp(intercept) · n^slope`` fitted to ``points`` points in ``[n_min, n_max]``."""

    slope: float
    stderr: float
    intercept: float
    points: int
    n_min: int
    n_max: int

    def predict(self, n):
        return np.exp(self.intercept + self.slope * np.log(np.asarray(n, dtype=np.float64)))

    def format(self):
        """``"2.01 ± 0.03"``, or ``"2.01 (2 points)"`` when there is no spread (stderr NaN)."""
        if math.isnan(self.stderr):
            return f"{fixed(self.slope)} ({self.points} points)"
        return f"{fixed(self.slope)} ± {fixed(self.stderr)}"


def fixed(value, digits=2):
    """``value`` to ``digits`` decimals; ``-0.001`` is ``"0.00"``, not ``"-0.00"``."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text


def fit_exponent(n, y, min_n=FIT_MIN_N):
    """The :class:`Fit` of ``log y`` on ``log n`` (finite positive ``y``, ``n >= min_n``), or
    None with fewer than two distinct ``n``."""
    n, y = np.asarray(n, dtype=np.float64), np.asarray(y, dtype=np.float64)
    use = (n >= min_n) & np.isfinite(y) & (y > 0)
    x, t = np.log(n[use]), np.log(y[use])
    if len(np.unique(x)) < 2:
        return None
    fit = stats.linregress(x, t)
    return Fit(float(fit.slope), float("nan") if len(x) == 2 else float(fit.stderr),
               float(fit.intercept), len(x), round(math.exp(x.min())), round(math.exp(x.max())))


#: A point this many times slower than its curve's trend stalled on every repeat: it is kept
#: out of fits and crossovers, and the page names it.
STALL_FACTOR = 4.0


def stalled_points(n, t, factor=STALL_FACTOR):
    """True per point (``n`` ascending) over ``factor`` times slower than a larger n or the
    log-log line through its neighbours; never the largest n (a jump there may be real)."""
    n, t = np.asarray(n, dtype=np.float64), np.asarray(t, dtype=np.float64)
    out = np.zeros(len(n), dtype=bool)
    idx = np.flatnonzero(np.isfinite(t) & (t > 0) & (n > 0))
    x, y, limit = np.log(n[idx]), np.log(t[idx]), math.log(factor)
    for j, i in enumerate(idx):
        if j + 1 < len(idx) and y[j] - y[j + 1:].min() > limit:
            out[i] = True
        elif 0 < j < len(idx) - 1:
            line = y[j - 1] + (y[j + 1] - y[j - 1]) * (x[j] - x[j - 1]) / (x[j + 1] - x[j - 1])
            out[i] = bool(y[j] - line > limit)
    return out


def _column(name, q=None):
    """The points' ``name`` (NaN: not recorded), or the ``q``-th percentile of 2+ ``times_s``."""
    def value(p):
        times = [t for t in p.get("times_s") or () if t is not None] if q else ()
        if len(times) >= 2:
            return float(np.percentile(times, q))
        return float("nan") if p.get(name) is None else float(p[name])
    return cached_property(lambda self: np.array([value(p) for p in self.points]))


@dataclass
class Curve:
    """One configuration's (``key``: :data:`CURVE_KEYS`) point records by ``n``, their fields
    as arrays (NaN: not recorded); fits and crossovers use ``fit_s``: the fastest repeat (the
    median where asv kept none), stalled points NaN."""

    key: dict
    points: list
    label: str
    roof_fraction: np.ndarray

    attention = property(lambda self: self.key["attention"])
    backend = property(lambda self: self.key["backend"])
    causal = property(lambda self: bool(self.key["causal"]))
    machine = property(lambda self: self.key.get("machine"))
    peer = property(lambda self: any(bool(p.get("peer")) for p in self.points))
    n = cached_property(lambda self: np.array([p["n_k"] for p in self.points], dtype=np.int64))
    median_s, min_s, max_s = _column("median_s"), _column("min_s"), _column("max_s")
    gflops, peak_bytes, held_bytes = _column("gflops"), _column("peak_bytes"), _column("held_bytes")
    max_abs_err, load_avg = _column("max_abs_err"), _column("load_avg_1m")
    limit_s, limit_paired = _column("limit_s"), _column("limit_fraction_paired")
    limit = property(lambda self: [p.get("limit") for p in self.points])

    def limit_text(self, i, times=None):
        """``"92% peak"``, ``"97% floor (95%)"`` (paired in brackets; ``!`` above 100 %) of
        point ``i``, at ``times`` (default the median), or ``""``."""
        times = self.median_s if times is None else times
        return format_limit(float(self.limit_s[i] / times[i]), self.limit[i],
                            float(self.limit_paired[i]))
    statistic = property(lambda self: "min" if np.isfinite(self.min_s).all() else "median")
    measured_s = property(lambda self: self.min_s if self.statistic == "min" else self.median_s)
    stalled = cached_property(lambda self: stalled_points(self.n, self.measured_s))
    fit_s = property(lambda self: np.where(self.stalled, np.nan, self.measured_s))
    stalled_n = property(lambda self: [int(n) for n in self.n[self.stalled]])
    repeats = property(lambda self: np.array([len(p.get("times_s") or ()) for p in self.points]))
    q25_s, q75_s = _column("q25_s", 25), _column("q75_s", 75)   # else asv's quartiles
    memory_method = property(lambda self: {p["memory_method"] for p in self.points
                                           if p.get("memory_method")})
    check_failed = property(lambda self: [p["n_k"] for p in self.points
                                          if p.get("check_ok") is False])
    above_roof = property(lambda self: np.array(
        [_above_roof(f) for f in self.roof_fraction.tolist()], dtype=bool))
    time_fit = cached_property(lambda self: fit_exponent(self.n, self.fit_s))
    memory_fit = cached_property(lambda self: fit_exponent(self.n, self.peak_bytes))
    held_fit = cached_property(lambda self: fit_exponent(self.n, self.held_bytes))
    expected = property(lambda self: expected_exponent(self.key))

    def fit_text(self, which):
        """The ``"time"``, ``"memory"`` or ``"held"`` fit as the page shows it."""
        fit = getattr(self, f"{which}_fit")
        return fit.format() if fit else "–"

    @property
    def off(self):
        """True when the time exponent is over :data:`EXPONENT_SLACK` from the expected."""
        return bool(self.time_fit and self.expected is not None
                    and abs(self.time_fit.slope - self.expected) > EXPONENT_SLACK)


def _label(key, peer, keys):
    """Backend and attention, plus what tells it from ``keys`` of its attention, machine, regime."""
    same = [k for k in keys if all(k[f] == key[f] for f in ("attention", "machine", "regime"))]
    varying = [name for name in CURVE_KEYS[1:] if name not in ("attention", "backend", "causal")
               and len({k.get(name) for k in same}) > 1 and key.get(name) is not None]
    extra = ", ".join(f"{name}={key[name]}" for name in varying)
    return (f"{key['backend']} {key['attention']}" + (" (peer)" if peer else "")
            + (f" [{extra}]" if extra else ""))


def curves(points, roofs=()):
    """The ok ``points`` as labelled :class:`Curve` s in page order, matched to ``roofs``."""
    groups = {}
    for p in points:
        if p.get("status") == "ok" and p.get("median_s") is not None:
            groups.setdefault(tuple(p.get(k, DEFAULT_REGIME if k == "regime" else None)
                                    for k in CURVE_KEYS), []).append(p)
    keys = [dict(zip(CURVE_KEYS, key)) for key in groups]
    result = []
    for key, pts in zip(keys, groups.values()):
        pts.sort(key=lambda p: p["n_k"])
        roof = roof_for(roofs, key.get("dtype"), key.get("d_k") or 1, key.get("threads"),
                        key.get("machine"))
        fraction = [p.get("roof_fraction") or (p["gflops"] / roof if roof and p.get("gflops")
                                               else None) for p in pts]
        result.append(Curve(key, pts, _label(key, any(p.get("peer") for p in pts), keys),
                            np.array(fraction, dtype=float)))
    result.sort(key=lambda c: (str(c.machine), c.attention != "softmax", c.causal, c.peer,
                               str(c.backend), str(c.key.get("dtype"))))
    return result


@dataclass(frozen=True)
class Crossover:
    """Where linear attention becomes faster (``n``: only with status ``"crossover"``), the
    common range ``n_lo..n_hi`` and how often the order flips there."""

    n: float | None
    status: str
    n_lo: int | None
    n_hi: int | None
    crossings: int = 0

    def describe(self):
        if self.status == "no-common-range":
            return "no common range of n measured for both"
        if self.n_lo == self.n_hi:   # one n in common: a comparison there, not over a range
            which = ("linear faster" if self.status == "linear-faster-throughout"
                     else "softmax not slower")
            return (f"{which} at the only n measured for both (n = {self.n_lo}); no range "
                    "to cross over in")
        if self.status == "linear-faster-throughout":
            return f"linear faster over the whole common range (from n = {self.n_lo})"
        if self.status == "none-in-range":
            return f"none in range: softmax is not slower up to n = {self.n_hi}"
        text = f"n ≈ {self.n:,.0f}"
        if self.crossings > 1:
            text += f" (order flips {self.crossings} times; linear faster for every n above this)"
        return text


def crossover(n_softmax, t_softmax, n_linear, t_linear):
    """The :class:`Crossover` of two time curves: where, interpolated in log-log on their
    common range, ``log t_linear - log t_softmax`` last turns negative."""
    (ns, ts), (nl, tl) = _positive(n_softmax, t_softmax), _positive(n_linear, t_linear)
    if len(ns) == 0 or len(nl) == 0 or max(ns[0], nl[0]) > min(ns[-1], nl[-1]):
        return Crossover(None, "no-common-range", None, None)
    lo, hi = max(ns[0], nl[0]), min(ns[-1], nl[-1])
    grid = np.unique(np.concatenate([ns, nl]))
    x = np.log(grid[(grid >= lo) & (grid <= hi)])
    diff = np.interp(x, np.log(nl), np.log(tl)) - np.interp(x, np.log(ns), np.log(ts))
    faster = diff < 0  # linear faster
    crossings = int(np.count_nonzero(faster[1:] != faster[:-1]))
    lo, hi = int(lo), int(hi)
    if faster.all():
        return Crossover(None, "linear-faster-throughout", lo, hi, crossings)
    if not faster[-1]:
        return Crossover(None, "none-in-range", lo, hi, crossings)
    j = int(np.flatnonzero(~faster)[-1])  # last n where linear is not faster
    frac = diff[j] / (diff[j] - diff[j + 1])
    n_cross = float(np.exp(x[j] + frac * (x[j + 1] - x[j])))
    return Crossover(n_cross, "crossover", lo, hi, crossings)


def _positive(n, t):
    n, t = np.asarray(n, dtype=np.float64), np.asarray(t, dtype=np.float64)
    use = np.isfinite(t) & (t > 0) & (n > 0)
    order = np.argsort(n[use])
    return n[use][order], t[use][order]


def rows_by_n(curve_list, cell):
    """A row ``{"n", "cells"}`` per n measured: ``cell(curve, index)`` per curve, or None."""
    rows = []
    for n in sorted({int(n) for c in curve_list for n in c.n}):
        at = [(np.flatnonzero(c.n == n).tolist() or [None])[0] for c in curve_list]
        rows.append({"n": n, "cells": [None if i is None else cell(c, i)
                                       for c, i in zip(curve_list, at)]})
    return rows


def fastest_at(curve_list, n):
    """``(seconds, curve)`` of the smallest finite ``fit_s`` at ``n``, or ``(None, None)``."""
    return min(((float(c.fit_s[c.n == n][0]), c) for c in curve_list if (c.n == n).any()
                and math.isfinite(c.fit_s[c.n == n][0])), key=lambda tc: tc[0],
               default=(None, None))


def envelope(curve_list):
    """``n, seconds``: every ``n`` measured and the smallest ``fit_s`` there."""
    best = {}
    for c in curve_list:
        for n, t in zip(c.n.tolist(), c.fit_s.tolist()):
            if math.isfinite(t) and t > 0 and (n not in best or t < best[n]):
                best[n] = t
    ns = sorted(best)
    return np.array(ns, dtype=np.int64), np.array([best[n] for n in ns])


def stalled_text(curve_list):
    """A sentence naming the stalled points of ``curve_list`` (None: there are none)."""
    named = [f"{c.label} ({'causal' if c.causal else 'non-causal'}) at n = "
             + ", ".join(f"{n} ({format_seconds(t)})" for n, t in
                         zip(c.n[c.stalled].tolist(), c.measured_s[c.stalled].tolist()))
             for c in curve_list if c.stalled.any()]
    if not named:
        return None
    return ("Kept out of the fits and crossovers: a point whose every repeat is more than "
            f"{STALL_FACTOR:g}× slower than its curve's trend (the line through its neighbours, "
            "or a larger n's time) stalled rather than measured the kernel; it is still shown, "
            "and re-measuring it (fastattn bench) is the remedy: " + "; ".join(named) + ".")


def sentence(opening, parts):
    """``[opening + "a; b."]`` of the ``parts``, or ``[]`` without any."""
    return [opening + "; ".join(parts) + "."] if parts else []


def exponent_range(attention, fits, expected):
    """``"<attention> lo to hi over N curves (expected about <expected>)"``, or None; fits of
    two points only when no curve has more, and said to be few."""
    fits = [f for f in fits if f]
    fits = [f for f in fits if f.points >= 3] or fits
    if not fits:
        return None
    lo, hi = fixed(min(f.slope for f in fits)), fixed(max(f.slope for f in fits))
    few = max(f.points for f in fits) < 3
    return (f"{attention} {lo if lo == hi else f'{lo} to {hi}'} over {plural(len(fits), 'curve')}"
            f" (expected about {expected})"
            + (", each fitted to 2 points only: too few to judge" if few else ""))


@dataclass(frozen=True)
class CrossoverRow:
    """A crossover of ``kind`` ``"backend"`` (one backend's two curves), ``"fastattn"``
    (fastest fastattn kernel of each type) or ``"all"`` (peers included)."""

    causal: bool
    kind: str
    label: str
    crossover: Crossover
    peer: bool = False

    mask = property(lambda self: mask_name(self.causal))
    compared = property(lambda self: f"{self.label}: softmax vs linear")
    length = property(lambda self: self.crossover.describe())


def crossover_rows(curve_list):
    """Crossovers of each backend, and of the fastest of each type (lower envelopes, with two
    backends or more), within one mask, dtype and thread count."""
    def setting(c):
        return c.causal, str(c.key.get("dtype")), str(c.key.get("threads"))
    settings = sorted({setting(c) for c in curve_list})
    several = len({s[1:] for s in settings}) > 1
    rows = []
    for causal, dtype, threads in settings:
        same = [c for c in curve_list if setting(c) == (causal, dtype, threads)]
        suffix = f" [{dtype}, {threads} threads]" if several else ""
        soft, lin = ({c.backend: c for c in same if c.attention == a}
                     for a in ("softmax", "linear"))
        rows += [CrossoverRow(causal, "backend", f"{b}{' (peer)' if s.peer else ''}{suffix}",
                              crossover(s.n, s.fit_s, lin[b].n, lin[b].fit_s), s.peer)
                 for b, s in soft.items() if b in lin]
        peers = any(c.peer for c in same)
        for kind, label, pool in (("fastattn", "fastest fastattn kernel of each type",
                                   [c for c in same if not c.peer]),
                                  ("all", "fastest of all, peers included", same if peers else [])):
            s_list, l_list = ([c for c in pool if c.attention == a] for a in ("softmax", "linear"))
            if len({c.backend for c in pool}) >= 2 and s_list and l_list:
                rows.append(CrossoverRow(causal, kind, label + suffix,
                                         crossover(*envelope(s_list), *envelope(l_list))))
    return rows


def headline(rows):
    """The crossovers a summary quotes: the fastest fastattn kernels', else each backend's."""
    return [r for r in rows if r.kind == "fastattn"] or [
        r for r in rows if r.kind == "backend" and not r.peer]


@dataclass
class Machine:
    """One machine's environment (``{}`` if none), its points and :class:`Curve` s, all roofs."""

    name: str | None
    env: dict
    roofs: list
    points: list
    curves: list

    prefill = cached_property(lambda self: [c for c in self.curves
                                            if c.key.get("regime") != "decode"])
    decode = cached_property(lambda self: [c for c in self.curves
                                           if c.key.get("regime") == "decode"])
    scaling_curves = cached_property(lambda self: [c for c in self.prefill if len(c.n) >= 3])
    short_curves = cached_property(lambda self: [c for c in self.prefill if len(c.n) < 3])

    @cached_property
    def panels(self):
        """``(title, curves)`` per mask of the scaling curves."""
        panels = [(mask_name(causal), [c for c in self.scaling_curves if c.causal == causal])
                  for causal in (False, True)]
        return [p for p in panels if p[1]] or [("no measured points", [])]
