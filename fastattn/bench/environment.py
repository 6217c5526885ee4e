"""What a measurement ran on: CPU, cores, load, threads, BLAS, library versions."""

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

from .._threads import default_num_threads
from .peers import PEERS, _version, absent_peers, available_peers


def load_avg_1m():
    """The 1-minute load average, or None where the system has none."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def idle_cores(interval_s=0.5):
    """Usable cores other work left idle over ``interval_s`` seconds (at least 1)."""
    import psutil
    busy = sum(psutil.cpu_percent(interval=interval_s, percpu=True)) / 100
    return max(1, min(default_num_threads(), round(psutil.cpu_count() - busy)))


def _cpuinfo(prefix):
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            return next((line.split(":", 1)[1].strip() for line in handle
                         if line.lower().startswith(prefix)), None)
    except OSError:
        return None


def _cpu_flags():
    flags = set((_cpuinfo("flags") or "").split())
    return [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni")
            if f in flags] if flags else None


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
    """BLAS libraries loaded here, as threadpoolctl describes them."""
    from threadpoolctl import threadpool_info
    keys = ("internal_api", "version", "architecture", "threading_layer", "num_threads",
            "filepath", "prefix")
    return [{key: info.get(key) for key in keys}
            for info in threadpool_info() if info.get("user_api") == "blas"]


def _cython_products():
    """The Cython kernels' products' instruction set: "avx512", "avx2", or None (BLAS)."""
    try:
        from fastattn._cython.softmax import _build_features
    except ImportError:
        return None
    return _build_features()["tile_products"]


def collect(threads=None):
    """This machine and software, as an environment record with the run's ``threads``."""
    import numpy as np
    import psutil

    import fastattn
    memory = psutil.virtual_memory()
    return {
        "cpu_model": _cpuinfo("model name") or platform.processor() or platform.machine(),
        "cpu_flags": _cpu_flags(),
        "cores_logical": os.cpu_count(),
        "cores_usable": default_num_threads(),
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
                        for name in ("scipy", "numba", "Cython", "threadpoolctl")},
                     **{name: _version(name) for peer in PEERS.values() if peer.name != "numpy"
                        for name in peer.distributions or peer.modules}},
        "backends": list(fastattn.available_backends()),
        "cython_products": _cython_products(),
        "unavailable_backends": fastattn.unavailable_backends(),
        "peers": list(available_peers()),
        "absent_peers": absent_peers(),
        "git_commit": _git_commit(),
    }


def roof_blas(library="numpy"):
    """``{"blas": label, "blas_name": name}`` of the BLAS ``library`` runs on."""
    if library == "torch":
        import torch
        line = next((x for x in torch.__config__.show().splitlines()
                     if "Math Kernel Library Version" in x), "")
        version = line.split("Version", 1)[1].split("-")[0].strip() if line else ""
        name = "MKL" if torch.backends.mkl.is_available() else "BLAS"
        return {"blas": f"{name} {version}".strip() + f" through torch {torch.__version__}",
                "blas_name": name}
    import numpy as np
    found = [b for b in blas_info() if "numpy" in str(b.get("filepath") or "")] or blas_info()
    info = found[0] if found else {}
    name = {"openblas": "OpenBLAS", "mkl": "MKL", "blis": "BLIS"}.get(
        info.get("internal_api"), info.get("internal_api") or "BLAS")
    text = f"{name} {info.get('version') or ''}".strip() + (
        f" ({info['architecture']})" if info.get("architecture") else "")
    return {"blas": f"{text} through NumPy {np.__version__}", "blas_name": name}


def _numpy_blas_name(np):  # NumPy's build-time BLAS name (e.g. "scipy-openblas")
    try:
        config = np.show_config(mode="dicts")
        return config["Build Dependencies"]["blas"]["name"]
    except Exception:  # older NumPy: no dict mode
        return None
