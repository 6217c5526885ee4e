"""The sweep: a grid of :class:`Point` measured in ``spawn`` worker processes (a crash costs
one point; peers get their own, as PyTorch runs ~5x slower beside Numba's OpenMP pool),
each record appended as its shape finishes, so a run resumes."""

import contextlib
import multiprocessing
import os
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from unittest import mock

from .. import _api
from ..feature_maps import NAMES as FEATURE_MAPS
from .._threads import blas_threads, default_num_threads
from . import engine, environment, limits, peers
from .environment import idle_cores  # noqa: F401  (fastattn report reads it here)
from .results import ResultsWriter, point_key
from .schema import (ATTENTIONS, DECODE_NS, DEFAULT_NS, DTYPES, FAVOR_MULTIPLES,  # noqa: F401
                     FEATURE_MAP_NS, REGIMES)


def new_run_id():
    """A fresh id for the records of one run."""
    return uuid.uuid4().hex[:12]


def check_count(name, value):
    """``value`` if it is a positive int, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Point:
    """One measurement: an attention call of one shape on one backend or peer (``"prefill"``:
    ``n_q = n_k = n``; ``"decode"``, causal: ``n_q = 1``).  A bad field raises ValueError
    (causal: TypeError)."""

    attention: str
    backend: str
    causal: bool
    n: int
    d_k: int = 64
    d_v: int = 64
    batch: int = 1
    heads: int = 1
    dtype: str = "float32"
    feature_map: str | None = None
    regime: str = "prefill"
    num_features: int | None = None

    def __post_init__(self):
        for name, allowed in (("attention", ATTENTIONS), ("dtype", DTYPES), ("regime", REGIMES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend must be a backend or peer name, got {self.backend!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be True or False, got {self.causal!r}")
        for name in ("n", "d_k", "d_v", "batch", "heads"):
            check_count(name, getattr(self, name))
        if self.attention == "softmax" and self.feature_map is not None:
            raise ValueError("feature_map applies to linear attention only; use None for softmax")
        if self.attention == "linear":
            fmap = self.feature_map or FEATURE_MAPS[0]
            if fmap not in FEATURE_MAPS:
                raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {fmap!r}")
            object.__setattr__(self, "feature_map", fmap)
        if self.regime == "decode" and not self.causal:
            raise ValueError("a decode point is causal (its query is the newest token): "
                             "use causal=True")
        if self.num_features is not None:
            if self.feature_map != "favor":
                raise ValueError("num_features applies to feature_map='favor' only, got "
                                 f"feature_map={self.feature_map!r}")
            check_count("num_features", self.num_features)

    peer = property(lambda self: self.backend in peers.PEERS, doc="True for a peer (torch).")

    def record_fields(self, threads=None):
        """The point's fields as its record holds them (``threads`` when given)."""
        fields = asdict(self)
        n = fields.pop("n")
        return {**fields, "n_q": 1 if self.regime == "decode" else n, "n_k": n,
                "peer": self.peer, **({} if threads is None else {"threads": int(threads)})}

    spec = record_fields

    def label(self):
        """Short text naming the point, e.g. ``softmax causal n=1024 d=64 float32 numba``."""
        mask = ("causal" if self.causal else "non-causal") + (
            " decode" if self.regime == "decode" else "")
        d = f"d={self.d_k}" if self.d_k == self.d_v else f"d_k={self.d_k} d_v={self.d_v}"
        fmap = "" if self.attention == "softmax" or self.feature_map == "elu" else \
            f" {self.feature_map}" + (f" m={self.num_features}" if self.num_features else "")
        return f"{self.attention}{fmap} {mask} n={self.n} {d} {self.dtype} {self.backend}"


@dataclass(frozen=True)
class Options:
    """How each point is measured (see :mod:`.engine`); ``rounds`` of turns of the backends of
    a shape (default: one a repeat); ``roof_libraries`` default to NumPy and torch if there."""

    repeats: int = 5
    rounds: int | None = None
    min_time_s: float = engine.MIN_TIME_S
    memory: bool = True
    check: bool = True
    max_point_s: float | None = 5.0
    point_timeout_s: float | None = None
    roof: bool = True
    roof_budget_s: float = 0.1
    roof_libraries: tuple | None = None

    def __post_init__(self):
        check_count("repeats", self.repeats)
        if self.rounds is not None:
            check_count("rounds", self.rounds)
        for library in self.roof_libraries or ():
            if library not in engine.ROOF_LIBRARIES:
                raise ValueError(f"roof_libraries must be among {engine.ROOF_LIBRARIES}, "
                                 f"got {library!r}")

    def libraries(self):
        """The BLAS libraries the roof is probed through in this run."""
        if self.roof_libraries is not None:
            return tuple(self.roof_libraries)
        return ("numpy",) + (("torch",) if "torch" in peers.available_peers() else ())


