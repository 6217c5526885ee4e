"""When softmax splits each head's keys across threads (Flash-Decoding), and into how many ranges.

One rule, read by both fast backends' ``softmax_forward`` and by
:class:`fastattn.KVCache`.  Pure Python; it imports nothing of fastattn, so
the kernels may import it.  Callers look the functions up on this module at
call time (``_policy.use_split_keys(...)``), so a test that replaces one
changes every caller alike.
"""

#: Softmax calls with at most this many queries are decode steps: the fast
#: backends split each head's keys across threads (Flash-Decoding), at any
#: number of keys.
SPLIT_KEYS_MAX_N_Q = 16

#: Fewest keys in one split (one work item's key range).
SPLIT_KEYS_MIN_KEYS = 512


def use_split_keys(n_q):
    """Whether a softmax call of ``n_q`` queries runs the split-key (decode) kernel.

    Parameters
    ----------
    n_q : int
        Queries per head.

    Returns
    -------
    bool
        ``n_q <= SPLIT_KEYS_MAX_N_Q``, whatever the number of keys: with so
        few rows the tiled kernel's GEMMs and key packing cost more than the
        split-key kernel's fused dots, and with few keys :func:`split_count`
        gives one range per head, a single work item, as the tiled kernel
        would.

    Notes
    -----
    Dao, Haziza, Massa & Sizov, "Flash-Decoding for long-context inference"
    (2023).
    """
    return n_q <= SPLIT_KEYS_MAX_N_Q


def split_count(batch, n_k, n_threads):
    """Key ranges per head for the split-key kernel.

    Enough for two work items per thread over the ``batch`` heads, none of
    fewer than ``SPLIT_KEYS_MIN_KEYS`` keys.

    Parameters
    ----------
    batch : int
        Heads (the product of the leading dims), >= 1.
    n_k : int
        Keys per head.
    n_threads : int
        Threads the call may use, >= 1.

    Returns
    -------
    int
        At least 1.
    """
    wanted = -(-2 * n_threads // batch)
    return max(1, min(wanted, n_k // SPLIT_KEYS_MIN_KEYS))
