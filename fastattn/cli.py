"""The ``fastattn`` command: ``report``, ``bench`` and ``compare``.

Each subcommand lives beside the code it drives and contributes
``add_parser(subparsers)``, which registers its options and sets ``func``.
"""

import argparse
import importlib.util
import sys

from . import __version__
from ._argtypes import positive_int as _positive_int, seed as _seed


def _add_compare(subparsers):
    parser = subparsers.add_parser(
        "compare",
        help="softmax against linear attention on seeded Gaussian inputs",
        description=(
            "The seed experiment: np.random.seed(SEED); q, k = 0.5 * randn(n, d), "
            "v = randn(n, d) (float32); softmax attention (scale 1/sqrt(d)) against "
            "elu+1 linear attention (eps 1e-6). Prints the mean cosine similarity, "
            "the MSE and the magnitude ratio of the outputs."
        ),
    )
    parser.add_argument("--n", type=_positive_int, default=64, help="sequence length (default 64)")
    parser.add_argument("--d", type=_positive_int, default=32, help="head dimension (default 32)")
    parser.add_argument("--seed", type=_seed, default=42,
                        help="NumPy seed, 0 to 2**32 - 1 (default 42)")
    parser.set_defaults(func=_run_compare)


def _run_compare(args):
    from .compare import compare

    try:
        result = compare(args.n, args.d, seed=args.seed)
    except MemoryError as exc:   # inputs that cannot fit (argparse checked n, d and the seed)
        print(f"fastattn compare: error: {exc}", file=sys.stderr)
        return 2
    q = result.quality
    print(f"softmax vs linear (elu+1) attention, n={args.n}, d={args.d}, seed={args.seed}")
    print(f"  cosine similarity  {q.cosine_similarity:.4g}")
    print(f"  MSE                {q.mse:.6g}")
    print(f"  magnitude ratio    {q.magnitude_ratio:.4g}")
    return 0


def _add_model(subparsers):
    parser = subparsers.add_parser(
        "model", add_help=False,
        help="what a whole model (all-MiniLM-L6-v2) keeps with each attention (model extra)",
        description="All-MiniLM-L6-v2 in NumPy with each attention in every layer: Spearman "
                    "with human judgement (Lee et al. 2005) and agreement with the original "
                    "model on held-out texts. Options: fastattn model --help.")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=_run_model)


def _run_model(args):
    from .model import MissingExtraError
    from .model.study import main as study

    try:
        return study(args.args) or 0
    except MissingExtraError as exc:
        print(f"fastattn model: {exc}", file=sys.stderr)
        return 2


def build_parser():
    parser = argparse.ArgumentParser(
        prog="fastattn",
        description="Softmax and linear attention: kernels, benchmarks and scaling reports.",
    )
    parser.add_argument("--version", action="version", version=f"fastattn {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="{report,bench,compare,model}")
    subparsers.required = True
    from .bench.cli import add_parser as add_bench
    from .report.cli import add_parser as add_report

    add_report(subparsers)
    add_bench(subparsers)
    _add_compare(subparsers)
    _add_model(subparsers)
    return parser


#: What ``report`` and ``bench`` import beyond the kernels: pyproject's ``report`` extra.
REPORT_EXTRA = ("matplotlib", "jinja2", "tqdm", "psutil", "tabulate")

EXTRA_HINT = (
    "fastattn {command}: needs {missing}, which the report extra installs; in the checkout "
    "of fastattn:\n"
    '    pip install -e ".[report]"')


def missing_extra(modules=REPORT_EXTRA):
    """The modules of ``modules`` that cannot be imported here, in order."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def main(argv=None):
    """Entry point of the ``fastattn`` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") else "command"
    try:
        if command == "model":   # its options are the study's own (argparse's REMAINDER
            return _run_model(argparse.Namespace(args=argv[1:]))   # drops a leading --help)
        args = build_parser().parse_args(argv)   # imports each command's module
        missing = missing_extra() if args.command in ("report", "bench") else []
        if missing:
            print(EXTRA_HINT.format(command=args.command, missing=", ".join(missing)),
                  file=sys.stderr)
            return 2
        return args.func(args) or 0
    except KeyboardInterrupt:
        # A command with a results file says where its points are before this.
        print(f"fastattn {command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:   # a full disk while writing a report, say: one line, no traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"fastattn {command}: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
