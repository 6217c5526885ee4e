"""The one schema of a measured point: its grids (and, as they move here, its keys,
types and the environment record).  The bench, the report, the asv suite and the asv
reader all read these names from here; nothing else restates them."""

#: n of the default grid: 128 to 8192 (the report's scaling range).
DEFAULT_NS = (128, 256, 512, 1024, 2048, 4096, 8192)
#: Context lengths of the decode grid: 128 to 65536.
DECODE_NS = (128, 512, 2048, 8192, 32768, 65536)
#: n of the feature-map grid (the quality-against-cost frontier is drawn at these n).
FEATURE_MAP_NS = (4096, 16384)
#: FAVOR+ feature counts of the feature-map grid, as multiples of d_k.
FAVOR_MULTIPLES = (1, 4, 16, 64)
