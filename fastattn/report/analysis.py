"""Numbers a scaling report states, computed from results records only.

Nothing here times anything: it groups point records (see
:mod:`fastattn.bench.results`) into curves of time, memory and GFLOP/s
against the sequence length ``n`` (``n_k``; ``n_q = n_k`` when prefilling),
fits scaling exponents, finds where linear attention overtakes softmax
attention, and matches each curve to its GEMM roof.  What it returns is final
and labelled: figures draw it and the page shows it, and neither changes it.
"""

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from ..bench.engine import roof_for
from ..bench.results import POINT_KEYS, point_key

#: The keys that identify one curve: a point's identity without ``n_q``/``n_k``,
#: plus the machine (set for asv results, absent for a sweep on this machine).
CURVE_KEYS = ("machine",) + tuple(k for k in POINT_KEYS if k not in ("n_q", "n_k"))

#: Scaling exponents are fitted on the points with ``n >= FIT_MIN_N``.
FIT_MIN_N = 1024


def split_records(records):
    """Separate records by type.

    Parameters
    ----------
    records : list of dict
        As read by :func:`fastattn.bench.results.read_records`.

    Returns
    -------
    environments, roofs, points : list of dict
        ``points`` keeps only the last record of each point identity (a resumed
        run re-measures a point that had failed; the later record is the
        answer).  Identity is :func:`~fastattn.bench.results.point_key` plus
        ``machine``.
    """
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


#: The statistic fits and crossovers use: the fastest repeat.  Other work on
#: the machine only ever slows a call down, so the minimum is the least
#: dragged by load (as :mod:`timeit` advises); the median is shown beside it.
FIT_STATISTIC = "min"

#: The exponent each attention type should show on time.
EXPECTED_TIME_EXPONENT = {"softmax": 2, "linear": 1}
#: A fitted time exponent further than this from the expected one is flagged.
EXPONENT_SLACK = 0.35


@dataclass(frozen=True)
class Fit:
    """Least-squares power law ``y = c · n^slope`` fitted in log-log space.

    Attributes
    ----------
    slope : float
        The scaling exponent.
    stderr : float
        Standard error of the slope (:func:`scipy.stats.linregress`); NaN for
        two points (a line through two points has no spread).
    intercept : float
        ``log c`` (natural log).
    points : int
        Number of points fitted.
    n_min, n_max : int
        The range of ``n`` fitted.
    """

    slope: float
    stderr: float
    intercept: float
    points: int
    n_min: int
    n_max: int

    def predict(self, n):
        """``c · n^slope`` at ``n`` (array-like)."""
        return np.exp(self.intercept + self.slope * np.log(np.asarray(n, dtype=np.float64)))

    def format(self):
        """``"2.01 ± 0.03"`` (``"2.01 (2 points)"`` when there is no spread)."""
        if math.isnan(self.stderr):
            return f"{self.slope:.2f} ({self.points} points)"
        return f"{self.slope:.2f} ± {self.stderr:.2f}"


def fit_exponent(n, y, min_n=FIT_MIN_N):
    """Scaling exponent of ``y`` against ``n``: least-squares slope of ``log y`` on ``log n``.

    Parameters
    ----------
    n, y : array-like of shape (m,)
        Sequence lengths and positive values (seconds, bytes); NaN or
        non-positive values are left out.
    min_n : int, default :data:`FIT_MIN_N`
        Only points with ``n >= min_n`` are fitted, where the leading term
        dominates the constant costs of a call.

    Returns
    -------
    Fit or None
        None when fewer than two usable points with distinct ``n`` remain.
    """
    n, y = np.asarray(n, dtype=np.float64), np.asarray(y, dtype=np.float64)
    use = (n >= min_n) & np.isfinite(y) & (y > 0)
    x, t = np.log(n[use]), np.log(y[use])
    if len(np.unique(x)) < 2:
        return None
    if len(x) == 2:
        slope = float((t[1] - t[0]) / (x[1] - x[0]))
        intercept, stderr = float(t[0] - slope * x[0]), float("nan")
    else:
        fit = stats.linregress(x, t)
        slope, intercept, stderr = float(fit.slope), float(fit.intercept), float(fit.stderr)
    return Fit(slope, stderr, intercept, len(x), int(round(math.exp(x.min()))),
               int(round(math.exp(x.max()))))


