"""Kernels under load: called from 4 Python threads at once, and on 1, 2 or 3 threads.

The concurrent calls run in a child process, so a backend whose threading
layer aborts on concurrent use (Numba's workqueue layer does) fails its test
with the child's stderr instead of killing the test session.
"""

import subprocess
import threading
import sys
import textwrap

import numpy as np
import pytest

import fastattn
from conftest import assert_close, make_qkv
from oracles import linear_oracle, softmax_oracle

#: The child: every call once serially, then the same calls from 4 threads at
#: once (each thread runs them all, in its own order, twice), results saved.
CHILD = textwrap.dedent(
    """
    import sys, threading
    import numpy as np
    import fastattn

    backend, out_path = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(5)

    def qkv(b, n_q, n_k, d_k, d_v, dtype):
        return (rng.standard_normal((b, n_q, d_k)).astype(dtype),
                rng.standard_normal((b, n_k, d_k)).astype(dtype),
                rng.standard_normal((b, n_k, d_v)).astype(dtype))

    calls = []
    for dtype in (np.float32, np.float64):
        q, k, v = qkv(2, 130, 150, 8, 4, dtype)
        S0 = rng.standard_normal((2, 8, 4)).astype(dtype)
        z0 = rng.random((2, 8)).astype(dtype) + 1
        for causal in (False, True):
            calls.append(lambda q=q, k=k, v=v, c=causal: fastattn.softmax_attention(
                q, k, v, causal=c, backend=backend))
            calls.append(lambda q=q, k=k, v=v, c=causal: fastattn.linear_attention(
                q, k, v, causal=c, backend=backend))
            calls.append(lambda q=q, k=k, v=v, c=causal, s=(S0, z0): fastattn.linear_attention(
                q, k, v, feature_map="relu", causal=c, initial_state=s, backend=backend))

    serial = [call() for call in calls]      # also compiles / warms up

    threaded = [[None] * len(calls) for _ in range(4)]
    errors = []
    barrier = threading.Barrier(4)

    def worker(t):
        order = np.random.default_rng(t).permutation(len(calls))
        try:
            barrier.wait()
            for _ in range(2):
                for i in order:
                    threaded[t][i] = calls[i]()
        except BaseException as exc:         # reported by the parent
            errors.append(f"thread {t}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        sys.exit("\\n".join(errors))
    arrays = {f"serial_{i}": r for i, r in enumerate(serial)}
    arrays.update({f"t{t}_{i}": r for t in range(4) for i, r in enumerate(threaded[t])})
    np.savez(out_path, **arrays)
    """
)