def default_backends(peers_too=True):
    """Every fastattn backend that runs here (the reference first), then the installed peers."""
    names = sorted(_api.available_backends(), key=lambda b: b != "reference")
    return names + (list(peers.available_peers()) if peers_too else [])


def known_backends():
    """Every name :class:`Point` may carry: fastattn's backends and the peers."""
    return tuple(_api.BACKEND_MODULES) + tuple(peers.PEERS)


def default_grid(attentions=ATTENTIONS, backends=None, ns=DEFAULT_NS, causal=(False, True),
                 d_k=64, d_v=64, batch=1, heads=1, dtype="float32", feature_map=None,
                 regime="prefill", num_features=None):
    """Every combination as Points (a peer only where it has the call), the backends of a
    shape together; a decode grid is causal only."""
    backends = default_backends() if backends is None else list(backends)
    dtypes = [dtype] if isinstance(dtype, str) else list(dtype)
    causal = (True,) if regime == "decode" else causal
    return [Point(attention, backend, bool(c), int(n), int(d_k), int(d_v), int(batch),
                  int(heads), dt, fmap, regime, num_features if fmap == "favor" else None)
            for attention in attentions for c in causal for dt in dtypes for n in ns
            for backend in backends
            for fmap in [feature_map if attention == "linear" else None]
            if backend not in peers.PEERS or not peers.why_not(backend, attention, regime=regime,
                                                               feature_map=fmap)]


def feature_map_grid(backends, ns=FEATURE_MAP_NS, d_k=64, **kwargs):
    """Non-causal linear points of every feature map (FAVOR+ at ``m = FAVOR_MULTIPLES x
    d_k``), at each n of ``ns``."""
    maps = [(fmap, m) for fmap in FEATURE_MAPS
            for m in ([f * d_k for f in FAVOR_MULTIPLES] if fmap == "favor" else [None])]
    return [p for fmap, m in maps for p in default_grid(
        ("linear",), backends, ns, (False,), d_k=d_k, d_v=d_k, feature_map=fmap,
        num_features=m, **kwargs)]


# ---------------------------------------------------------------- the worker
def _serve(task, state):
    kind, payload = task
    if kind == "environment":
        env = environment.collect(threads=payload["threads"])
        env["thread_counts"].update(peers.peer_threads())
        return env
    if kind == "roof":  # the GEMM roof, then the machine's limits (fastattn.bench.limits)
        return engine.probe_roof(payload["shapes"], payload["dtypes"], payload["budget_s"],
                                 library=payload["library"]) + limits.probe_limits(
            payload["sizes"], payload["dtypes"], payload["library"],
            blas=environment.roof_blas(payload["library"]))
    if kind == "gemm":  # one round's roof, beside the points of a comparison
        return engine.time_gemm(payload["dtype"], payload["n"], payload["d"],
                                payload["library"], cache=state.setdefault("gemms", {}))
    if kind == "floor":  # one round's memory floor, beside the points of a comparison
        return limits.time_read(payload["bytes"], cache=state.setdefault("reads", {}))
    if kind == "prepare":  # warm-up, memory, check; the call is kept for "time"
        options = payload["options"]
        call, fields, n_repeats, estimate = engine.prepare_point(
            payload["spec"], options.repeats, options.memory, options.check,
            references=state["references"], max_point_s=options.max_point_s)
        if call is not None:
            state["calls"][payload["key"]] = (call, estimate)
        return {"fields": fields, "repeats": n_repeats}
    if kind == "time":
        if payload["key"] not in state["calls"]:
            return None  # this process was replaced since the point was prepared
        call, estimate = state["calls"][payload["key"]]
        try:
            if estimate < engine.TURN_WARM_S:
                engine.warm_up(call)  # untimed: the turn's timed calls start warm
            timing = engine.time_call(call, payload["repeats"], estimate, payload["min_time_s"],
                                      payload["max_repeats"])
        except Exception as exc:
            return {"failure": engine.failure(exc)}
        from .._backends import get_num_threads
        timing["thread_counts"] = {**({"blas": blas_threads()} if state["peers_only"]
                                      else get_num_threads()), **peers.peer_threads()}
        return timing
    if kind == "release":
        state["calls"].pop(payload["key"], None)
        return None
    raise ValueError(f"unknown request {kind!r}")