@dataclass
class Curve:
    """One backend's measurements of one configuration, ordered by ``n``: final, labelled.

    Attributes
    ----------
    key : dict
        The :data:`CURVE_KEYS` values shared by every point of the curve.
    peer : bool
        True for a peer implementation (such as torch).
    label : str
        ``"<backend> <attention>"``, ``" (peer)"`` for a peer and, in brackets,
        the settings that tell it apart from the other curves of its machine.
    n : ndarray of int64, shape (m,)
    median_s, min_s, max_s : ndarray of float64, shape (m,)
        Seconds per call: median, fastest and slowest repeat (NaN: not kept).
    fit_s : ndarray of float64, shape (m,)
        The seconds fits and crossovers use (:attr:`statistic`).
    statistic : str
        ``"min"`` (:data:`FIT_STATISTIC`), or ``"median"`` where the repeats
        were not kept (asv without samples).
    repeats : ndarray of int64, shape (m,)
        Timed repeats behind each point (0: not recorded).
    gflops, roof_fraction, peak_bytes, max_abs_err, load_avg : ndarray of float64
        GFLOP/s at the median, its fraction of the roof, peak extra bytes of
        one call, error against the float64 reference, the 1-minute load
        average while measuring (NaN when not recorded).
    memory_method : set of str
    check_failed : list of int
        The ``n`` whose output disagreed with the reference.
    time_fit, memory_fit : Fit or None
    """

    key: dict
    peer: bool
    label: str
    n: np.ndarray
    median_s: np.ndarray
    min_s: np.ndarray
    max_s: np.ndarray
    fit_s: np.ndarray
    statistic: str
    repeats: np.ndarray
    gflops: np.ndarray
    roof_fraction: np.ndarray
    peak_bytes: np.ndarray
    max_abs_err: np.ndarray
    load_avg: np.ndarray
    memory_method: set = field(default_factory=set)
    check_failed: list = field(default_factory=list)
    time_fit: Fit = None
    memory_fit: Fit = None

    attention = property(lambda self: self.key["attention"])
    backend = property(lambda self: self.key["backend"])
    causal = property(lambda self: bool(self.key["causal"]))
    machine = property(lambda self: self.key.get("machine"))

    @property
    def off(self):
        """True when the time exponent is further than :data:`EXPONENT_SLACK` from the expected."""
        expected = EXPECTED_TIME_EXPONENT.get(self.attention)
        return bool(self.time_fit and expected is not None
                    and abs(self.time_fit.slope - expected) > EXPONENT_SLACK)


def _column(points, name, default=None):
    return np.array([float("nan") if p.get(name, default) is None else float(p.get(name, default))
                     for p in points])


def _labels(keys, peers):
    """Each curve's label: backend and attention, plus what varies between curves of one type."""
    out = []
    for key, peer in zip(keys, peers):
        same = [k for k in keys if k["attention"] == key["attention"]]
        varying = [name for name in ("dtype", "threads", "d_k", "d_v", "batch", "heads",
                                     "feature_map", "num_features", "regime")
                   if len({k.get(name) for k in same}) > 1 and key.get(name) is not None]
        extra = ", ".join(f"{name}={key[name]}" for name in varying)
        out.append(f"{key['backend']} {key['attention']}" + (" (peer)" if peer else "")
                   + (f" [{extra}]" if extra else ""))
    return out


