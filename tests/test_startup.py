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
