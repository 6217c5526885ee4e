"""When softmax splits each head's keys across threads (Flash-Decoding), into how many ranges,
and when a one-query step streams K and V side by side.

The split is read by both fast backends' ``softmax_forward`` and by
:class:`fastattn.KVCache`; the one pass by the Cython kernel.  Pure Python; it
imports nothing of fastattn, so the kernels may import it.  Callers look the
functions up on this module at call time (``_policy.use_split_keys(...)``), so
a test that replaces one changes every caller alike.
"""

import glob

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


#: The last-level cache's bytes where the CPU's cannot be read (Linux sysfs).
DEFAULT_CACHE_BYTES = 32 * 2**20
#: The size files of cpu0's caches in Linux's sysfs ("48K", "32768K", "1M").
CACHE_SIZE_FILES = "/sys/devices/system/cpu/cpu0/cache/index*/size"

_cache_bytes = None


def last_level_cache_bytes():
    """Bytes of the CPU's last-level cache: the largest cache of cpu0 in Linux's sysfs, read
    once, or :data:`DEFAULT_CACHE_BYTES` where there is none.

    Returns
    -------
    int
    """
    global _cache_bytes
    if _cache_bytes is None:
        sizes = []
        for index in glob.glob(CACHE_SIZE_FILES):
            try:
                with open(index, encoding="ascii") as handle:
                    text = handle.read().strip().upper()
                unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * unit)
            except (OSError, ValueError):
                continue
        _cache_bytes = max(sizes, default=0) or DEFAULT_CACHE_BYTES
    return _cache_bytes


def pipelined_pass(kv_bytes):
    """Whether a one-query split-key step takes each key block's scores in the pass that adds
    the ``p v`` of the block before, so that K and V stream side by side.

    Parameters
    ----------
    kv_bytes : int
        Bytes of the keys and values the step reads.

    Returns
    -------
    bool
        ``kv_bytes >= last_level_cache_bytes()``: from memory the one pass is faster;
        from the cache, on two threads, the two passes are.  Measured side by side (Zen 4
        with 32 MiB of L3, H = 8, d = 64, float32, two threads, the two builds
        alternating): at 32768 keys (134 MB) the one pass read at 92 % of the rate of a
        read of the same bytes, the two passes at 78-85 %; at 4096 keys (16.8 MB) the
        bench's fastest repeat took 148-159 µs in one pass against 137-138 µs in two.
        8192 keys (32 MiB) take the one pass.
    """
    return kv_bytes >= last_level_cache_bytes()
