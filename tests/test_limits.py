"""The machine's limits (fastattn.bench.limits): the roofline arithmetic on records made by
hand, and the probes' records (never their speed)."""

import pytest

from fastattn.bench import limits
from fastattn.bench.flops import attention_flops

SOFTMAX_DECODE = dict(attention="softmax", regime="decode", dtype="float32", batch=1, heads=8,
                      n_q=1, n_k=8192, d_k=64, d_v=64)
RECORDS = [{"probe": "peak", "dtype": "float32", "gflops": 100.0},
           {"probe": "peak", "dtype": "float32", "gflops": 80.0},   # the slower library
           {"probe": "peak", "dtype": "float64", "gflops": 50.0},
           {"probe": "floor", "bytes": 2**20, "gbs": 50.0},
           {"probe": "floor", "bytes": 2**25, "gbs": 10.0}]


def test_softmax_ceiling_counts_the_products_against_the_extra_operations():
    assert limits.softmax_ceiling(64) == pytest.approx(128 / 140)
    assert limits.softmax_ceiling(128) > limits.softmax_ceiling(64) > limits.softmax_ceiling(32)


def test_linear_ceiling_counts_the_products_against_the_map():
    # non-causal: 2 n d^2 multiply-adds a head over the 2 n d elements of q and k mapped
    flops = attention_flops("linear", 512, 512, 32, 32, causal=False)
    map_slots = limits.LINEAR_ELU_OPS * (512 + 512) * 32
    assert limits.linear_ceiling(32) == pytest.approx((flops / 2) / (flops / 2 + map_slots))
    assert limits.linear_ceiling(128) > limits.linear_ceiling(64) > limits.linear_ceiling(32)


def test_point_bytes_are_the_inputs_and_the_output_once():
    # decode: q (64) + out (64) + K and V of 8192 keys (8192 * 128), 8 heads, 4 bytes
    assert limits.point_bytes(SOFTMAX_DECODE) == 8 * 4 * (128 + 8192 * 128)
    prefill = dict(SOFTMAX_DECODE, regime="prefill", n_q=1024, n_k=1024, d_v=32)
    assert limits.point_bytes(prefill) == 8 * 4 * (1024 * 96 + 1024 * 96)
    # a linear decode step: one token in and out, its state of D = 128 features read and written
    step = dict(SOFTMAX_DECODE, attention="linear")
    assert limits.point_bytes(step, feature_dim=128) == 8 * 4 * (2 * 128 + 2 * 128 * 65)


def test_a_decode_point_is_bound_by_the_floor_nearest_its_size():
    nbytes = limits.point_bytes(SOFTMAX_DECODE)   # about 2**25
    fields = limits.limit_fields(SOFTMAX_DECODE, 1e6, nbytes, 4e-3, RECORDS)
    assert fields["limit"] == "floor" and fields["floor_bytes"] == 2**25
    assert fields["limit_s"] == pytest.approx(nbytes / 10e9)
    assert fields["limit_fraction"] == pytest.approx(nbytes / 10e9 / 4e-3)


def test_a_prefill_point_is_bound_by_the_fastest_peak_of_its_dtype():
    spec = dict(SOFTMAX_DECODE, regime="prefill", n_q=4096, n_k=4096, dtype="float64")
    flops = 2 * 4096 * 4096 * 128 * 8
    fields = limits.limit_fields(spec, flops, limits.point_bytes(spec), 1.0, RECORDS)
    assert fields["limit"] == "peak" and fields["peak_gflops"] == 50.0
    assert fields["limit_fraction"] == pytest.approx(flops / 50e9)


def test_the_limits_of_the_points_thread_count_are_used():
    records = [dict(r, threads=1) for r in RECORDS] + [dict(r, threads=2, gflops=200.0)
                                                      for r in RECORDS if r["probe"] == "peak"]
    spec = dict(SOFTMAX_DECODE, regime="prefill", n_q=4096, n_k=4096)
    one = limits.limit_fields(spec, 1e12, 1, 10.0, records, threads=1)
    assert one["peak_gflops"] == 100.0
    assert limits.limit_fields(spec, 1e12, 1, 10.0, records)["peak_gflops"] == 200.0
    assert limits.limit_fields(spec, 1e12, 1, 10.0, records, threads=2) == {}   # no floor at 2


def test_no_limit_without_both_probes_or_a_time():
    assert limits.limit_fields(SOFTMAX_DECODE, 1e6, 100, 1e-3, RECORDS[:3]) == {}
    assert limits.limit_fields(SOFTMAX_DECODE, 1e6, 100, 0.0, RECORDS) == {}


