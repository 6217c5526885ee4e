"""Arrays that start on a cache line, for the kernels' buffers and outputs.

A 64-byte vector load or store that straddles two cache lines costs two, so
the buffers the AVX-512 loops of the prefill kernels write row after row
(scores, features, states, outputs) start on a 64-byte boundary; NumPy's
allocator guarantees only 16.  It is a speed measure, not a promise of the
API: the outputs of the decode kernels (softmax with few queries, linear
attention's one-step recurrence), the causal state returned (a copy of the
last segment's) and float16 results (converted after the call) are plain
NumPy arrays.
"""

import math

import numpy as np

#: Bytes of a cache line, the boundary :func:`aligned_empty` starts on.
ALIGNMENT = 64


def aligned_empty(shape, dtype):
    """An uninitialised C-ordered array of ``shape`` and ``dtype`` whose first
    element (when it has one) lies on a 64-byte boundary: a view into a buffer
    64 bytes longer."""
    dtype = np.dtype(dtype)
    shape = tuple(shape) if np.iterable(shape) else (shape,)
    # math.prod and one ndarray over the buffer: this runs several times a
    # kernel call, and np.prod with a slice, view and reshape took ~10 us.
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    return np.ndarray(shape, dtype, raw, -raw.ctypes.data % ALIGNMENT)
