"""The roof part of a machine's Scaling block: GFLOP/s against n beside the GEMMs probed in
the same run."""

import numpy as np

from ..bench import limits
from ..bench.engine import gemm_probes
from ..bench.schema import roof_library
from ..bench.table import ABOVE_ROOF_WHY, mask_name, roof_statements
from . import figures


def libraries(roofs, dtype, threads, d, machine=None):
    """``{blas: (names, {n: gflops})}`` of the GEMM probes at this setting, the fastest library
    (the roof) first; ``names`` as :func:`~fastattn.bench.schema.roof_library` reads them."""
    found = {}
    for r in gemm_probes(roofs, dtype, threads, machine):
        if r["shape"][1] == d:
            per_n = found.setdefault(r.get("blas") or r.get("library") or "NumPy's BLAS",
                                     (roof_library(r), {}))[1]
            per_n[r["shape"][0]] = max(per_n.get(r["shape"][0], 0.0), float(r["gflops"]))
    return dict(sorted(found.items(), key=lambda kv: -max(kv[1][1].values())))


def roof_lines(roofs, curve_list, machine):
    """``(label, n, gflops)`` per GEMM line to draw: per (dtype, threads, d) of the curves, the
    roof first (the fastest probe at this d), then each library's probes against n."""
    lines = []
    for dtype, threads, d in sorted({(str(c.key.get("dtype")), c.key.get("threads"),
                                      c.key.get("d_k")) for c in curve_list}, key=str):
        for i, ((library, via), per_n) in enumerate(
                libraries(roofs, dtype, threads, d, machine).values()):
            ns = np.array(sorted(per_n), dtype=np.int64)
            values = np.array([per_n[n] for n in ns.tolist()])
            shape = f"n×{d} @ {d}×n" if len(ns) > 1 else f"{ns[0]}×{d} @ {d}×{ns[0]}"
            series = library + (f" via {via}" if via else "") + f", {dtype}"
            if i == 0:
                best = int(np.argmax(values))
                lines.insert(0, (f"roof: {values[best]:.0f} GFLOP/s ({series}, n = {ns[best]})",
                                 ns[best:best + 1], values[best:best + 1]))
            if len(ns) > 1:
                lines.append((f"GEMM {shape}, {series}", ns, values))
    return lines


def section(m):
    """The roof block of machine ``m`` (:class:`~.analysis.Machine`)."""
    curve_list = m.scaling_curves
    roofs = [r for r in m.roofs if r.get("machine") in (None, m.name)]
    lines = roof_lines(m.roofs, curve_list, m.name)
    return {"png": figures.machine_figure(m, "gflops", roofs=lines),
            "lines": [label for label, _, _ in lines], "statements": roof_statements(roofs),
            "above": [f"{c.label}, {mask_name(c.causal)}, at n = {n}" for c in curve_list
                      for n, flag in zip(c.n.tolist(), c.above_roof.tolist()) if flag],
            "above_why": ABOVE_ROOF_WHY, "probes": roofs, "limits": limits.statements(roofs)}
