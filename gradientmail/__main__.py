"""``python -m gradientmail``: the same command as ``gradientmail``."""

import sys

from gradientmail.cli import main

if __name__ == "__main__":
    sys.exit(main())