def _setup(threads, peers_only):
    """Fix the thread counts of the measuring process (peers only: BLAS and the peers')."""
    if peers_only:
        from threadpoolctl import threadpool_limits
        threadpool_limits(threads)
    else:
        from .._backends import set_num_threads
        set_num_threads(threads)
    peers.set_peer_threads(threads)
    return {"peers_only": peers_only, "references": engine.ReferenceCache(), "calls": {}}


def _worker_main(conn, threads, peers_only):
    # Ctrl-C and SIGTERM are the parent's to handle: it stops this process (_Worker.close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    state = _setup(threads, peers_only)
    with contextlib.suppress(OSError, EOFError):   # the parent gone: end quietly
        conn.send(("ready", None))
        while (task := conn.recv()) is not None:
            try:
                answer = ("ok", _serve(task, state))
            except Exception as exc:  # never let the worker die on one request
                answer = ("error", f"{type(exc).__name__}: {exc}")
            conn.send(answer)


class Terminated(KeyboardInterrupt):
    """SIGTERM while measuring, raised as Ctrl-C is, so a command stops the same way."""

    signum = signal.SIGTERM


@contextlib.contextmanager
def _terminate_as_interrupt():
    """Within: SIGTERM raises :class:`Terminated` in the main thread, once (unless the caller
    set a handler)."""
    def terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    try:
        ours = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        if ours:
            signal.signal(signal.SIGTERM, terminated)
    except ValueError:   # not the main thread: no handler can be set
        ours = False
    try:
        yield
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class WorkerDied(RuntimeError):
    """The measuring process ended while measuring (killed, crashed, out of memory)."""


_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


class _Worker:
    """A measuring process fixed to ``threads`` threads (spawned lazily, restarted if it
    dies); with ``isolate`` False, this process answers instead (tests, debugging)."""

    def __init__(self, threads, peers_only=False, isolate=True):
        self.threads, self.peers_only, self.process, self.conn = threads, peers_only, None, None
        self.state = None if isolate else _setup(threads, peers_only)

    def _start(self):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        # Pools fixed before any library starts them; Numba refuses more threads than at start.
        with mock.patch.dict(os.environ, {name: str(self.threads) for name in _THREAD_ENV},
                             NUMBA_NUM_THREADS=str(max(self.threads, default_num_threads()))):
            process = context.Process(target=_worker_main, daemon=True,
                                      args=(child, self.threads, self.peers_only))
            process.start()
            self.process = process  # once started: Ctrl-C in start() leaves nothing to join
        child.close()
        try:
            self.conn.recv()  # started and set up: time limits count from here
        except (EOFError, OSError):
            raise self._stop("the measuring process failed to start") from None

    def _stop(self, why, kill=False):
        """End the process (killed first if ``kill``); the WorkerDied saying why and how."""
        if kill:
            self.process.kill()
        self.process.join(timeout=5)
        code, self.process = self.process.exitcode, None
        if kill:
            return WorkerDied(why)
        name = f" by {signal.Signals(-code).name}" if code and -code in signal.valid_signals() \
            else ""
        hint = " (out of memory?)" if code == -signal.SIGKILL else ""
        return WorkerDied(f"{why}{name}, exit code {code}{hint}")

    def request(self, kind, payload, timeout_s=None):
        if self.state is not None:
            return _serve((kind, payload), self.state)
        if self.process is None or not self.process.is_alive():
            self._start()
        try:
            self.conn.send((kind, payload))
            if timeout_s is not None and not self.conn.poll(timeout_s):
                raise self._stop(f"timed out after {timeout_s:g} s (the measuring process "
                                 "was stopped)", kill=True)
            status, value = self.conn.recv()
        except (EOFError, OSError):
            raise self._stop("the measuring process ended") from None
        if status == "error":
            raise RuntimeError(value)
        return value

    def close(self):
        if self.process is not None:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(timeout=2)
            self._stop("closed", kill=True)  # still measuring (it ignores SIGINT and SIGTERM)


