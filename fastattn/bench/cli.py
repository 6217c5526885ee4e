"""``fastattn bench`` (placeholder until the bench command lands)."""


def add_parser(subparsers):
    parser = subparsers.add_parser("bench", help="time every kernel side by side (not yet built)")
    parser.set_defaults(func=lambda args: (print("fastattn bench is not built yet"), 2)[1])
