"""The one schema of a measured point (its fields, their types and the keys derived from
them), the grids and the environment record, for the bench, the report and the asv suite.
A results file is JSON lines (:data:`SCHEMA`), each a record of one of :data:`RECORD_TYPES`."""

SCHEMA = "fastattn.results/1"
RECORD_TYPES = ("environment", "roof", "point", "startup")
STATUSES = ("ok", "skipped", "error")

#: A point's attention, dtype and regime: "prefill", a whole sequence (n_q = n_k = n);
#: "decode", one generated token: one query against n keys, causal.
ATTENTIONS = ("softmax", "linear")
DTYPES = ("float32", "float64")
REGIMES = ("prefill", "decode")

#: The largest count (n, d, batch, ...) a record may hold: exact in a float64 for any reader.
MAX_COUNT = 2**53
COUNT, AMOUNT = "a positive int <= 2**53", "a finite number >= 0"
NAME, FLAG = "a name", "true or false"
STATUS = "one of " + ", ".join(STATUSES)
AMOUNTS, COUNTS = "a list of numbers >= 0", "a list of positive ints <= 2**53"

#: Every field of a point record, in the CSV's order: ``(name, type, roles)``; ``type`` is
#: what a results file must hold there (None: not checked); roles: ``k`` a key
#: (:data:`POINT_KEYS`), ``c`` a CSV column, ``s`` a summary field, ``r`` required.
POINT_FIELDS = (
    ("attention", NAME, "kcr"), ("backend", NAME, "kcsr"), ("peer", FLAG, "c"),
    ("causal", FLAG, "kcr"), ("dtype", NAME, "kcr"), ("batch", COUNT, "kcr"),
    ("heads", COUNT, "kcr"), ("n_q", COUNT, "kcr"), ("n_k", COUNT, "kcr"),
    ("d_k", COUNT, "kcr"), ("d_v", COUNT, "kcr"), ("feature_map", NAME, "kc"),
    ("threads", COUNT, "kcr"), ("status", STATUS, "csr"), ("reason", None, "cs"),
    ("median_s", AMOUNT, "cs"), ("min_s", AMOUNT, "cs"), ("max_s", AMOUNT, "cs"),
    ("repeats", COUNT, "c"),
    ("number", COUNT, "c"), ("flops", AMOUNT, "c"), ("gflops", AMOUNT, "cs"),
    ("roof_gflops", AMOUNT, "c"), ("roof_fraction", AMOUNT, "cs"), ("peak_bytes", AMOUNT, "cs"),
    ("memory_method", None, "c"), ("peak_bytes_tracemalloc", AMOUNT, "c"),
    ("max_abs_err", AMOUNT, "cs"), ("check_n", COUNT, "cs"), ("check_ok", FLAG, "cs"),
    ("run_id", None, "c"), ("regime", NAME, "kc"), ("num_features", COUNT, "kc"),
    ("held_bytes", AMOUNT, "c"), ("roof_blas", None, "c"), ("roof_shape", COUNTS, "c"),
    ("rounds", None, "c"), ("roof_fraction_paired", None, "cs"),
    ("check_tol", AMOUNT, ""), ("load_avg_1m", AMOUNT, ""), ("started", AMOUNT, ""),
    ("warmup_s", AMOUNT, ""), ("times_s", AMOUNTS, ""),
    ("limit", NAME, "cs"), ("limit_fraction", AMOUNT, "cs"), ("limit_s", AMOUNT, ""),
    ("peak_gflops", AMOUNT, "c"), ("floor_gbs", AMOUNT, "c"), ("floor_bytes", COUNT, ""),
    ("limit_fraction_paired", None, "cs"),
    ("compile_s", AMOUNT, "c"), ("peer_path", NAME, "c"),  # a peer's compile, what it ran
)
#: Fields of roof and startup records beyond a point's.
OTHER_FIELDS = (("gelem_s", AMOUNT), ("shape", COUNTS), ("numpy_min_s", AMOUNT),
                ("numpy_median_s", AMOUNT), ("gbs", AMOUNT), ("bytes", COUNT))

