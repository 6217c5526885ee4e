"""Build the Cython kernels of fastattn.

Every ``fastattn/_cython/*.pyx`` becomes an extension module; a new kernel only
adds its ``.pyx`` file.  Cython directives are set here, once.  Set
``FASTATTN_CYTHON_DEBUG=1`` to build with bounds and wrap-around checks on.
OpenMP is used when the compiler accepts ``-fopenmp``; otherwise the
extensions build serially (``prange`` runs as a plain loop).
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
DEBUG = os.environ.get("FASTATTN_CYTHON_DEBUG", "") not in ("", "0")


OPENMP_PROBE = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
PLAIN_PROBE = "int main(void){return 0;}\n"


def _compiler_accepts(flags, source=OPENMP_PROBE):
    """Whether the C compiler builds and links ``source`` (default: a tiny OpenMP program) with ``flags``."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or sys.platform == "win32":
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "probe.c")
        src.write_text(source)
        cmd = [cc, *flags, str(src), "-o", str(Path(tmp, "probe"))]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def cython_extensions():
    """One Extension per .pyx under fastattn/_cython, with the shared flags."""
    openmp = ["-fopenmp"] if _compiler_accepts(["-fopenmp"]) else []
    # '#pragma omp simd' in the softmax row kernels, also in a serial build.
    simd = ["-fopenmp-simd"] if not openmp and _compiler_accepts(["-fopenmp-simd"], PLAIN_PROBE) else []
    # -fno-math-errno lets gcc vectorise exp (libmvec), -fno-trapping-math lets
    # it if-convert the branch of the elu feature map; neither changes inf/NaN
    # arithmetic.  No -ffast-math: it would assume there is no inf or NaN and
    # break the causal masks and the propagation of non-finite inputs.
    compile_args = ["-O3", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math"]
    # Loops start on a 64-byte line: the register-blocked products' inner loops
    # (~120 bytes) then span two lines of the instruction fetch, not three, however
    # the code before them moves.  An unrelated edit that left them at 48 bytes past
    # a line made the softmax tile 3-4 % slower (A/B in one process, AMD Zen 3).
    if _compiler_accepts(["-falign-loops=64"], PLAIN_PROBE):
        compile_args.append("-falign-loops=64")
    compile_args += openmp + simd
    if DEBUG:
        compile_args = ["-O0", "-g"] + openmp
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    extensions = []
    # The C headers every kernel includes (through _microkernel.pxd): an edit to
    # one rebuilds the extensions, which setuptools does not see otherwise.
    headers = [str(h.relative_to(HERE)) for h in sorted((HERE / "fastattn" / "_cython").glob("*.h"))]
    for pyx in sorted((HERE / "fastattn" / "_cython").glob("*.pyx")):
        name = "fastattn._cython." + pyx.stem
        extensions.append(
            Extension(
                name,
                [str(pyx.relative_to(HERE))],
                depends=headers,
                include_dirs=[np.get_include()],
                define_macros=macros,
                extra_compile_args=compile_args,
                extra_link_args=openmp,
                libraries=["m"],
            )
        )
    return extensions


def cythonize_all():
    from Cython.Build import cythonize

    directives = {
        "language_level": 3,
        "boundscheck": DEBUG,
        "wraparound": DEBUG,
        "initializedcheck": DEBUG,
        "cdivision": not DEBUG,
        "embedsignature": True,
    }
    return cythonize(
        cython_extensions(),
        compiler_directives=directives,
        compile_time_env={"FASTATTN_DEBUG": DEBUG},
        nthreads=os.cpu_count() or 1,
    )


#: Compiled extensions kept between builds, by the hash of what they are compiled from.
BUILD_CACHE = HERE / "build" / "fastattn-extensions"

#: The block in which Cython records the build's paths (pip's temporary environment):
#: left out of the hash, since it changes at every install and not the code.
_CYTHON_METADATA = re.compile(rb"/\* BEGIN: Cython Metadata.*?END: Cython Metadata \*/", re.S)


class CachedBuildExt(build_ext):
    """``build_ext`` that reuses an extension compiled before from the same inputs.

    pip builds every install, editable ones included, in a fresh environment, so
    setuptools' timestamps always say "rebuild": each ``pip install -e ".[extra]"``
    recompiled every kernel (about 1-2 minutes).  The key is the hash of the C sources
    (less Cython's record of the build's paths), the headers, the flags, the Python ABI
    and NumPy's version; the cache lives in ``build/`` of the checkout.
    """

    def _key(self, ext):
        digest = hashlib.sha256()
        for path in [*ext.sources, *ext.depends]:
            digest.update(_CYTHON_METADATA.sub(b"", Path(path).read_bytes()))
        for part in (ext.extra_compile_args, ext.extra_link_args, ext.define_macros,
                     sys.implementation.cache_tag, np.__version__, DEBUG):
            digest.update(repr(part).encode())
        return digest.hexdigest()[:20]

    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        cached = BUILD_CACHE / f"{ext.name}-{self._key(ext)}{target.suffix}"
        if cached.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # A fresh mtime: an editable install copies the build into the checkout only
            # when it is newer than the file there, so the cached file's own (older) time
            # kept the extension of the last build, not of these sources.
            shutil.copy(cached, target)
            return
        super().build_extension(ext)
        BUILD_CACHE.mkdir(parents=True, exist_ok=True)
        shutil.copy2(target, cached)


# The extensions compile side by side, one a core (softmax and linear take most of the time).
setup(ext_modules=cythonize_all(), cmdclass={"build_ext": CachedBuildExt},
      options={"build_ext": {"parallel": os.cpu_count() or 1}})
