"""The evaluation sets of the model study, read offline from installed packages.

gensim's wheel ships the Lee et al. (2005) document-similarity set in
``gensim/test/test_data/`` (M. D. Lee, B. Pincombe, M. Welsh, "An empirical
evaluation of models of text document similarity", CogSci 2005):

* ``lee.cor``: 50 news documents, one a line (ISO-8859-1);
* ``similarities0-1.txt``: a 50×50 matrix of mean human judgements in [0, 1],
  of which the upper triangle holds the 1,225 judged pairs;
* ``lee_background.cor``: 300 further news documents, unlabelled.

The files are read from gensim's folder, found without importing gensim.
"""

from pathlib import Path

import numpy as np

from ._extra import INSTALL, MissingExtraError

#: Number of documents of ``lee.cor`` and the side of ``similarities0-1.txt``.
LEE_DOCUMENTS = 50
#: A texts file larger than this is refused (bytes); pass ``max_bytes`` to allow more.
MAX_BYTES = 16 * 2 ** 20
#: A texts file with more texts than this is refused; pass ``max_texts`` to allow more.
MAX_TEXTS = 100_000


def gensim_test_data():
    """The folder ``gensim/test/test_data`` of the installed gensim, found without importing it.

    Raises
    ------
    MissingExtraError
        If gensim is not installed (the message names the ``model`` extra).
    FileNotFoundError
        If the folder is not in the installed gensim.
    """
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(
            "the Lee et al. (2005) evaluation set is read from the files of the package "
            f"'gensim', which is not installed; fastattn's model extra installs it, {INSTALL}")
    for root in spec.submodule_search_locations:
        folder = Path(root) / "test" / "test_data"
        if folder.is_dir():
            return folder
    raise FileNotFoundError(
        f"gensim is installed at {list(spec.submodule_search_locations)} but has no "
        "test/test_data folder (the Lee files ship in gensim's wheel)")


def read_texts(path, *, encoding=None, max_bytes=MAX_BYTES, max_texts=MAX_TEXTS):
    """The texts of a file, one a line, blank lines skipped.

    Parameters
    ----------
    path : str or Path
    encoding : str, optional
        Default UTF-8 (strict); ``lee.cor`` is ``"latin-1"``.
    max_bytes, max_texts : int
        Larger files, or files with more texts, are refused.

    Returns
    -------
    list of str

    Raises
    ------
    ValueError
        Naming the file: it is empty (no text on any line), not text (NUL
        bytes, or not decodable as ``encoding``), or too long.
    FileNotFoundError
        If it does not exist.
    """
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"texts file {path} is too long: {size} bytes, more than max_bytes="
                         f"{max_bytes}")
    data = path.read_bytes()
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ValueError(f"texts file {path} is not text: it holds NUL bytes (first at byte "
                         f"{nul})")
    try:
        text = data.decode(encoding or "utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"texts file {path} is not {encoding or 'UTF-8'} text ({exc}); "
                         "pass encoding=") from exc
    texts = [line.strip() for line in text.splitlines()]
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError(f"texts file {path} is empty: no line holds any text")
    if len(texts) > max_texts:
        raise ValueError(f"texts file {path} is too long: {len(texts)} texts, more than "
                         f"max_texts={max_texts}")
    return texts


def lee_documents():
    """The 50 documents of ``lee.cor``, in order (the rows of :func:`lee_similarities`)."""
    docs = read_texts(gensim_test_data() / "lee.cor", encoding="latin-1")
    if len(docs) != LEE_DOCUMENTS:
        raise ValueError(f"{gensim_test_data() / 'lee.cor'}: expected {LEE_DOCUMENTS} "
                         f"documents, found {len(docs)}")
    return docs


def lee_similarities():
    """The human judgements ``(50, 50)`` of ``similarities0-1.txt``, symmetric, 1 on the diagonal.

    The file holds the upper triangle; :func:`lee_pairs` gives the 1,225 pairs.
    """
    path = gensim_test_data() / "similarities0-1.txt"
    sim = np.loadtxt(path, dtype=np.float64)
    if sim.shape != (LEE_DOCUMENTS, LEE_DOCUMENTS) or not np.isfinite(sim).all():
        raise ValueError(f"{path}: expected a finite {LEE_DOCUMENTS}x{LEE_DOCUMENTS} matrix, "
                         f"got shape {sim.shape}")
    upper = np.triu(sim, 1)
    return upper + upper.T + np.eye(LEE_DOCUMENTS)


def lee_pairs():
    """``(i, j, judgement)`` of the 1,225 judged pairs ``i < j`` of :func:`lee_documents`."""
    i, j = np.triu_indices(LEE_DOCUMENTS, 1)
    return i, j, lee_similarities()[i, j]


def background_documents():
    """The documents of ``lee_background.cor`` (300), duplicates dropped, in file order."""
    docs = read_texts(gensim_test_data() / "lee_background.cor", encoding="latin-1")
    return list(dict.fromkeys(docs))


def background_split(n_calibration=150, *, seed=0, texts=None):
    """Calibration and held-out texts that never overlap, split the same way every time.

    Parameters
    ----------
    n_calibration : int, default 150
        Texts for fitting; the rest are held out.
    seed : int, default 0
        The permutation (``numpy.random.default_rng(seed)``).
    texts : list of str, optional
        Default :func:`background_documents` (deduplicated ``lee_background.cor``).

    Returns
    -------
    calibration, held_out : list of str, list of str
    """
    docs = list(dict.fromkeys(background_documents() if texts is None else texts))
    if not 1 <= n_calibration < len(docs):
        raise ValueError(f"n_calibration must be in [1, {len(docs) - 1}] for {len(docs)} "
                         f"distinct texts, got {n_calibration}")
    order = np.random.default_rng(seed).permutation(len(docs))
    return ([docs[i] for i in order[:n_calibration]],
            [docs[i] for i in order[n_calibration:]])