def curves(points, roofs=()):
    """Group point records with status ``"ok"`` into labelled curves with their fits.

    Parameters
    ----------
    points : list of dict
        Point records (deduplicated, see :func:`split_records`).
    roofs : list of dict
        Roof records: a point without ``roof_fraction`` is matched to them by
        :func:`fastattn.bench.engine.roof_for`.

    Returns
    -------
    list of Curve
        Sorted by machine, attention, causal, backend (fastattn's before peers).
    """
    groups = {}
    for p in points:
        if p.get("status") == "ok" and p.get("median_s") is not None:
            groups.setdefault(tuple(p.get(k) for k in CURVE_KEYS), []).append(p)
    keys = [dict(zip(CURVE_KEYS, key)) for key in groups]
    peers = [any(bool(p.get("peer")) for p in pts) for pts in groups.values()]
    by_machine = {}
    for key, peer in zip(keys, peers):
        by_machine.setdefault(key.get("machine"), []).append((key, peer))
    label_of = {}
    for pairs in by_machine.values():
        for (key, _), label in zip(pairs, _labels(*zip(*pairs))):
            label_of[id(key)] = label
    result = []
    for key, peer, pts in zip(keys, peers, groups.values()):
        pts.sort(key=lambda p: p["n_k"])
        roof = roof_for(roofs, key.get("dtype"), key.get("d_k") or 1, key.get("threads"),
                        key.get("machine"))
        fraction = [p.get("roof_fraction") or (p["gflops"] / roof if roof and p.get("gflops")
                                               else None) for p in pts]
        min_s = _column(pts, "min_s")
        statistic = FIT_STATISTIC if np.isfinite(min_s).all() else "median"
        curve = Curve(
            key=key, peer=peer, label=label_of[id(key)],
            n=np.array([p["n_k"] for p in pts], dtype=np.int64),
            median_s=_column(pts, "median_s"), min_s=min_s, max_s=_column(pts, "max_s"),
            fit_s=min_s if statistic == "min" else _column(pts, "median_s"),
            statistic=statistic,
            repeats=np.array([len(p.get("times_s") or ()) for p in pts], dtype=np.int64),
            gflops=_column(pts, "gflops"), roof_fraction=np.array(fraction, dtype=float),
            peak_bytes=_column(pts, "peak_bytes"), max_abs_err=_column(pts, "max_abs_err"),
            load_avg=_column(pts, "load_avg_1m"),
            memory_method={p["memory_method"] for p in pts if p.get("memory_method")},
            check_failed=[p["n_k"] for p in pts if p.get("check_ok") is False])
        curve.time_fit = fit_exponent(curve.n, curve.fit_s)
        curve.memory_fit = fit_exponent(curve.n, curve.peak_bytes)
        result.append(curve)
    result.sort(key=lambda c: (str(c.machine), c.attention != "softmax", c.causal, c.peer,
                               str(c.backend), str(c.key.get("dtype"))))
    return result


@dataclass(frozen=True)
class Crossover:
    """Where linear attention becomes faster than softmax attention.

    Attributes
    ----------
    n : float or None
        The interpolated crossover length, beyond which linear attention stays
        faster over the measured range; None when there is none in range.
    status : str
        ``"crossover"``, ``"linear-faster-throughout"`` (faster already at the
        smallest common ``n``), ``"none-in-range"`` (softmax faster, or not
        slower, at the largest common ``n``) or ``"no-common-range"``.
    n_lo, n_hi : int or None
        The common range of ``n`` both curves cover.
    crossings : int
        How many times the ordering flips in that range (more than one means
        the curves are close and the timings noisy).
    """

    n: float | None
    status: str
    n_lo: int | None
    n_hi: int | None
    crossings: int = 0

    def describe(self):
        """A sentence for the report."""
        if self.status == "no-common-range":
            return "no common range of n measured for both"
        if self.status == "linear-faster-throughout":
            return f"linear faster over the whole common range (from n = {self.n_lo})"
        if self.status == "none-in-range":
            return f"none in range: softmax is not slower up to n = {self.n_hi}"
        text = f"n ≈ {self.n:,.0f}"
        if self.crossings > 1:
            text += f" (order flips {self.crossings} times; linear faster for every n above this)"
        return text


def crossover(n_softmax, t_softmax, n_linear, t_linear):
    """The sequence length where linear attention overtakes softmax attention.

    Both time curves are interpolated linearly in ``(log n, log t)`` onto the
    union of their ``n`` within the range both cover; the crossover is where
    ``log t_linear - log t_softmax`` last changes sign from ``>= 0`` to ``< 0``,
    located by linear interpolation in ``log n``.

    Parameters
    ----------
    n_softmax, t_softmax : array-like of shape (m,)
        Softmax attention: sequence lengths (increasing) and seconds.
    n_linear, t_linear : array-like of shape (p,)
        Linear attention, likewise.

    Returns
    -------
    Crossover
    """
    ns, ts = _positive(n_softmax, t_softmax)
    nl, tl = _positive(n_linear, t_linear)
    if len(ns) == 0 or len(nl) == 0:
        return Crossover(None, "no-common-range", None, None)
    lo, hi = max(ns[0], nl[0]), min(ns[-1], nl[-1])
    if lo > hi:
        return Crossover(None, "no-common-range", None, None)
    grid = np.unique(np.concatenate([ns, nl]))
    grid = grid[(grid >= lo) & (grid <= hi)]
    x = np.log(grid)
    diff = (np.interp(x, np.log(nl), np.log(tl)) - np.interp(x, np.log(ns), np.log(ts)))
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
    n = np.asarray(n, dtype=np.float64)
    t = np.asarray(t, dtype=np.float64)
    use = np.isfinite(t) & (t > 0) & (n > 0)
    order = np.argsort(n[use])
    return n[use][order], t[use][order]


