"""``python -m minidsa ...``: the command line of ``minidsa/cli.py``."""

import sys

from .cli import main

sys.exit(main())
