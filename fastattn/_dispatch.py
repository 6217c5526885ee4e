"""Shape-based choices: which backend ``backend="auto"`` runs, and when softmax splits keys.

Pure Python, no backend imported here: the rules read only the call's shape.
"""

#: Softmax calls with at most this many queries are decode steps: the
#: fast backends split each head's keys across threads (Flash-Decoding).
SPLIT_KEYS_MAX_N_Q = 16

#: Fewest keys in one split (one work item's key range).
SPLIT_KEYS_MIN_KEYS = 512


def use_split_keys(n_q, n_k):
    """Whether a softmax call of ``n_q`` queries over ``n_k`` keys runs the split-key kernel.

    Few queries (``n_q <= SPLIT_KEYS_MAX_N_Q``) over at least two splits'
    worth of keys (``n_k >= 2 · SPLIT_KEYS_MIN_KEYS``): below that one work
    item per head is as fast and the tiled kernel runs.

    Returns
    -------
    bool
    """
    return n_q <= SPLIT_KEYS_MAX_N_Q and n_k >= 2 * SPLIT_KEYS_MIN_KEYS


def split_count(batch, n_k, n_threads):
    """Key ranges per head for the split-key kernel.

    Enough for two work items per thread over the ``batch`` heads, none of
    fewer than ``SPLIT_KEYS_MIN_KEYS`` keys.

    Returns
    -------
    int
        At least 1.
    """
    wanted = -(-2 * n_threads // batch)
    return max(1, min(wanted, n_k // SPLIT_KEYS_MIN_KEYS))