def envelope(curve_list):
    """The lower envelope of several time curves: the fastest at each ``n`` (by ``fit_s``).

    Parameters
    ----------
    curve_list : list of Curve

    Returns
    -------
    n, median_s : ndarray of shape (m,)
        Every ``n`` any curve measured, and the smallest time there.
    """
    best = {}
    for c in curve_list:
        for n, t in zip(c.n.tolist(), c.fit_s.tolist()):
            if math.isfinite(t) and t > 0 and (n not in best or t < best[n]):
                best[n] = t
    ns = sorted(best)
    return np.array(ns, dtype=np.int64), np.array([best[n] for n in ns])


def roof_curve(roofs, dtype, threads, d=None, machine=None):
    """The GEMM roof against n: the best GFLOP/s of ``(n, d) @ (d, n)`` at each probed n.

    Returns
    -------
    n, gflops : ndarray of shape (m,)
        Sorted by n; empty when no probe matches.
    """
    best = {}
    for r in roofs:
        shape = r.get("shape") or ()
        if (r.get("probe", "gemm") == "gemm" and r.get("gflops") and r.get("dtype") == dtype
                and r.get("threads") == threads and len(shape) == 3
                and (d is None or shape[1] == d)
                and (machine is None or r.get("machine") in (None, machine))):
            best[shape[0]] = max(best.get(shape[0], 0.0), float(r["gflops"]))
    ns = sorted(best)
    return np.array(ns, dtype=np.int64), np.array([best[n] for n in ns])


@dataclass(frozen=True)
class CrossoverRow:
    """A crossover of the report: which curves, of which mask, and where.

    ``kind`` is ``"backend"`` (one backend's softmax and linear curves),
    ``"fastattn"`` (the fastest fastattn kernel of each type) or ``"all"``
    (peers included); ``label`` names the pair for the page.
    """

    causal: bool
    kind: str
    label: str
    crossover: Crossover


def crossover_rows(curve_list):
    """Crossovers of each backend, and of the fastest of each type, within one dtype and threads.

    Curves are compared by :attr:`Curve.fit_s`; the "fastest" rows (lower
    envelope over backends) appear when at least two backends measured.
    """
    rows = []
    settings = sorted({(c.causal, str(c.key.get("dtype")), str(c.key.get("threads")))
                       for c in curve_list})
    several = len({s[1:] for s in settings}) > 1
    for causal, dtype, threads in settings:
        same = [c for c in curve_list if (c.causal, str(c.key.get("dtype")),
                                          str(c.key.get("threads"))) == (causal, dtype, threads)]
        suffix = f" [{dtype}, {threads} threads]" if several else ""
        soft = {c.backend: c for c in same if c.attention == "softmax"}
        lin = {c.backend: c for c in same if c.attention == "linear"}
        for backend in (b for b in soft if b in lin):
            s, l_ = soft[backend], lin[backend]
            rows.append(CrossoverRow(causal, "backend",
                                     f"{backend}{' (peer)' if s.peer else ''}{suffix}",
                                     crossover(s.n, s.fit_s, l_.n, l_.fit_s)))
        for kind, pool in (("fastattn", [c for c in same if not c.peer]), ("all", same)):
            if kind == "all" and not any(c.peer for c in same):
                continue
            s_list = [c for c in pool if c.attention == "softmax"]
            l_list = [c for c in pool if c.attention == "linear"]
            if len({c.backend for c in pool}) < 2 or not s_list or not l_list:
                continue
            label = ("fastest fastattn kernel of each type" if kind == "fastattn"
                     else "fastest of all, peers included")
            rows.append(CrossoverRow(causal, kind, label + suffix,
                                     crossover(*envelope(s_list), *envelope(l_list))))
    return rows
