"""What a whole model keeps: all-MiniLM-L6-v2 with each attention in all six layers.

For each configuration: Spearman's rho with the human judgements of the Lee set
(50 documents, 1,225 pairs), and agreement with the original model (softmax)
on the held-out part of ``lee_background.cor``: mean embedding cosine, top-1
nearest-neighbour agreement, overlap of the top 10, Spearman of all pairwise
similarities.  Hedgehog maps are fitted on the calibration part (never the
held-out texts) unless fitted ones are given.
"""

import argparse
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .._argtypes import int_between, thread_count
from .data import background_split, lee_documents
from .evaluate import Agreement, agreement, human_spearman

#: FAVOR+ feature counts of the default table, as multiples of d_k = 32.
FAVOR_MULTIPLES = (4, 64)


@dataclass(frozen=True)
class StudyRow:
    """One configuration's quality: Lee Spearman and agreement on held-out texts."""

    name: str
    lee_spearman: float
    held_out: Agreement
    seconds: float


def default_configurations(maps=None, favor_multiples=FAVOR_MULTIPLES, d_k=32):
    """``{name: attention=}`` of the table: softmax, elu+1, relu, Taylor, FAVOR+ at each
    ``m = multiple · d_k``, and Hedgehog when ``maps`` (weight shape (6, 2, 12, d_k, d_k))
    are given."""
    from ..feature_maps import FavorFeatures
    from .hedgehog import hedgehog_attention

    configs = {"softmax": "softmax", "elu+1": "elu", "relu": "relu", "taylor": "taylor"}
    for mult in favor_multiples:
        configs[f"favor m={mult * d_k}"] = FavorFeatures(d_k, num_features=mult * d_k,
                                                         random_state=0)
    if maps is not None:
        configs["hedgehog"] = hedgehog_attention(maps)
    return configs


def _layer_spec(attention, layer):
    """The attention of ``layer`` in a configuration (one spec for all layers, or a list)."""
    return attention[layer] if isinstance(attention, list) else attention


def with_linear_layers(name, attention, layers, num_layers=6):
    """``(row name, attention=)``: ``attention`` in ``layers`` only, softmax in the others."""
    layers = sorted(layers)
    specs = [_layer_spec(attention, i) if i in layers else "softmax" for i in range(num_layers)]
    where = ", ".join(str(i) for i in layers)
    kept = num_layers - len(layers)
    return f"{name} in layer{'s' if len(layers) > 1 else ''} {where} (softmax in {kept})", specs


def single_layer_swaps(name, attention, num_layers=6):
    """``{row name: attention=}``: ``attention`` in one layer at a time, softmax elsewhere."""
    return dict(with_linear_layers(name, attention, [i], num_layers) for i in range(num_layers))


def greedy_hybrids(name, attention, swap_rows, num_layers=6):
    """``{row name: attention=}``: the hybrids that keep softmax in ``k`` of the layers, for
    ``k`` from ``num_layers - 2`` down to 1, linearising first the layers whose single swap
    (``swap_rows``, the :class:`StudyRow` of :func:`single_layer_swaps`, in layer order)
    kept the held-out embeddings closest to the original's."""
    order = sorted(range(num_layers), key=lambda i: -swap_rows[i].held_out.mean_cosine)
    return dict(with_linear_layers(name, attention, order[:j], num_layers)
                for j in range(2, num_layers))


