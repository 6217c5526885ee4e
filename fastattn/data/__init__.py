"""Real attention activations: a slice shipped with the package, or a full set on disk.

The shipped slice holds every layer of all-MiniLM-L6-v2 (heads 0 and 1, the
128-token window); its provenance is in ``minilm_l6_n128_heads01.json`` beside it.
"""

import json
from importlib import resources
from pathlib import Path

import numpy as np

SHIPPED = "minilm_l6_n128_heads01.npz"
_ARRAYS = ("q", "k", "v", "context")


def load_minilm(path=None):
    """Queries, keys, values and the model's attention output of all-MiniLM-L6-v2.

    Parameters
    ----------
    path : str or Path, optional
        An ``.npz`` with arrays ``q``, ``k``, ``v``, ``context`` of shape
        ``(layers, heads, n, d)``, such as ``minilm_l6_qkv_n512.npz``.
        Default: the slice shipped with fastattn, shape ``(6, 2, 128, 32)``.

    Returns
    -------
    dict of str to ndarray
        ``q``, ``k``, ``v`` (projection outputs, unscaled) and ``context``
        (``softmax(q kᵀ / sqrt(d)) v`` as the model computed it), float32.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the file is not an ``.npz`` archive, lacks one of the arrays, their
        shapes disagree or are empty, or an array is not floating point or has
        a value that is not finite in float32.
    """
    if path is None:
        with resources.as_file(resources.files(__name__) / SHIPPED) as shipped:
            return _read(shipped)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no MiniLM activations file at {path}")
    return _read(path)


def _read(path):
    try:
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not an .npz archive of MiniLM activations ({exc})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} holds a single array, not an .npz archive with "
                         f"arrays {list(_ARRAYS)}")
    with loaded as npz:
        missing = [name for name in _ARRAYS if name not in npz.files]
        if missing:
            raise ValueError(f"{path} lacks the arrays {missing}; it has {npz.files}")
        arrays = {name: npz[name] for name in _ARRAYS}
    shapes = {name: a.shape for name, a in arrays.items()}
    if len({a.shape for a in arrays.values()}) != 1 or arrays["q"].ndim != 4:
        raise ValueError(f"{path}: q, k, v, context must share one (layers, heads, n, d) shape, got {shapes}")
    if 0 in arrays["q"].shape:
        raise ValueError(f"{path}: the arrays are empty, shape {arrays['q'].shape}")
    for name, a in arrays.items():
        if a.dtype.kind != "f":
            raise ValueError(f"{path}: array {name} has dtype {a.dtype}; expected floating point "
                             "activations (float16, float32 or float64)")
        with np.errstate(over="ignore"):   # a float64 beyond float32's range: inf, refused
            arrays[name] = a = a.astype(np.float32, copy=False)
        bad = np.size(a) - np.count_nonzero(np.isfinite(a))
        if bad:
            raise ValueError(f"{path}: array {name} has {bad} "
                             "values that are not finite (NaN or inf) in float32")
    return arrays


def minilm_provenance():
    """Provenance of the shipped slice (model, licence, software, checksums), as a dict."""
    text = (resources.files(__name__) / SHIPPED.replace(".npz", ".json")).read_text()
    return json.loads(text)
