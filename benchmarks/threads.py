"""Thread counts in force while the suite runs, recorded with every result.

asv.conf.json fixes them through the environment (``NUMBA_NUM_THREADS``,
``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``), and each benchmark's setup
calls :func:`fastattn.set_num_threads`; these track what actually took effect,
so a history that changes threads shows it.
"""

import os

import fastattn

from .common import fix_threads

_ENV_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class Threads:
    """Threads per component: the requested count, BLAS, each backend, each env var."""

    params = (("requested", "blas", "numba", "cython") + tuple("env:" + v for v in _ENV_VARS),)
    param_names = ("component",)

    def setup(self, component):
        fix_threads()
        if component.startswith("env:"):
            if not os.environ.get(component[4:], "").strip().isdigit():
                raise NotImplementedError(f"{component[4:]} is not set")
        elif fastattn.get_num_threads().get(component) is None:
            raise NotImplementedError(f"{component} reports no thread count here")

    def track_threads(self, component):
        if component.startswith("env:"):
            return int(os.environ[component[4:]])
        return fastattn.get_num_threads()[component]

    track_threads.unit = "threads"