def run_study(model, configurations, held_out, lee=None, judgements=None, progress=None):
    """Measure each configuration; returns a list of :class:`StudyRow` (softmax first).

    ``held_out`` texts are embedded with softmax once (the original model) and
    with each configuration; ``lee`` and its human ``judgements`` (a square
    matrix) default to :func:`lee_documents` and
    :func:`~fastattn.model.data.lee_similarities`.
    """
    lee = lee_documents() if lee is None else lee
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", UserWarning)
        model.tokenize(held_out + lee)
    for w in said:                                           # truncation: said once, here
        print(f"note: {w.message}", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        original = model.encode(held_out, "softmax")
        rows = []
        for name, attention in configurations.items():
            t0 = time.perf_counter()
            held = original if attention == "softmax" else model.encode(held_out, attention)
            lee_emb = model.encode(lee, attention)
            rows.append(StudyRow(name, human_spearman(lee_emb, judgements), agreement(held, original),
                                 time.perf_counter() - t0))
            if progress:
                progress(rows[-1])
    return rows


#: The hybrid of the report: Hedgehog in these layers, softmax in the others; the one
#: ``fastattn model --hybrid hedgehog`` found best (docs/model.md).
REPORT_HYBRID_LAYERS = (2, 3, 4, 5)


@dataclass
class ModelStudy:
    """What the report's section shows: the rows (softmax first), the forward pass's seconds
    per text ``{n: {name: s}}`` and its attention calls' share of them
    (``attention_seconds``, ``{n: {name: {kind: s}}}``), and the fit of the Hedgehog maps."""

    rows: list
    seconds: dict
    fit: object
    fit_cached: bool
    held_out: int
    threads: int
    attention_seconds: dict = field(default_factory=dict)

    def to_json(self):
        """The study as JSON text, kept beside a report's results (:meth:`from_json`)."""
        import dataclasses
        import json

        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text):
        """The study :meth:`to_json` wrote; ValueError if ``text`` is not one."""
        import json

        from .hedgehog import HedgehogFit, LayerFit

        try:
            d = json.loads(text)
            rows = [StudyRow(r["name"], r["lee_spearman"], Agreement(**r["held_out"]),
                             r["seconds"]) for r in d["rows"]]
            fit = HedgehogFit(**{**d["fit"], "layers": [LayerFit(**f)
                                                        for f in d["fit"]["layers"]]})
            seconds, attention = ({int(n): times for n, times in d.get(key, {}).items()}
                                  for key in ("seconds", "attention_seconds"))
            if not seconds:
                raise KeyError("seconds")
            return cls(rows, seconds, fit, d["fit_cached"], d["held_out"], d["threads"],
                       attention)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a whole-model study ({type(exc).__name__}: {exc})") from None


