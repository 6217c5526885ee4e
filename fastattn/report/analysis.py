"""Numbers a scaling report states, computed from results records only.

Nothing here times anything: it groups point records (see
:mod:`fastattn.bench.results`) into curves of time, memory and GFLOP/s
against the sequence length ``n`` (``n_q = n_k = n``), fits scaling
exponents, finds where linear attention overtakes softmax attention, and
picks the GEMM roof a curve is compared with.
"""

import math
from dataclasses import dataclass, field

import numpy as np

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


@dataclass
class Curve:
    """One backend's measurements of one configuration, ordered by ``n``.

    Attributes
    ----------
    key : dict
        The :data:`CURVE_KEYS` values shared by every point of the curve.
    peer : bool
        True for a peer implementation (such as torch), not one of fastattn's.
    n : ndarray of int64, shape (m,)
        Sequence lengths, increasing.
    median_s, min_s, max_s : ndarray of float64, shape (m,)
        Seconds per call: median, fastest and slowest repeat.
    repeats : ndarray of int64, shape (m,)
        Number of timed repeats behind each median.
    gflops : ndarray of float64, shape (m,)
        Achieved GFLOP/s at the median time (NaN when not recorded).
    peak_bytes : ndarray of float64, shape (m,)
        Peak extra bytes of one call (NaN when not measured).
    memory_method : set of str
        How memory was measured (``"rss"``, ``"tracemalloc"``, ...).
    max_abs_err : ndarray of float64, shape (m,)
        Largest absolute error against the float64 reference (NaN when not checked).
    roof_fraction : ndarray of float64, shape (m,)
        Achieved GFLOP/s over the GEMM roof the sweep matched to the point (NaN
        when not recorded).
    check_failed : list of int
        The ``n`` whose output disagreed with the reference (``check_ok`` False).
    load_avg : ndarray of float64, shape (m,)
        The machine's 1-minute load average when each point was measured.
    """

    key: dict
    peer: bool
    n: np.ndarray
    median_s: np.ndarray
    min_s: np.ndarray
    max_s: np.ndarray
    repeats: np.ndarray
    gflops: np.ndarray
    peak_bytes: np.ndarray
    memory_method: set = field(default_factory=set)
    max_abs_err: np.ndarray = None
    roof_fraction: np.ndarray = None
    check_failed: list = field(default_factory=list)
    load_avg: np.ndarray = None
    display: str = ""    # label shown in figures and tables, set by the report

    @property
    def attention(self):
        return self.key["attention"]

    @property
    def backend(self):
        return self.key["backend"]

    @property
    def causal(self):
        return bool(self.key["causal"])

    @property
    def machine(self):
        return self.key.get("machine")

    @property
    def label(self):
        """``"<backend> <attention>"``, with ``(peer)`` for a peer."""
        return f"{self.backend} {self.attention}" + (" (peer)" if self.peer else "")


def _float(value):
    return float("nan") if value is None else float(value)


def curves(points):
    """Group point records with status ``"ok"`` and ``n_q == n_k`` into curves.

    Parameters
    ----------
    points : list of dict
        Point records (deduplicated, see :func:`split_records`).

    Returns
    -------
    list of Curve
        Sorted by machine, attention, causal, backend (fastattn's before peers).
    """
    groups = {}
    for p in points:
        if p.get("status") != "ok" or p.get("median_s") is None or p.get("n_q") != p.get("n_k"):
            continue
        key = tuple(p.get(k) for k in CURVE_KEYS)
        groups.setdefault(key, []).append(p)
    result = []
    for key, pts in groups.items():
        pts.sort(key=lambda p: p["n_q"])
        times = [p.get("times_s") or [] for p in pts]
        result.append(Curve(
            key=dict(zip(CURVE_KEYS, key)),
            peer=any(bool(p.get("peer")) for p in pts),
            n=np.array([p["n_q"] for p in pts], dtype=np.int64),
            median_s=np.array([_float(p["median_s"]) for p in pts]),
            min_s=np.array([_float(p.get("min_s", p["median_s"])) for p in pts]),
            max_s=np.array([_float(p.get("max_s", p["median_s"])) for p in pts]),
            repeats=np.array([len(t) for t in times], dtype=np.int64),
            gflops=np.array([_float(p.get("gflops")) for p in pts]),
            peak_bytes=np.array([_float(p.get("peak_bytes")) for p in pts]),
            memory_method={p["memory_method"] for p in pts if p.get("memory_method")},
            max_abs_err=np.array([_float(p.get("max_abs_err")) for p in pts]),
            roof_fraction=np.array([_float(p.get("roof_fraction")) for p in pts]),
            check_failed=[p["n_q"] for p in pts if p.get("check_ok") is False],
            load_avg=np.array([_float(p.get("load_avg_1m")) for p in pts]),
        ))
    result.sort(key=lambda c: (str(c.machine), c.attention != "softmax", c.causal, c.peer,
                               str(c.backend), str(c.key.get("dtype"))))
    return result


