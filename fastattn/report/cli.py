"""``fastattn report`` (placeholder until the report lands)."""


def add_parser(subparsers):
    parser = subparsers.add_parser("report", help="measure and write the HTML report (not yet built)")
    parser.set_defaults(func=lambda args: (print("fastattn report is not built yet"), 2)[1])