#: What each known field of a point, roof or startup record must hold.
FIELD_TYPES = {name: kind for name, kind, *_ in POINT_FIELDS + OTHER_FIELDS if kind}
#: Keys that identify a point: two records with equal values measure the same thing.
POINT_KEYS = tuple(name for name, _, roles in POINT_FIELDS if "k" in roles)
#: Columns of the CSV written beside a results file, in order.
CSV_COLUMNS = tuple(name for name, _, roles in POINT_FIELDS if "c" in roles)
#: Fields of a row of the JSON summary, beside ``n`` and ``vs_baseline``.
SUMMARY_FIELDS = tuple(name for name, _, roles in POINT_FIELDS if "s" in roles)
#: What one table of the bench shares: the points that differ only in n and backend.
CONFIG_KEYS = tuple(k for k in POINT_KEYS if k not in ("backend", "n_q", "n_k"))
#: What one row of the versus table compares: the points that differ only in backend.
VERSUS_KEYS = tuple(k for k in POINT_KEYS if k != "backend")
#: What one curve of the report shares: the machine and a point's keys but n.
CURVE_KEYS = ("machine",) + tuple(k for k in POINT_KEYS if k not in ("n_q", "n_k"))

#: Fields each record type must hold (not null).
REQUIRED = {"point": tuple(name for name, _, roles in POINT_FIELDS if "r" in roles),
            "roof": ("dtype",), "startup": ("backend", "threads", "min_s", "median_s"),
            "environment": ()}
#: Fields a point with status "ok" must hold.
REQUIRED_OK = ("median_s",)
#: The regime of a point record that does not say (files written before regimes).
DEFAULT_REGIME = "prefill"


def point_key(record):
    """The identity of a point record: its :data:`POINT_KEYS` values (``regime`` defaulted)."""
    return tuple(record.get(k, DEFAULT_REGIME if k == "regime" else None) for k in POINT_KEYS)


def roof_library(probe):
    """``(blas, via)`` of a roof record, e.g. ``("OpenBLAS", "NumPy")`` (old files too)."""
    label = probe.get("blas") or ""
    via = {"numpy": "NumPy", "torch": "torch"}.get(probe.get("library"), "")
    if " through " in label:
        via = via or label.split(" through ")[1].split()[0]
    return probe.get("blas_name") or (label.split() or ["BLAS"])[0], via


# ------------------------------------------------------------------------------ grids
#: n of the default grid: 128 to 8192 (the report's scaling range).
DEFAULT_NS = (128, 256, 512, 1024, 2048, 4096, 8192)
#: Context lengths of the decode grid: 128 to 65536.
DECODE_NS = (128, 512, 2048, 8192, 32768, 65536)
#: n of the feature-map grid (the quality-against-cost frontier is drawn at these n).
FEATURE_MAP_NS = (4096, 16384)
#: FAVOR+ feature counts of the feature-map grid, as multiples of d_k.
FAVOR_MULTIPLES = (1, 4, 16, 64)

#: The asv suite's grid (benchmarks/): n in powers of 4; decode at DECODE_NS.
ASV_NS = (256, 1024, 4096, 16384)
ASV_FEATURE_MAP_NS = (1024, 4096, 16384)
ASV_D, ASV_BATCH, ASV_HEADS, ASV_DECODE_HEADS = 64, 1, 1, 8

# ------------------------------------------------------------------ environment record
#: The fields of an environment record as ``(label, dotted path)``, in a report's order.
ENVIRONMENT_FIELDS = (
    ("CPU", "cpu_model"), ("CPU features", "cpu_flags"), ("Cores (logical)", "cores_logical"),
    ("Cores usable by this process", "cores_usable"), ("Threads used", "threads"),
    ("Why this thread count", "threads_reason"), ("Thread counts in force", "thread_counts"),
    ("Thread variables set", "thread_env"),
    ("BLAS", "blas"), ("NumPy's BLAS (build)", "numpy_config_blas"),
    ("Memory", "memory_total_bytes"), ("Operating system", "platform"),
    ("Host", "hostname"), ("Python", "python"), ("NumPy", "versions.numpy"),
    ("SciPy", "versions.scipy"), ("Numba", "versions.numba"),
    ("Cython (compiler, needed only to build)", "versions.cython"),
    ("threadpoolctl", "versions.threadpoolctl"), ("PyTorch", "versions.torch"),
    ("fastattn", "versions.fastattn"), ("fastattn commit", "git_commit"),
    ("asv commit", "commit"), ("Backends available", "backends"),
    ("Cython products' instruction set", "cython_products"),
    ("Peers available", "peers"),
)
#: Every top-level key of an environment record: ENVIRONMENT_FIELDS', then those listed after.
ENVIRONMENT_KEYS = tuple(dict.fromkeys(path.split(".")[0] for _, path in ENVIRONMENT_FIELDS)) + (
    "memory_available_bytes", "python_implementation", "unavailable_backends", "absent_peers",
    "run_id", "source", "machine", "date", "env_name", "arch", "env_vars", "chosen")