@dataclass(frozen=True)
class Fit:
    """Least-squares power law ``y = c · n^slope`` fitted in log-log space.

    Attributes
    ----------
    slope : float
        The scaling exponent.
    stderr : float
        Standard error of the slope, ``sqrt(s² / Σ(x - x̄)²)`` with
        ``s² = Σ residual² / (m - 2)``, ``x = log n``; NaN for two points
        (a line through two points has no spread).
    intercept : float
        ``log c`` (natural log).
    points : int
        Number of points fitted (``m``).
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
    n : array-like of shape (m,)
        Sequence lengths.
    y : array-like of shape (m,)
        Positive values (seconds, bytes); NaN or non-positive values are left out.
    min_n : int, default :data:`FIT_MIN_N`
        Only points with ``n >= min_n`` are fitted, where the leading term
        dominates the constant costs of a call.

    Returns
    -------
    Fit or None
        None when fewer than two usable points with distinct ``n`` remain.

    Notes
    -----
    Ordinary least squares on ``(log n, log y)``: ``O(m)``.
    """
    n = np.asarray(n, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    use = (n >= min_n) & np.isfinite(y) & (y > 0)
    x, t = np.log(n[use]), np.log(y[use])
    if len(np.unique(x)) < 2:
        return None
    xm = x.mean()
    sxx = float(np.sum((x - xm) ** 2))
    slope = float(np.sum((x - xm) * (t - t.mean())) / sxx)
    intercept = float(t.mean() - slope * xm)
    m = len(x)
    if m > 2:
        resid = t - (intercept + slope * x)
        stderr = math.sqrt(float(np.sum(resid ** 2)) / (m - 2) / sxx)
    else:
        stderr = float("nan")
    return Fit(slope, stderr, intercept, m, int(round(math.exp(x.min()))),
               int(round(math.exp(x.max()))))


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


def _is_gemm(roof):
    return str(roof.get("probe", roof.get("kind", "gemm"))).lower() == "gemm"


def _roof_matches(roof, dtype, threads, machine):
    return (_is_gemm(roof) and roof.get("gflops") is not None and roof.get("dtype") == dtype
            and roof.get("threads") == threads
            and (machine is None or roof.get("machine") in (None, machine)))


def roof_gflops(roofs, dtype, threads, machine=None):
    """The best GEMM roof (GFLOP/s) measured for ``dtype`` on ``threads`` threads.

    Parameters
    ----------
    roofs : list of dict
        Roof records (``probe`` "gemm" or "exp", ``dtype``, ``threads``,
        ``gflops``, ``shape`` ``[n, d, n]``; ``machine`` for asv results).
        Records that are not GEMM probes (the exp throughput) are ignored.
    dtype : str
    threads : int or None
    machine : str, optional
        Only roofs of this machine (asv results).

    Returns
    -------
    (float, dict) or (None, None)
        The largest GFLOP/s and its record; None when no roof matches.
    """
    best = (None, None)
    for roof in roofs:
        if _roof_matches(roof, dtype, threads, machine):
            if best[0] is None or roof["gflops"] > best[0]:
                best = (float(roof["gflops"]), roof)
    return best


def roof_curve(roofs, dtype, threads, d=None, machine=None):
    """The GEMM roof against n: GFLOP/s of ``(n, d) @ (d, n)`` at each probed n.

    Parameters
    ----------
    roofs : list of dict
        Roof records (see :func:`roof_gflops`).
    dtype : str
    threads : int or None
    d : int, optional
        Only probes of this inner dimension (``shape[1]``).
    machine : str, optional

    Returns
    -------
    n, gflops : ndarray of shape (m,)
        Sorted by n; several probes at one n keep the best.  Empty when no
        probe matches.
    """
    best = {}
    for roof in roofs:
        if not _roof_matches(roof, dtype, threads, machine):
            continue
        shape = roof.get("shape") or []
        if len(shape) < 2 or (d is not None and shape[1] != d):
            continue
        n = int(shape[0])
        best[n] = max(best.get(n, 0.0), float(roof["gflops"]))
    ns = sorted(best)
    return np.array(ns, dtype=np.int64), np.array([best[n] for n in ns])


def envelope(curve_list):
    """The lower envelope of several time curves: the fastest median at each ``n``.

    Parameters
    ----------
    curve_list : list of Curve

    Returns
    -------
    n, median_s : ndarray of shape (m,)
        Every ``n`` any curve measured, and the smallest median there.
    """
    best = {}
    for c in curve_list:
        for n, t in zip(c.n.tolist(), c.median_s.tolist()):
            if math.isfinite(t) and t > 0 and (n not in best or t < best[n]):
                best[n] = t
    ns = sorted(best)
    return np.array(ns, dtype=np.int64), np.array([best[n] for n in ns])
