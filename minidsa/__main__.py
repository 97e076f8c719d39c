"""``python -m minidsa ...`` and the ``minidsa`` script: the command line of ``minidsa/cli.py``."""

import os
import sys

from . import cli


def entry() -> None:
    """``cli.main()``, then exit with its status. After a lost rank the exit skips Python's teardown, in which a
    process group that lost a peer can abort (std::terminate) and replace the status with SIGABRT."""
    code = cli.main()
    if cli.HARD_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
