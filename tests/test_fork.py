"""Process pools after a fast backend ran: fork, spawn and forkserver children compute correctly.

GNU OpenMP (the Cython kernels and Numba's ``omp`` layer) cannot start its
threads again in a child forked after its pool started: unprotected, the
Cython child hangs and Numba terminates the child.  Each case runs in a
process of its own, under a timeout, so a hang fails the test instead of
hanging the suite.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import FAST_BACKENDS, assert_close
from oracles import linear_oracle, softmax_oracle

SCRIPT = textwrap.dedent(
    """
    import concurrent.futures, multiprocessing, sys
    import numpy as np
    import fastattn

    def inputs():
        rng = np.random.default_rng(3)
        # 4 heads of 300 queries: several work items, so the parent runs in parallel.
        return [rng.standard_normal((4, 300, 16)) for _ in range(3)]

    def calls(backend, threads):
        fastattn.set_num_threads(threads)
        q, k, v = inputs()
        return ([fastattn.softmax_attention(q, k, v, causal=c, backend=backend) for c in (False, True)]
                + [fastattn.linear_attention(q, k, v, causal=c, backend=backend) for c in (False, True)])

    if __name__ == "__main__":
        backend, method, out_path = sys.argv[1:]
        parent = calls(backend, 2)          # starts the thread pools
        pool = concurrent.futures.ProcessPoolExecutor(
            2, mp_context=multiprocessing.get_context(method))
        # The child asks for 2 threads too: it must not hang on the dead pool.
        child = pool.submit(calls, backend, 2).result(timeout=200)
        again = pool.submit(calls, backend, 1).result(timeout=200)
        pool.shutdown()
        after = calls(backend, 2)           # the parent still runs in parallel
        np.savez(out_path, **{f"{name}_{i}": x for name, results in
                              (("parent", parent), ("child", child), ("again", again),
                               ("after", after)) for i, x in enumerate(results)})
    """
)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("backend", [*FAST_BACKENDS, "auto"])
def test_pool_children_compute_after_a_fast_backend_ran(backend, method, tmp_path):
    script = tmp_path / "pool.py"
    script.write_text(SCRIPT)
    out_path = tmp_path / "results.npz"
    try:
        proc = subprocess.run([sys.executable, str(script), backend, method, str(out_path)],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a {method} child of a process that ran backend {backend!r} hung")
    assert proc.returncode == 0, (
        f"{method} pool with backend {backend!r} failed (exit {proc.returncode}):\n"
        f"{proc.stderr[-3000:]}"
    )
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((4, 300, 16)) for _ in range(3))
    expected = [softmax_oracle(q, k, v, c) for c in (False, True)]
    expected += [linear_oracle(q, k, v, "elu", c)[0] for c in (False, True)]
    with np.load(out_path) as data:
        for i, exp in enumerate(expected):
            for name in ("parent", "child", "again", "after"):
                assert_close(data[f"{name}_{i}"], exp, err_msg=f"{name}, call {i}")


COUNTS = textwrap.dedent(
    """
    import json, multiprocessing, sys
    import numpy as np
    import fastattn

    if __name__ == "__main__":
        fastattn.set_num_threads(2)
        rng = np.random.default_rng(3)
        q, k, v = (rng.standard_normal((4, 300, 16)) for _ in range(3))
        fastattn.softmax_attention(q, k, v, backend="cython")     # starts the OpenMP pool
        with multiprocessing.get_context(sys.argv[1]).Pool(1) as pool:
            child = pool.apply(fastattn.get_num_threads)
        print(json.dumps({"parent": fastattn.get_num_threads(), "child": child}))
    """
)


@pytest.mark.skipif("cython" not in FAST_BACKENDS, reason="the Cython backend is not built")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_forked_child_reports_the_one_thread_its_kernels_run_on(method, tmp_path):
    script = tmp_path / "counts.py"
    script.write_text(COUNTS)
    proc = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["parent"]["cython"] == 2
    fast = [name for name in FAST_BACKENDS if name in counts["child"]]
    assert fast
    if method == "fork":   # the pool cannot start again there: every fast kernel is serial
        assert all(counts["child"][name] == 1 for name in fast)
    else:                  # a fresh process, nothing requested yet
        assert counts["child"]["requested"] is None