def test_four_python_threads_equal_serial_calls(backend, tmp_path):
    out_path = tmp_path / "results.npz"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, backend, str(out_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (
        f"concurrent calls of backend {backend!r} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    )
    with np.load(out_path) as data:
        n_calls = sum(1 for key in data.files if key.startswith("serial_"))
        assert n_calls == 12
        for i in range(n_calls):
            serial = data[f"serial_{i}"]
            assert np.all(np.isfinite(serial))
            for t in range(4):
                assert_close(data[f"t{t}_{i}"], serial, err_msg=f"call {i}, thread {t}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_results_do_not_depend_on_the_thread_count(backend, dtype):
    """Sizes that span several query blocks and batch entries, so a parallel kernel splits them."""
    q, k, v = make_qkv((2, 2, 150, 8), n_k=170, d_v=4, dtype=dtype, seed=71)
    outputs = {}
    for n_threads in (1, 2, 3):
        with fastattn.num_threads(n_threads):
            assert fastattn.get_num_threads()["requested"] == n_threads
            outputs[n_threads] = [
                fastattn.softmax_attention(q, k, v, causal=causal, backend=backend)
                for causal in (False, True)
            ] + [
                fastattn.linear_attention(q, k, v, causal=causal, backend=backend)
                for causal in (False, True)
            ]
    expected = [softmax_oracle(q, k, v, c) for c in (False, True)]
    expected += [linear_oracle(q, k, v, "elu", c)[0] for c in (False, True)]
    for n_threads, outs in outputs.items():
        for out, exp, ref1 in zip(outs, expected, outputs[1]):
            assert_close(out, exp, dtype=dtype, err_msg=f"{n_threads} threads vs the oracle")
            assert_close(out, ref1, dtype=dtype, err_msg=f"{n_threads} threads vs 1 thread")


def test_the_thread_count_reaches_numba_in_every_python_thread(monkeypatch):
    """Numba's own count is per Python thread; fastattn's is process-wide."""
    numba = pytest.importorskip("numba")
    if "numba" not in fastattn.available_backends() or numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs the numba backend with at least 2 threads")
    from fastattn._numba import _threads as numba_threads

    # A call on one thread may run a kernel's serial twin instead of setting
    # Numba's count: record when it does.
    serial = []
    real_twin = getattr(numba_threads, "serial_twin", None)
    monkeypatch.setattr(numba_threads, "serial_twin",
                        lambda kernel: (serial.append(kernel), real_twin(kernel))[1], raising=False)
    q, k, v = make_qkv((4, 300, 16), dtype=np.float32, seed=72)   # enough work to run in parallel
    seen = {}

    def call():
        fastattn.softmax_attention(q, k, v, backend="numba")
        # The threads the kernel ran on in this Python thread.
        seen["numba"] = 1 if serial else numba.get_num_threads()
        seen["reported"] = fastattn.get_num_threads()["numba"]

    for n_threads in (1, 2):
        serial.clear()
        with fastattn.num_threads(n_threads):
            worker = threading.Thread(target=call)
            worker.start()
            worker.join()
        assert seen == {"numba": n_threads, "reported": n_threads}, f"after set_num_threads({n_threads})"


def _count_blas_calls(monkeypatch):
    """Count every call that sets a BLAS library's threads, and refuse threadpoolctl's limit()."""
    import threadpoolctl

    calls = []
    for cls in {type(lib) for lib in threadpoolctl.ThreadpoolController().lib_controllers}:
        real = cls.set_num_threads
        monkeypatch.setattr(cls, "set_num_threads",
                            lambda self, n, real=real: (calls.append(n), real(self, n))[1])

    def no_limit(*args, **kwargs):
        raise AssertionError("a threadpoolctl limit was made during a kernel call")

    monkeypatch.setattr(threadpoolctl.ThreadpoolController, "limit", no_limit)
    monkeypatch.setattr(threadpoolctl, "threadpool_limits", no_limit)
    return calls


def test_a_call_too_small_to_split_leaves_blas_and_the_pools_alone(fast_backend, monkeypatch):
    q, k, v = make_qkv((1, 64), dtype=np.float32, seed=73)      # the trivial call: n = 1, d = 64
    fastattn.softmax_attention(q, k, v, backend=fast_backend)    # loads everything first
    with fastattn.num_threads(2):
        calls = _count_blas_calls(monkeypatch)
        for _ in range(3):
            fastattn.softmax_attention(q, k, v, backend=fast_backend)
            fastattn.linear_attention(q, k, v, causal=True, backend=fast_backend)
        assert calls == [], f"BLAS threads were set {len(calls)} times for calls of 1 query"


def test_a_parallel_call_holds_blas_at_one_thread_without_a_limit_object(fast_backend, monkeypatch):
    from fastattn import _threads

    # d = 12 is no whole number of vectors: Cython's tiles take BLAS products too.
    q, k, v = make_qkv((4, 300, 12), dtype=np.float32, seed=74)
    fastattn.softmax_attention(q, k, v, backend=fast_backend)
    with fastattn.num_threads(2):
        if fastattn.get_num_threads()[fast_backend] < 2:
            pytest.skip(f"{fast_backend} cannot run 2 threads here")
        calls = _count_blas_calls(monkeypatch)
        fastattn.softmax_attention(q, k, v, backend=fast_backend)
        # Held at 1 during the call, back to 2 after (no threadpoolctl limit object).
        assert calls and set(calls) == {1, 2} and calls[-1] == 2, calls
        assert _threads.blas_threads() == 2


@pytest.mark.parametrize("dtype, d", [(np.float32, 32), (np.float64, 8)])
def test_a_parallel_call_on_the_register_blocked_products_leaves_blas_alone(dtype, d, monkeypatch):
    """Where every product of a Cython call is its own (d_k, d_v whole vectors), no
    BLAS runs inside it, so its threads are not set back and forth."""
    cython = pytest.importorskip("fastattn._cython")
    if not cython.linear._takes_products(d, dtype):
        pytest.skip("no AVX-512 or AVX2 products here (or FASTATTN_SIMD=off): BLAS takes them")
    q, k, v = make_qkv((4, 300, d), dtype=dtype, seed=75)
    fastattn.softmax_attention(q, k, v, backend="cython")
    with fastattn.num_threads(2):
        if fastattn.get_num_threads()["cython"] < 2:
            pytest.skip("cython cannot run 2 threads here")
        calls = _count_blas_calls(monkeypatch)
        for causal in (False, True):
            out = fastattn.softmax_attention(q, k, v, causal=causal, backend="cython")
            np.testing.assert_allclose(out, fastattn.softmax_attention(
                q, k, v, causal=causal, backend="reference"), rtol=1e-4, atol=1e-5)
            out = fastattn.linear_attention(q, k, v, causal=causal, backend="cython")
            np.testing.assert_allclose(out, fastattn.linear_attention(
                q, k, v, causal=causal, backend="reference"), rtol=1e-4, atol=1e-5)
        assert calls == [], f"BLAS threads were set {len(calls)} times"
    # d_v of no whole vectors: linear attention's products are BLAS's again, held at 1.
    q, k, v = make_qkv((4, 300, d + 4), dtype=dtype, seed=76)
    with fastattn.num_threads(2):
        calls = _count_blas_calls(monkeypatch)
        fastattn.linear_attention(q, k, v, backend="cython")
        assert calls and set(calls) == {1, 2}, calls


def test_a_blas_limit_the_caller_set_holds_after_a_parallel_call(fast_backend):
    """The hold gives BLAS back the count it found, not fastattn's own: a caller's
    threadpool_limits(1) is still in force after a 2-thread call that reached BLAS."""
    from threadpoolctl import threadpool_info, threadpool_limits

    q, k, v = make_qkv((4, 1024, 12), dtype=np.float32, seed=77)   # d = 12: BLAS products
    fastattn.softmax_attention(q, k, v, backend=fast_backend)
    with fastattn.num_threads(2):
        if fastattn.get_num_threads()[fast_backend] < 2:
            pytest.skip(f"{fast_backend} cannot run 2 threads here")
        with threadpool_limits(limits=1, user_api="blas"):
            fastattn.softmax_attention(q, k, v, backend=fast_backend)
            fastattn.linear_attention(q, k, v, causal=True, backend=fast_backend)
            counts = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
            assert counts and set(counts) == {1}, counts
        counts = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
        assert set(counts) == {2}, counts   # threadpoolctl gave back its own, fastattn's 2