def _write_header(writer, workers, todo, threads, why, options, run_id):
    """Write the environment and roof records; return the roof records (every (n, d_k))."""
    writer.write("environment", run_id=run_id, threads_reason=why,
                 **workers[False].request("environment", {"threads": threads}))
    if not options.roof:
        return []
    payload = {"shapes": sorted({(p.n, p.d_k) for p in todo}), "budget_s": options.roof_budget_s,
               "sizes": sorted({engine.point_bytes(p.spec()) for p in todo}),
               "dtypes": sorted({p.dtype for p in todo} | {"float32", "float64"})}
    records = []
    for library in options.libraries():
        try:
            probed = workers[library == "torch"].request("roof", {**payload, "library": library})
        except RuntimeError as exc:
            if library == "numpy":
                raise
            print(f"fastattn: the roof's GEMM through {library} could not be probed ({exc}); "
                  "the roof is NumPy's BLAS alone", file=sys.stderr)
            continue
        load = environment.load_avg_1m()
        records += [writer.write("roof", run_id=run_id, threads=threads, load_avg_1m=load,
                                 **entry) for entry in probed]
    return records


class _Entry:
    """One point of a comparison as it is measured."""

    def __init__(self, point, worker, threads, options):
        self.worker, self.options, self.key = worker, options, point.label()
        self.spec = point.record_fields(threads)
        self.fields, self.repeats, self.timings, self.rounds, self.spent = None, 0, [], [], 0.0

    ok = property(lambda self: self.fields is not None and self.fields["status"] == "ok")

    def request(self, kind, **payload):
        """The worker's answer, within what is left of the point's ``point_timeout_s``."""
        limit, start = self.options.point_timeout_s, time.perf_counter()
        try:
            return self.worker.request(kind, {"key": self.key, **payload}, timeout_s=None
                                       if limit is None else max(limit - self.spent, 1e-3))
        finally:
            self.spent += time.perf_counter() - start

    def prepare(self):
        try:
            answer = self.request("prepare", spec=self.spec, options=self.options)
        except RuntimeError as exc:  # WorkerDied included
            return {"status": "error", "reason": str(exc)}
        self.repeats = answer["repeats"]
        return answer["fields"]

    def time(self, repeats, min_time_s, max_repeats):
        """One turn of timed repeats; on a failure ``fields`` says why (``ok`` is False)."""
        payload = {"repeats": repeats, "min_time_s": min_time_s, "max_repeats": max_repeats}
        try:
            timing = self.request("time", **payload)
            if timing is None:  # its process was replaced (another point timed out): again
                self.prepare()
                timing = self.request("time", **payload)
        except RuntimeError as exc:
            timing = {"failure": {"status": "error", "reason": str(exc)}}
        if timing is None or "failure" in timing:
            self.fields = timing["failure"] if timing else {
                "status": "error", "reason": "the measuring process lost the prepared call"}
        else:
            self.timings.append(timing)

    def outcome(self, roofs, paired_roof, paired_floor=()):
        if not self.ok or not self.timings:
            return self.fields
        return {**engine.finish_point(self.spec, self.fields, self.timings, roofs, paired_roof,
                                      self.rounds, paired_floor),
                "thread_counts": self.timings[-1]["thread_counts"]}


def _ask(worker, kind, payload):
    """The worker's answer, or None if it failed (a paired probe missing from its round)."""
    try:
        return worker.request(kind, payload)
    except RuntimeError:
        return None


