"""Thread counts and library versions in force while the suite runs, recorded with every result.

asv.conf.json fixes the threads through the environment and each benchmark's
setup calls :func:`fastattn.set_num_threads`; :class:`Threads` tracks what
took effect, so a history that changes threads shows it.  asv records no
library versions for ``--python=same`` runs: :class:`Versions` tracks them as
numbers (``major + minor / 1000 + patch / 10**6``).
"""

import importlib.metadata
import os
import re

import fastattn

from .common import fix_threads

_ENV_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


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


class Versions:
    """Installed version of each library the kernels use, as ``major.minor·patch``."""

    params = (("fastattn", "numpy", "scipy", "numba", "threadpoolctl", "llvmlite"),)
    param_names = ("library",)

    def setup(self, library):
        try:
            self.version = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            raise NotImplementedError(f"{library} is not installed") from None

    def track_version(self, library):
        major, minor, patch = (list(map(int, re.findall(r"\d+", self.version))) + [0, 0])[:3]
        # Rounded so asv shows 1.017001, not the sum's binary tail (1.0170009999999998).
        return round(major + minor / 1e3 + patch / 1e6, 6)

    track_version.unit = "version"
