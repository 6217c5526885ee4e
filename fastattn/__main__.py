"""``python -m fastattn``: the ``fastattn`` command."""

import sys

from .cli import main

sys.exit(main())
