"""Kernels under load: called from 4 Python threads at once, and on 1, 2 or 3 threads.

The concurrent calls run in a child process, so a backend whose threading
layer aborts on concurrent use (Numba's workqueue layer does) fails its test
with the child's stderr instead of killing the test session.
"""

import subprocess
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
