"""A read-only install: the package directory and HOME are not writable (another user, a container).

Numba then has nowhere to cache its kernels.  fastattn must still list its
backends, set threads and compute: the numba backend runs without its disk
cache (compiling in the process, with a warning) and ``backend="auto"``
passes over it.  The child runs in a private mount namespace (util-linux's
``unshare``) where the package directory and HOME are mounted read-only, so
even root cannot write there.
"""

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_close
from oracles import softmax_oracle

CHILD = textwrap.dedent(
    """
    import gc, sys, warnings
    import numpy as np
    import fastattn
    from numba.core.dispatcher import Dispatcher

    def numba_signatures():   # compiled (or loaded) by every Numba kernel in this process
        return sum(len(d.signatures) for d in gc.get_objects() if isinstance(d, Dispatcher))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = fastattn.available_backends()
    assert "numba" in names, (names, fastattn.unavailable_backends())
    assert any("without its disk cache" in str(w.message) and "NUMBA_CACHE_DIR" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    # Attributed to the call above (this -c script), not to a line of fastattn.
    assert all(w.filename == "<string>" for w in caught), [w.filename for w in caught]
    fastattn.set_num_threads(1)
    assert fastattn.get_num_threads()["numba"] == 1
    q = np.load(sys.argv[1])
    before = numba_signatures()
    auto = fastattn.softmax_attention(q, q, q)
    assert numba_signatures() == before, "auto ran (and compiled) the uncached numba kernels"
    out = fastattn.softmax_attention(q, q, q, backend="numba")
    np.save(sys.argv[2], np.stack([auto, out]))
    """
)



def _read_only_command(paths, argv):
    """``argv`` in a private mount namespace where every path of ``paths`` is read-only."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux's unshare, to mount the install read-only")
    mounts = " && ".join(f"mount --bind -o ro {shlex.quote(str(p))} {shlex.quote(str(p))}"
                         for p in paths)
    # As root a mount namespace; otherwise a user namespace that maps us to root.
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]
    return [unshare, *flags, "sh", "-c", f"{mounts} && exec {shlex.join(argv)}"]


def test_read_only_install_and_home_fall_back(tmp_path):
    pytest.importorskip("numba")
    import fastattn

    package = Path(fastattn.__file__).parent
    home = tmp_path / "home"
    home.mkdir()
    q = np.random.default_rng(8).standard_normal((3, 5))
    np.save(tmp_path / "q.npy", q)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR" and not k.startswith("XDG_")}
    env["HOME"] = str(home)
    probe = subprocess.run(
        _read_only_command([package, home], [sys.executable, "-c",
                           "import fastattn, os, sys; d = os.path.dirname(fastattn.__file__); "
                           "sys.exit(os.access(d, os.W_OK) or os.access(os.environ['HOME'], os.W_OK))"]),
        capture_output=True, text=True, env=env, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount the install read-only here: {probe.stderr[-500:]}")
    out_path = tmp_path / "out.npy"
    proc = subprocess.run(
        _read_only_command([package, home], [sys.executable, "-c", CHILD, str(tmp_path / "q.npy"),
                                             str(out_path)]),
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    auto, out = np.load(out_path)
    expected = softmax_oracle(q, q, q, False)
    assert_close(auto, expected)
    assert_close(out, expected)
