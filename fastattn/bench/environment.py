"""What a measurement ran on: CPU, cores, threads, BLAS, library versions."""

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path


def _cpuinfo(prefix):
    """The value of the first /proc/cpuinfo line starting with ``prefix``, or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            return next((line.split(":", 1)[1].strip() for line in handle
                         if line.lower().startswith(prefix)), None)
    except OSError:
        return None


def _cpu_flags():
    flags = set((_cpuinfo("flags") or "").split())
    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni")
    return [f for f in wanted if f in flags] if flags else None


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit():
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def blas_info():
    """BLAS libraries loaded here (threadpoolctl): ``internal_api``, ``version``,
    ``architecture``, ``threading_layer``, ``num_threads``, ``filepath``, ``prefix``."""
    from threadpoolctl import threadpool_info

    keys = ("internal_api", "version", "architecture", "threading_layer",
            "num_threads", "filepath", "prefix")
    return [{key: info.get(key) for key in keys}
            for info in threadpool_info() if info.get("user_api") == "blas"]


def _cython_products():
    """The instruction set the Cython kernels' register-blocked products take here:
    ``"avx512"``, ``"avx2"``, or None (their BLAS path, or no Cython build)."""
    try:
        from fastattn._cython.softmax import _build_features
    except ImportError:
        return None
    return _build_features()["tile_products"]


def collect(threads=None):
    """This machine and software, as an environment record: CPU, cores, memory, the run's
    ``threads`` and the counts in force, ``*_NUM_THREADS``, BLAS, Python, library
    ``versions`` (None when absent), backends, the Cython products' instruction set,
    peers and the git commit."""

    import numpy as np
    import psutil

    import fastattn
    from .peers import absent_peers, available_peers

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    memory = psutil.virtual_memory()
    return {
        "cpu_model": _cpuinfo("model name") or platform.processor() or platform.machine(),
        "cpu_flags": _cpu_flags(),
        "cores_logical": os.cpu_count(),
        "cores_usable": usable,
        "memory_total_bytes": int(memory.total),
        "memory_available_bytes": int(memory.available),
        "threads": threads,
        "thread_counts": fastattn.get_num_threads(),
        "thread_env": {name: value for name, value in sorted(os.environ.items())
                       if name.endswith("_NUM_THREADS") or name == "OMP_THREAD_LIMIT"},
        "blas": blas_info(),
        "numpy_config_blas": _numpy_blas_name(np),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "versions": {"fastattn": fastattn.__version__, "numpy": np.__version__,
                     **{name.lower(): _version(name)
                        for name in ("scipy", "numba", "Cython", "threadpoolctl", "torch",
                                     "onnxruntime", "onnx", "jax", "jaxlib")}},
        "backends": list(fastattn.available_backends()),
        "cython_products": _cython_products(),
        "unavailable_backends": fastattn.unavailable_backends(),
        "peers": list(available_peers()),
        "absent_peers": absent_peers(),
        "git_commit": _git_commit(),
    }


def _numpy_blas_name(np):
    """NumPy's build-time BLAS name (e.g. "scipy-openblas"), if it says."""
    try:
        config = np.show_config(mode="dicts")
        return config["Build Dependencies"]["blas"]["name"]
    except Exception:  # older NumPy: no dict mode
        return None