def report_study(*, quick=False, threads=2, cache_dir=None, progress=None):
    """Measure the configurations of the report's section "What a whole model keeps".

    Softmax, elu+1, relu, Taylor, FAVOR+ at m = 128 and 2048, Hedgehog (the
    cached fit of :func:`~fastattn.model.hedgehog.cached_fit_hedgehog`, 100
    iterations on 64 calibration texts) and Hedgehog in the layers of
    :data:`REPORT_HYBRID_LAYERS`, on 40 held-out texts and the 50 Lee
    documents, and each forward pass at 128 and 512 tokens (4 texts, beside
    sentence-transformers when installed).  ``quick``: 16 held-out texts,
    softmax, elu+1, FAVOR+ m = 2048, Hedgehog (10 iterations on 30 texts) and
    the hybrid, at 128 tokens.

    Raises
    ------
    fastattn.model.MissingExtraError
        When a package of the model extra is not installed.
    """
    from .cost import costs
    from .hedgehog import cached_fit_hedgehog
    from .minilm import MiniLM

    model = MiniLM()
    calibration, held_out = background_split(150)
    calibration = calibration[:30 if quick else 64]
    held_out = held_out[:16 if quick else 40]
    maps, fit, cached = cached_fit_hedgehog(model, calibration, cache_dir=cache_dir,
                                            maxiter=10 if quick else 100, max_tokens=256)
    configs = default_configurations(maps)
    hybrid, spec = with_linear_layers("hedgehog", configs["hedgehog"], REPORT_HYBRID_LAYERS)
    configs[hybrid] = spec
    if quick:
        configs = {k: configs[k] for k in ("softmax", "elu+1", "favor m=2048", "hedgehog",
                                           hybrid)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # the truncation note: in the section
        rows = run_study(model, configs, held_out, progress=progress)
    texts = calibration + held_out
    seconds, attention = costs(model, texts, configs, (128,) if quick else (128, 512),
                               count=4, threads=threads, rounds=2, repeats=1)
    return ModelStudy(rows, seconds, fit, cached, len(held_out), threads, attention)


def format_table(rows, first_column="attention in every layer"):
    """A Markdown table of :func:`run_study`'s rows."""
    lines = [f"| {first_column} | Lee Spearman | held-out mean cosine | top-1 "
             "neighbour | top-10 overlap | pairwise Spearman |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        a = r.held_out
        lines.append(f"| {r.name} | {r.lee_spearman:.3f} | {a.mean_cosine:.3f} | "
                     f"{a.top1:.0%} | {a.top10_overlap:.2f} | {a.spearman:.3f} |")
    return "\n".join(lines)


def _check_paths(parser, args):
    """Usage errors for paths that would fail after minutes of fitting."""
    if args.maps is not None and not args.maps.is_file():
        parser.error(f"--maps {args.maps}: no such file (a .npz of HedgehogFeatures.save)")
    if args.save_maps is not None and not args.save_maps.parent.is_dir():
        parser.error(f"--save-maps {args.save_maps}: the folder {args.save_maps.parent} does "
                     "not exist")
    if args.save_maps is not None and args.maps is not None:
        parser.error("--save-maps writes fitted maps; --maps reads them instead of fitting")
    if args.cache_dir is not None and args.cache_dir.exists() and not args.cache_dir.is_dir():
        parser.error(f"--cache-dir {args.cache_dir} is a file; give a folder")


def main(argv=None):
    """``fastattn model``: print the table (see :func:`run_study`)."""
    from .cost import costs
    from .hedgehog import HedgehogFeatures, cached_fit_hedgehog, fit_hedgehog
    from .minilm import MiniLM

    known = list(default_configurations())[1:] + ["hedgehog"]
    p = argparse.ArgumentParser(
        prog="fastattn model", description=__doc__.splitlines()[0],
        epilog='Needs the model extra: in the checkout of fastattn, pip install -e ".[model]". '
               "More in docs/model.md.")
    p.add_argument("--feature-map", action="append", default=None, metavar="NAME",
                   help=f"a configuration of the table to run (repeatable; default all; softmax "
                   f"always runs): {', '.join(repr(k) for k in known)}")
    p.add_argument("--maps", type=Path,
                   help="fitted Hedgehog maps (.npz of HedgehogFeatures.save) for the "
                   "hedgehog configuration; default: fit them on the calibration texts")
    p.add_argument("--save-maps", type=Path, help="write the fitted maps here (.npz)")
    p.add_argument("--calibration", type=int_between(1, 150), default=64,
                   help="calibration texts for the fit, 1 to 150 (default 64)")
    p.add_argument("--maxiter", type=int_between(1, 100000), default=100,
                   help="L-BFGS-B iterations per layer of the fit (default 100; 10 with --quick)")
    p.add_argument("--hybrid", action="append", default=None, metavar="CONFIGURATION",
                   help="also: the configuration (e.g. hedgehog, 'favor m=2048') in each layer "
                   "alone, then in the 2 to 5 layers whose single swap kept the most "
                   "(repeatable)")
    p.add_argument("--cache-dir", type=Path, help="where the fit is kept by its inputs "
                   "(default $XDG_CACHE_HOME/fastattn or ~/.cache/fastattn)")
    p.add_argument("--no-cache", action="store_true", help="fit again, and keep nothing")
    p.add_argument("--cost", action="store_true",
                   help="also time each configuration's forward pass at 128 and 512 tokens "
                   "beside sentence-transformers' own (same texts and threads)")
    p.add_argument("--threads", type=thread_count, default=1,
                   help="threads of --cost (default 1)")
    p.add_argument("--quick", action="store_true",
                   help="40 held-out texts, a short fit (10 iterations on 30 texts)")
    args = p.parse_args(argv)
    _check_paths(p, args)
    model = MiniLM()
    calibration, held_out = background_split(150)
    every_text = calibration + held_out   # --cost's: long texts from all of them
    calibration = calibration[:args.calibration]
    if args.quick:
        held_out, calibration = held_out[:40], calibration[:30]
    wanted = args.feature_map
    hybrid = args.hybrid or []
    for option, names, allowed in (("--feature-map", wanted or [], ["softmax"] + known),
                                   ("--hybrid", hybrid, known)):
        unknown = [w for w in names if w not in allowed]
        if unknown:   # before the minutes of a fit
            p.error(f"unknown {option} {', '.join(map(repr, unknown))}; choose from "
                    f"{', '.join(map(repr, allowed))}")
    maps = None
    if wanted is None or "hedgehog" in wanted or "hedgehog" in hybrid:
        if args.maps:
            try:
                maps = HedgehogFeatures.load(args.maps, shape=(6, 2, 12, 32, 32))
            except (OSError, ValueError) as exc:
                p.error(f"--maps {args.maps}: {exc}")
        else:
            options = {"maxiter": 10 if args.quick else args.maxiter, "max_tokens": 256}
            if args.no_cache:
                maps, fit, cached = (*fit_hedgehog(model, calibration, **options), False)
            else:
                maps, fit, cached = cached_fit_hedgehog(model, calibration,
                                                        cache_dir=args.cache_dir, **options)
            how = "read from the cache, fitted" if cached else "fitted"
            print(f"hedgehog: 72 heads {how} on {fit.num_texts} texts in {fit.seconds:.0f} s"
                  f"{'' if fit.converged else ' (not all layers converged)'}", file=sys.stderr)
            if args.save_maps:
                maps.save(args.save_maps)
    all_configs = default_configurations(maps)
    configs = {k: v for k, v in all_configs.items()
               if wanted is None or k in wanted or k == "softmax"}

    def progress(row):
        print(f"  {row.name}: {row.seconds:.0f} s", file=sys.stderr)
    rows = run_study(model, configs, held_out, progress=progress)
    print(format_table(rows))
    for name in hybrid:
        swaps = run_study(model, single_layer_swaps(name, all_configs[name]), held_out,
                          progress=progress)
        mixed = run_study(model, greedy_hybrids(name, all_configs[name], swaps), held_out,
                          progress=progress)
        print(f"\n{name}: one layer at a time, then in the layers that kept the most\n")
        print(format_table(swaps + mixed, first_column="attention"))
    if args.cost:
        print(f"\nForward pass, ms per text ({args.threads} thread(s) for BLAS, fastattn and "
              f"PyTorch; fastest of 3 alternating rounds)\n")
        print(format_cost(*costs(model, every_text, configs, (128, 512),
                                 count=8 if args.quick else 16, threads=args.threads)))
    return 0


def format_cost(seconds, attention=None):
    """A Markdown table of ``{n: forward_seconds(...)}``: ms per text, the ratio to
    sentence-transformers' forward where it was timed, and the attention calls' share
    (``attention``: ``{n: {name: {kind: seconds}}}``, ``forward_seconds(attention_seconds=)``)."""
    ns = list(seconds)
    names = list(seconds[ns[0]])
    lines = ["| attention in every layer | " + " | ".join(f"n = {n}" for n in ns) + " |",
             "|---" * (len(ns) + 1) + "|"]
    for name in names:
        cells = []
        for n in ns:
            st = seconds[n].get("sentence-transformers")
            ratio = "" if st is None or name == "sentence-transformers" \
                else f" ({seconds[n][name] / st:.2f}x)"
            share = (attention or {}).get(n, {}).get(name)
            share = "" if share is None else \
                f", attention {sum(share.values()) / seconds[n][name]:.0%}"
            cells.append(f"{seconds[n][name] * 1e3:.1f}{ratio}{share}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