def test_probe_limits_records_a_peak_per_dtype_and_a_floor_per_size(monkeypatch):
    monkeypatch.setattr(limits, "FLOOR_MAX_BYTES", 2**22)
    monkeypatch.setattr(limits, "PEAK_N", 256)
    records = limits.probe_limits([3000, 2**40], ["float32"], budget_s=0.0)
    peaks = [r for r in records if r["probe"] == "peak"]
    floors = [r for r in records if r["probe"] == "floor"]
    assert [r["dtype"] for r in peaks] == ["float32"] and peaks[0]["gflops"] > 0
    assert peaks[0]["shape"] == [256, 256, 256]
    # sizes clipped to the floor's range, as powers of two
    assert [r["bytes"] for r in floors] == [2**16, 2**22]
    assert all(r["gbs"] > 0 for r in floors)


def test_the_statements_name_each_limit_and_the_softmax_ceiling():
    records = [dict(r, threads=1, blas="OpenBLAS") for r in RECORDS]
    text = "\n".join(limits.statements(records))
    assert "compute peak, float32, 1 thread: 100.0 GFLOP/s, GEMM 2048³, OpenBLAS (also " \
           "probed: OpenBLAS 80.0)" in text
    assert "memory floor, 1 thread: 50 GB/s at 1 MiB, 10 GB/s at 32 MiB" in text
    assert "would hold it to 91% of the peak at d = 64" in text
    assert "would reach at most 67% of the FMA peak at d = 32, 80% at 64 (89% at 128)" in text
    assert limits.statements([]) == []


def test_probes_with_null_or_missing_values_are_passed_over():
    """A results file may hold a probe whose value is null: it was a traceback."""
    records = RECORDS + [{"probe": "peak", "dtype": "float32", "gflops": None},
                         {"probe": "floor", "bytes": None, "gbs": 5.0},
                         {"probe": "floor", "bytes": 2**20, "gbs": None}]
    assert limits.statements(records) == limits.statements(RECORDS)
    # a dtype and thread count probed only by a null record: no line, no crash
    alone = [{"probe": "peak", "dtype": "float64", "threads": 4, "gflops": None},
             {"probe": "floor", "threads": 4, "bytes": 2**20, "gbs": None}]
    assert limits.statements(RECORDS + alone) == limits.statements(RECORDS)
    assert limits.limit_fields(SOFTMAX_DECODE, 1e6, 2**25, 4e-3, records) == \
        limits.limit_fields(SOFTMAX_DECODE, 1e6, 2**25, 4e-3, RECORDS)


def test_a_fraction_above_the_limit_is_flagged_in_the_tables():
    from fastattn.bench.table import _limit_cell
    assert _limit_cell({"limit": "floor", "limit_fraction": 0.97}) == "97% floor"
    assert _limit_cell({"limit": "floor", "limit_fraction": 34.0,
                        "limit_fraction_paired": 0.9}) == "3400%! floor (90%)"
    assert _limit_cell({"limit": None, "limit_fraction": None}) == "–"


def test_the_report_names_each_peers_compile_and_path():
    from fastattn.report.scaling import peer_notes

    class Curve:
        def __init__(self, backend, points, peer=True):
            self.backend, self.points, self.peer = backend, points, peer
    curves = [Curve("torch_flex", [{"compile_s": 4.0}, {"compile_s": 8.5, "peer_path": "flex"}]),
              Curve("openvino", [{"peer_path": "SDPA decomposed: X"}]),
              Curve("torch", [{}]), Curve("cython", [{"compile_s": 1.0}], peer=False)]
    assert peer_notes(curves) == ["openvino: SDPA decomposed: X",
                                  "torch_flex: compiled per shape in 4 s–8.5 s (not timed); flex"]


def test_the_floor_reads_on_fastattns_thread_count_not_numbas_default(monkeypatch):
    # fastattn.set_num_threads(1) before the Numba backend loads records 1 but leaves the
    # Numba threads module at its default: the floor of a one-thread point must not read
    # on two threads.
    from fastattn import _threads
    from fastattn._numba import _threads as numba_threads

    monkeypatch.setattr(numba_threads, "_n_threads", 2)
    monkeypatch.setattr(_threads, "_requested", 1)
    calls, nbytes = limits._read(2**16)
    assert len(calls) == 1 and nbytes == 2**16
    monkeypatch.setattr(_threads, "_requested", None)
    calls, _ = limits._read(2**16)
    assert len(calls) == min(2, limits.numba.config.NUMBA_NUM_THREADS)
