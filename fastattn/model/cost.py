"""What the whole model costs: its forward pass per attention, against sentence-transformers.

Each configuration of the study runs :meth:`MiniLM.encode_ids` on the same
texts, cut to ``n`` tokens (texts shorter than ``n`` are left out, so every
text costs ``n``), and sentence-transformers' own ``encode`` (PyTorch, the
model's reference implementation) runs the same texts with ``max_seq_length =
n`` in the same process, alternating round by round, with the threads of
NumPy's BLAS, fastattn's backends and PyTorch fixed and equal.  The fastest
round of each is kept: on a shared machine only times taken side by side
mean anything.
"""

import time
import warnings

import numpy as np


def texts_of_length(model, texts, n, count):
    """Token ids of the first ``count`` of ``texts`` with at least ``n`` tokens, cut to ``n``
    ([SEP] kept last), and the texts themselves; ValueError when too few are that long."""
    with warnings.catch_warnings():   # long texts are cut: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        ids = model.tokenize(texts)
    chosen = [i for i, t in enumerate(ids) if len(t) >= n][:count]
    if len(chosen) < count:
        raise ValueError(f"only {len(chosen)} of {len(texts)} texts have {n} tokens; "
                         f"{count} are needed")
    return [np.append(ids[i][:n - 1], ids[i][-1]) for i in chosen], [texts[i] for i in chosen]


def _fastest(call, repeats):
    """Seconds of the fastest of ``repeats`` calls, and its attention's seconds by kind."""
    best, attention = np.inf, {}
    for _ in range(repeats):
        timings = {}
        t0 = time.perf_counter()
        call(timings)
        seconds = time.perf_counter() - t0
        if seconds < best:
            best, attention = seconds, timings
    return best, attention


def forward_seconds(model, texts, configurations, *, n=128, count=16, threads=1, rounds=3,
                    repeats=2, sentence_transformers=True, attention_seconds=None):
    """Seconds per text of the forward pass, fastest of ``rounds`` alternating rounds.

    Parameters
    ----------
    model : MiniLM
    texts : list of str
        Candidates; the first ``count`` with at least ``n`` tokens are used.
    configurations : dict
        ``{name: attention=}`` (see :func:`fastattn.model.study.default_configurations`).
    n, count : int
        Tokens per text, and texts per call.
    threads : int
        Threads of BLAS, fastattn and PyTorch, fixed for the run.
    sentence_transformers : bool
        Also time ``SentenceTransformer.encode`` on the same texts (skipped,
        with None, when the package is not installed).
    attention_seconds : dict, optional
        Filled with ``{name: {kind: seconds per text}}``: the attention calls of each
        kind (``"softmax"``, ``"linear"``) within each configuration's fastest call
        (``MiniLM.encode_ids(timings=)``).

    Returns
    -------
    dict
        ``{name: seconds per text}``, with ``"sentence-transformers"`` when timed.
    """
    import threadpoolctl

    import fastattn

    ids, chosen = texts_of_length(model, texts, n, count)
    calls = {name: (lambda timings, a=attention: model.encode_ids(ids, a, timings=timings))
             for name, attention in configurations.items()}
    if sentence_transformers:
        st = _sentence_transformer(model, n, threads)
        if st is not None:
            calls["sentence-transformers"] = lambda timings: st.encode(
                chosen, batch_size=count, normalize_embeddings=True, convert_to_numpy=True)
    best = {name: (np.inf, {}) for name in calls}
    previous = fastattn.get_num_threads()["requested"]
    with threadpoolctl.threadpool_limits(threads):
        fastattn.set_num_threads(threads)
        try:
            for call in calls.values():   # compile, load, warm the caches
                call({})
            for _ in range(rounds):
                for name, call in calls.items():
                    best[name] = min(best[name], _fastest(call, repeats), key=lambda b: b[0])
        finally:
            if previous is not None:
                fastattn.set_num_threads(previous)
    if attention_seconds is not None:
        attention_seconds.update({name: {kind: s / count for kind, s in a.items()}
                                  for name, (_, a) in best.items() if name in configurations})
    return {name: seconds / count for name, (seconds, _) in best.items()}


def costs(model, texts, configurations, ns, **options):
    """``(seconds, attention)``: :func:`forward_seconds` at each of ``ns`` tokens,
    ``{n: {name: s}}``, and its ``attention_seconds``, ``{n: {name: {kind: s}}}``."""
    seconds, attention = {}, {}
    for n in ns:
        attention[n] = {}
        seconds[n] = forward_seconds(model, texts, configurations, n=n,
                                     attention_seconds=attention[n], **options)
    return seconds, attention


def _sentence_transformer(model, n, threads):
    """sentence-transformers' model of the same files, truncating at ``n``; None if absent."""
    try:
        import sentence_transformers
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    st = sentence_transformers.SentenceTransformer(str(model.path), device="cpu")
    st.max_seq_length = n
    return st
