"""Start-up: ``import fastattn`` imports no backend, and Numba only when the numba backend is used.

Each case runs in a new process, where ``sys.modules`` shows what was imported.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import BACKENDS

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np

    def backends():
        return sorted(m for m in ("numba", "fastattn._numba", "fastattn._cython", "scipy.linalg")
                      if m in sys.modules)

    seen = {}
    import fastattn
    seen["import"] = backends()
    fastattn.set_num_threads(1)
    seen["set_num_threads"] = backends()
    q = np.ones((1, 64), np.float32)
    fastattn.softmax_attention(q, q, q, backend=sys.argv[1])
    seen["first call"] = backends()
    from fastattn import _api
    seen["threads"] = getattr(_api.get_backend(sys.argv[1]), "get_num_threads", lambda: None)()
    print(json.dumps(seen))
    """
)


def _run(backend):
    proc = subprocess.run([sys.executable, "-c", CHILD, backend], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_and_set_num_threads_load_no_backend():
    seen = _run("reference")
    assert seen["import"] == [], "import fastattn imported a backend"
    assert seen["set_num_threads"] == [], "set_num_threads imported a backend"
    assert seen["first call"] == [], "a reference call imported a fast backend"


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_a_backend_loads_alone_and_takes_the_recorded_thread_count(backend):
    seen = _run(backend)
    assert seen["set_num_threads"] == []
    module = "fastattn._cython" if backend == "cython" else "fastattn._numba"
    assert module in seen["first call"]
    if backend == "cython":
        assert "numba" not in seen["first call"], "a Cython call imported Numba"
        assert "fastattn._numba" not in seen["first call"]
    # set_num_threads(1) came before the backend loaded, and still holds.
    assert seen["threads"] == 1


SCIPY_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import fastattn
    seen = {"import": sorted(m for m in ("scipy.special", "scipy.linalg", "psutil") if m in sys.modules)}
    fastattn.set_num_threads(2)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 300, 64)).astype(np.float32) for _ in range(3))
    got = fastattn.softmax_attention(q, k, v, backend="cython")    # BLAS GEMMs
    seen["cython call"] = sorted(m for m in ("scipy.special", "scipy.linalg") if m in sys.modules)
    want = fastattn.softmax_attention(q, k, v, backend="reference")
    seen["max error"] = float(abs(got - want).max())
    import scipy.linalg.cython_blas
    seen["complete"] = hasattr(scipy.linalg, "solve") and "sgemm" in scipy.linalg.cython_blas.__pyx_capi__
    print(json.dumps(seen))
    """
)


@pytest.mark.skipif("cython" not in BACKENDS, reason="Cython backend not built")
def test_a_cython_call_imports_neither_scipy_linalg_nor_scipy_special():
    """The extensions take SciPy's BLAS table without ``scipy.linalg``; a later import is whole."""
    proc = subprocess.run([sys.executable, "-c", SCIPY_CHILD], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "scipy.special" not in seen["import"], "import fastattn imported scipy.special"
    assert seen["cython call"] == [], "a Cython call imported scipy.linalg or scipy.special"
    assert seen["max error"] < 1e-5
    assert seen["complete"], "import scipy.linalg.cython_blas after a Cython call is incomplete"


WITHOUT_EXTRAS_CHILD = textwrap.dedent(
    """
    import sys

    BLOCKED = ("psutil", "matplotlib", "jinja2", "tqdm", "rich", "pandas", "tabulate")

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    import numpy as np
    import fastattn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 300, 16)).astype(np.float32) for _ in range(3))
    for backend in fastattn.available_backends():
        fastattn.softmax_attention(q, k, v, causal=True, backend=backend)
        for fmap in ("elu", "favor", "taylor"):
            fastattn.linear_attention(q, k, v, feature_map=fmap, causal=True, backend=backend)
    cache = fastattn.KVCache((2,), capacity=8, d_k=16)
    cache.append(k[:, :4], v[:, :4])
    cache.attend(q[:, :1])
    fastattn.attention_weights(q, k, kind="linear", causal=True)
    print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
    """
)


def test_import_and_calls_need_none_of_the_report_and_bench_extras():
    """psutil, matplotlib, jinja2 and the table libraries blocked: fastattn imports and runs."""
    proc = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS_CHILD], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