def _measure_group(points, workers, options, roofs, threads):
    """Outcomes of the points of one shape, prepared, then timed in rounds of a turn each (and
    one of the roof's GEMM), each round starting one point further so load falls on all alike;
    on 2+ threads each turn starts after TURN_SETTLE_S idle."""
    entries = [_Entry(point, workers[point.peer], threads, options) for point in points]
    for entry in entries:
        entry.fields = entry.prepare()
    live = [entry for entry in entries if entry.ok]
    rounds = len(live) if len(live) < 2 else options.rounds or max(e.repeats for e in live)
    plan = {}  # the repeats of each turn: e.repeats over at most `rounds` turns, evenly
    for e in live:
        turns = max(1, min(e.repeats, rounds))
        plan[e.key] = [e.repeats // turns + (t < e.repeats % turns) for t in range(turns)]
    probe = live and engine.roof_probe(roofs, points[0].dtype, points[0].d_k)
    spec = points[0].spec(threads)
    nbytes = engine.point_bytes(spec)
    floor_bound = live and limits.binding_limit(spec, engine.point_flops(spec), nbytes, roofs,
                                                threads).get("limit") == "floor"
    paired_roof, paired_floor = [], []
    for r in range(rounds):
        if floor_bound:  # the memory floor at the points' bytes, its own turn each round
            paired_floor.append(_ask(workers[False], "floor", {"bytes": nbytes}))
        if probe:  # the roof's GEMM, in the process of its library (None if it cannot run)
            if threads > 1:
                time.sleep(engine.TURN_SETTLE_S)
            library = probe.get("library", "numpy")
            paired_roof.append(_ask(workers[library == "torch"], "gemm", {
                "dtype": probe["dtype"], "n": probe["shape"][0], "d": probe["shape"][1],
                "library": library}))
        for entry in live[r % len(live):] + live[:r % len(live)]:
            if not entry.ok or r >= len(plan[entry.key]):
                continue
            n = plan[entry.key][r]
            if len(live) > 1 and threads > 1:
                time.sleep(engine.TURN_SETTLE_S)
            entry.rounds.append(r)
            entry.time(n, options.min_time_s * n / entry.repeats,
                       max(n, engine.MAX_REPEATS * n // entry.repeats))
    outcomes = [entry.outcome(roofs, paired_roof, paired_floor) for entry in entries]
    for entry in live:
        _ask(entry.worker, "release", {"key": entry.key})
    return outcomes


def run_sweep(points, results_path, options=Options(), *, threads=None, threads_reason=None,
              resume=True, isolate=True, progress="fastattn bench", announce=None, run_id=None):
    """Measure ``points`` on ``threads`` (default: usable cores; ``threads_reason`` says why),
    appending each record to ``results_path``; return the records measured now or (``resume``)
    found there.  ``announce(to_measure, done)`` is called once the file is read.  On Ctrl-C or
    SIGTERM (:class:`Terminated`) finished points stay and the workers stop quietly."""
    points = list(points)
    if bad := [p for p in points if not isinstance(p, Point)]:
        raise TypeError(f"points must be Point instances, got {type(bad[0]).__name__}")
    why = threads_reason or (f"every usable core ({default_num_threads()})" if threads is None
                             else "as given")
    threads = check_count("threads", default_num_threads() if threads is None else threads)
    writer = ResultsWriter(results_path, resume=resume)  # refuses a foreign file first
    if writer.dropped_tail:
        print(f"note: the last line of {results_path} was cut short by an interrupted write; "
              f"its {writer.dropped_tail} byte(s) were dropped (the point they held, if this run "
              "asks for it, is measured again)", file=sys.stderr)
    found = writer.done()
    keys = [point_key(p.record_fields(threads)) for p in points]
    todo = [p for p, key in zip(points, keys) if key not in found]
    if announce is not None:
        announce(len(todo), len(points) - len(todo))
    run_id = run_id or new_run_id()
    workers = {False: _Worker(threads, isolate=isolate)}
    workers[True] = _Worker(threads, peers_only=True) if isolate else workers[False]
    from tqdm.auto import tqdm
    bar = tqdm(total=len(todo), unit="point", desc=progress, dynamic_ncols=True,
               disable=not progress or not todo)
    groups = {}   # the points of one comparison: all but the backend alike
    for point in todo:
        groups.setdefault(point_key(dict(point.record_fields(), backend=None)), []).append(point)
    with _terminate_as_interrupt():
        try:
            roofs = _write_header(writer, workers, todo, threads, why, options,
                                  run_id) if todo else []
            for group in groups.values():
                bar.set_postfix_str(group[0].label().rsplit(" ", 1)[0], refresh=False)
                started = time.time()
                outcomes = _measure_group(group, workers, options, roofs, threads)
                for point, outcome in zip(group, outcomes):
                    record = writer.write("point", run_id=run_id, started=started,
                                          **point.record_fields(threads), **outcome)
                    found[point_key(record)] = record
                bar.update(len(group))
        finally:
            bar.close()
            for worker in dict.fromkeys(workers.values()):  # the kernels' first
                worker.close()
    return [found[key] for key in keys if key in found]


__all__ = ["Options", "Point", "Terminated", "check_count", "default_backends", "default_grid",
           "feature_map_grid", "known_backends", "run_sweep"]
