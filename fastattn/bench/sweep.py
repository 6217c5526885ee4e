"""The sweep: measure a grid of points, one results record per point as it finishes.

:func:`run_sweep` is what ``fastattn bench`` and ``fastattn report`` run::

    from fastattn.bench.sweep import default_grid, run_sweep
    records = run_sweep(default_grid(), "results/run.jsonl", threads=2)

It appends to a JSON-lines results file (:mod:`fastattn.bench.results`): an
``environment`` record and the ``roof`` records of this run first, then one
``point`` record per point.  Every record is flushed and fsynced as written,
so an interrupted sweep keeps every finished point and the next run with the
same file resumes where it stopped.  A file that is not a fastattn results
file is refused and left untouched.

Measurement happens in one worker process (started with ``spawn``), so the
memory probe sees the call and not the interpreter, and so a kernel that
crashes or is killed (out of memory) costs one point, not the sweep: the
point is recorded as an error and a new worker takes over.
"""

import multiprocessing
import os
import signal
import time
import uuid
from dataclasses import asdict, dataclass

from .. import _api
from .._threads import default_num_threads
from . import peers
from .results import POINT_KEYS, ResultsWriter, point_key

ATTENTIONS = ("softmax", "linear")
DTYPES = ("float32", "float64")

#: n of the default grid: 128 to 8192 (the report's scaling range).
DEFAULT_NS = (128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class Point:
    """One measurement: an attention call of one shape on one backend.

    ``n_q = n_k = n``; inputs are ``(batch * heads, n, d)`` seeded Gaussians.
    ``feature_map`` is normalised to ``"elu"`` for linear attention when not
    given and must be None for softmax attention.
    """

    attention: str            # "softmax" | "linear"
    backend: str              # a fastattn backend or a peer ("torch")
    causal: bool
    n: int                    # n_q = n_k = n
    d_k: int = 64
    d_v: int = 64
    batch: int = 1
    heads: int = 1
    dtype: str = "float32"
    feature_map: str | None = None   # "elu" default for linear, None for softmax

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend must be a backend or peer name, got {self.backend!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be True or False, got {self.causal!r}")
        for name in ("n", "d_k", "d_v", "batch", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention == "softmax" and self.feature_map is not None:
            raise ValueError("feature_map applies to linear attention only; use None for softmax")
        if self.attention == "linear":
            fmap = self.feature_map or "elu"
            if fmap not in ("elu", "relu"):
                raise ValueError(f"feature_map must be 'elu' or 'relu', got {fmap!r}")
            object.__setattr__(self, "feature_map", fmap)

    @property
    def peer(self):
        """True for a peer (e.g. "torch"), False for a fastattn backend."""
        return self.backend in peers.PEERS

    def record_fields(self, threads):
        """The identifying fields of this point's record (:data:`POINT_KEYS` and more)."""
        fields_ = {
            "attention": self.attention, "backend": self.backend, "peer": self.peer,
            "causal": self.causal, "dtype": self.dtype, "batch": self.batch,
            "heads": self.heads, "n_q": self.n, "n_k": self.n, "d_k": self.d_k,
            "d_v": self.d_v, "feature_map": self.feature_map, "threads": int(threads),
        }
        assert set(POINT_KEYS) <= set(fields_)
        return fields_

    def label(self):
        """Short text naming the point, e.g. ``softmax causal n=1024 d=64 float32 numba``."""
        mask = "causal" if self.causal else "full"
        d = f"d={self.d_k}" if self.d_k == self.d_v else f"d_k={self.d_k} d_v={self.d_v}"
        return f"{self.attention} {mask} n={self.n} {d} {self.dtype} {self.backend}"


def default_backends(peers_too=True):
    """Every fastattn backend that runs here, then the installed peers."""
    names = list(_api.available_backends())
    names.sort(key=lambda b: b != "reference")  # the reference first, as in every table
    if peers_too:
        names += list(peers.available_peers())
    return names


def known_backends():
    """Every name :class:`Point` may carry: fastattn's backends and the peers."""
    return tuple(_api.BACKEND_MODULES) + peers.PEERS


def default_grid(attentions=ATTENTIONS, backends=None, ns=DEFAULT_NS, causal=(False, True),
                 d_k=64, d_v=64, batch=1, heads=1, dtype="float32", feature_map=None):
    """The points of a sweep: every combination, the backends of one shape side by side.

    Parameters
    ----------
    attentions : iterable of {"softmax", "linear"}
    backends : iterable of str, optional
        Default :func:`default_backends` (available fastattn backends, the
        reference first, then installed peers).
    ns : iterable of int, default 128 ... 8192 (powers of 2)
    causal : iterable of bool, default (False, True)
    d_k, d_v, batch, heads : int
    dtype : str or iterable of str, default "float32"
    feature_map : str, optional
        For linear attention; default "elu".

    Returns
    -------
    list of Point
        Ordered by attention, causal, dtype, n, then backend, so the points
        that share inputs (and a float64 reference) run one after another.
    """
    backends = default_backends() if backends is None else list(backends)
    dtypes = [dtype] if isinstance(dtype, str) else list(dtype)
    points = []
    for attention in attentions:
        for is_causal in causal:
            for dt in dtypes:
                for n in ns:
                    for backend in backends:
                        points.append(Point(
                            attention=attention, backend=backend, causal=bool(is_causal),
                            n=int(n), d_k=int(d_k), d_v=int(d_v), batch=int(batch),
                            heads=int(heads), dtype=dt,
                            feature_map=feature_map if attention == "linear" else None,
                        ))
    return points


# ---------------------------------------------------------------------------
# The worker: one process that does all measuring.

def _worker_setup(threads, peers_only=False):
    """Fix the thread counts of the measuring process.

    A process that measures only peers fixes BLAS and the peers' own pools
    and leaves fastattn's backends unloaded: once Numba's OpenMP pool has
    started in a process, PyTorch's OpenMP kernels there run about 5x slower
    (measured on the 2-core development machine), which would misstate them.
    """
    if peers_only:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads)
    else:
        from .._threads import set_num_threads

        set_num_threads(threads)
    peers.set_peer_threads(threads)


def _serve(task, state):
    """Answer one request in the measuring process."""
    from . import _measure, environment, roof

    kind, payload = task
    if kind == "environment":
        env = environment.collect(threads=payload["threads"])
        env["thread_counts"].update(peers.peer_threads())
        return env
    if kind == "roof":
        return roof.probe(payload["shapes"], payload["dtypes"], threads=payload["threads"],
                          budget_s=payload.get("budget_s", 0.1))
    if kind == "point":
        if "references" not in state:
            state["references"] = _measure.ReferenceCache()
        outcome = _measure.measure_point(payload["spec"], references=state["references"],
                                         **payload["options"])
        if outcome.get("status") == "ok":
            # The counts in force right after the call, by component.
            outcome["thread_counts"] = {**_thread_counts(state.get("peers_only")),
                                        **peers.peer_threads()}
        return outcome
    raise ValueError(f"unknown request {kind!r}")


def _thread_counts(peers_only):
    if not peers_only:
        from .._threads import get_num_threads

        return get_num_threads()
    from .._threads import blas_threads

    return {"blas": blas_threads()}


def _worker_main(conn, threads, peers_only=False):
    """Entry point of the worker process: answer requests until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    _worker_setup(threads, peers_only)
    conn.send(("ready", None))
    state = {"peers_only": peers_only}
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            conn.send(("ok", _serve(task, state)))
        except Exception as exc:  # never let the worker die on one request
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class WorkerDied(RuntimeError):
    """The measuring process ended while measuring (killed, crashed, out of memory)."""


_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMBA_NUM_THREADS")


class _Worker:
    """A measuring process fixed to ``threads`` threads (spawned lazily, restarted if it dies)."""

    def __init__(self, threads, peers_only=False):
        self.threads = threads
        self.peers_only = peers_only
        self.process = None
        self.conn = None

    def _start(self):
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        saved = {name: os.environ.get(name) for name in _THREAD_ENV}
        # Fix the thread pools before any library starts them in the child.
        for name in _THREAD_ENV:
            if name == "NUMBA_NUM_THREADS":
                # Numba refuses set_num_threads above its start-up count.
                os.environ[name] = str(max(self.threads, default_num_threads()))
            else:
                os.environ[name] = str(self.threads)
        try:
            self.process = context.Process(target=_worker_main,
                                           args=(child, self.threads, self.peers_only),
                                           name="fastattn-bench-worker", daemon=True)
            self.process.start()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        child.close()
        self.conn = parent
        try:
            parent.recv()  # started and set up: time limits count from here
        except (EOFError, OSError):
            self.process.join(timeout=5)
            code = self.process.exitcode
            self.process = None
            raise WorkerDied(f"the measuring process failed to start (exit code {code})")

    def request(self, kind, payload, timeout_s=None):
        if self.process is None or not self.process.is_alive():
            self._start()
        try:
            self.conn.send((kind, payload))
            if timeout_s is not None and not self.conn.poll(timeout_s):
                self.process.kill()
                self.process.join(timeout=5)
                self.process = None
                raise WorkerDied(f"timed out after {timeout_s:g} s (the measuring process "
                                 "was stopped)")
            status, value = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.process.join(timeout=5)
            code = self.process.exitcode
            self.process = None
            signal_name = ""
            if code is not None and code < 0:
                try:
                    signal_name = f" by {signal.Signals(-code).name}"
                except ValueError:
                    pass
            hint = " (out of memory?)" if code == -signal.SIGKILL else ""
            raise WorkerDied(f"the measuring process ended{signal_name}, exit code {code}{hint}")
        if status == "error":
            raise RuntimeError(value)
        return value

    def close(self):
        if self.process is None:
            return
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=2)
        self.process = None


class _InProcess:
    """The same requests answered in this process (tests, debugging)."""

    def __init__(self, threads):
        self.threads = threads
        self.state = {}
        _worker_setup(threads)

    def request(self, kind, payload, timeout_s=None):
        return _serve((kind, payload), self.state)

    def close(self):
        pass


def _progress(total, enabled):
    if not enabled or total == 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but a progress bar is not essential
        return None
    return tqdm(total=total, unit="point", desc="fastattn bench", dynamic_ncols=True)


def run_sweep(points, results_path, *, threads=None, repeats=5, memory=True, check=True,
              resume=True, progress=True, isolate=True, roof_budget_s=0.1,
              memory_method="auto", max_point_s=5.0, point_timeout_s=None, roof=True):
    """Measure ``points``, appending one record per point to ``results_path`` as each finishes.

    Parameters
    ----------
    points : iterable of Point
    results_path : str or Path
        JSON-lines results file (:mod:`fastattn.bench.results`); created with
        its folder if missing.
    threads : int, optional
        Threads for every backend, BLAS and peers, fixed for the whole run
        and recorded in every record.  Default: the usable cores.
    repeats : int, default 5
        Timed repeats per point (after a warm-up call); the median is the time.
    memory : bool, default True
        Measure each call's peak extra memory.
    check : bool, default True
        Compare each output with the float64 reference (``max_abs_err``).
    resume : bool, default True
        Keep the records already in the file and skip the points measured
        there (status ok or skipped, same thread count); errors are retried.
        False starts the file afresh (it must still be a fastattn results file).
    progress : bool, default True
        Show a progress bar (tqdm, on stderr).
    isolate : bool, default True
        Measure in a worker process (the memory probe needs it to see the call
        alone, and a crash costs one point).  False measures in this process.
    roof_budget_s : float, default 0.1
        Seconds per roof measurement.
    memory_method : {"auto", "hwm", "fresh", "tracemalloc"}, default "auto"
        How peak extra memory is measured (see
        :func:`fastattn.bench._measure.measure_point`); recorded per point.
    max_point_s : float or None, default 5.0
        Cap on the seconds of timed repeats per point: a call slower than
        ``max_point_s / repeats`` gets fewer repeats (never fewer than 3; the
        record's ``repeats`` says how many).  Keeps the quadratic reference at
        large n within a time budget.  None: always ``repeats``.
    point_timeout_s : float, optional
        A point still running after this many seconds is recorded as an
        error and its worker replaced (``isolate=True`` only).
    roof : bool, default True
        Probe the roof before the sweep (False: no roof records, and points
        carry no ``roof_fraction``).

    Returns
    -------
    list of dict
        The point records of ``points``, in order: those measured now and
        those found in the file.

    Raises
    ------
    ResultsFileError
        If ``results_path`` exists and is not a fastattn results file (it is
        left unchanged).
    KeyboardInterrupt
        Passed on after the worker is stopped; finished points are in the file.
    """
    points = list(points)
    for point in points:
        if not isinstance(point, Point):
            raise TypeError(f"points must be Point instances, got {type(point).__name__}")
    threads = default_num_threads() if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    from ._measure import MEMORY_METHODS

    if memory_method not in MEMORY_METHODS:
        raise ValueError(f"memory_method must be one of {MEMORY_METHODS}, got {memory_method!r}")
    writer = ResultsWriter(results_path, resume=resume)  # refuses a foreign file first
    found = {}
    for record in writer.existing:
        if record["record"] == "point" and record.get("status") in ("ok", "skipped"):
            found[point_key(record)] = record
    todo = [p for p in points if point_key(p.record_fields(threads)) not in found]
    results = {}
    run_id = uuid.uuid4().hex[:12]
    worker = (_Worker if isolate else _InProcess)(threads)
    # Peers get a process of their own (see _worker_setup).
    peer_worker = _Worker(threads, peers_only=True) if isolate else worker
    bar = _progress(len(todo), progress)
    try:
        if todo:
            env = worker.request("environment", {"threads": threads})
            writer.write("environment", run_id=run_id, **env)
            shapes = sorted({(p.n, p.d_k) for p in todo})
            dtypes = sorted({p.dtype for p in todo} | {"float32", "float64"})
            probed = {"gemm": [], "exp": []}
            if roof:
                probed = worker.request("roof", {"shapes": shapes, "dtypes": dtypes,
                                                 "threads": threads, "budget_s": roof_budget_s})
            roof_records = []
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            for entry in probed["gemm"] + probed["exp"]:
                roof_records.append(writer.write("roof", run_id=run_id, threads=threads,
                                                 load_avg_1m=load, **entry))
            gemm = [r for r in roof_records if r.get("probe") == "gemm"]
        options = {"repeats": repeats, "memory": memory, "check": check,
                   "memory_method": memory_method, "threads": threads,
                   "max_point_s": max_point_s}
        for point in todo:
            if bar is not None:
                bar.set_postfix_str(point.label(), refresh=False)
            spec = asdict(point)
            started = time.time()
            try:
                measuring = peer_worker if point.peer else worker
                outcome = measuring.request("point", {"spec": spec, "options": options},
                                            timeout_s=point_timeout_s)
            except WorkerDied as exc:
                outcome = {"status": "error", "reason": str(exc)}
            except RuntimeError as exc:
                outcome = {"status": "error", "reason": str(exc)}
            outcome = dict(outcome)
            if outcome.get("status") == "ok":
                from .roof import roof_for

                roof_gflops = roof_for(gemm, point.dtype, point.n, point.d_k)
                outcome["roof_gflops"] = roof_gflops
                gflops = outcome.get("gflops")
                outcome["roof_fraction"] = (gflops / roof_gflops
                                            if gflops and roof_gflops else None)
            record = writer.write(
                "point", run_id=run_id, started=started,
                **point.record_fields(threads), **outcome,
            )
            results[point_key(record)] = record
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        worker.close()
        peer_worker.close()
    ordered = []
    for point in points:
        key = point_key(point.record_fields(threads))
        record = results.get(key) or found.get(key)
        if record is not None:
            ordered.append(record)
    return ordered


__all__ = ["Point", "default_grid", "default_backends", "known_backends", "run_sweep"]
