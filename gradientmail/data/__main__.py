"""``python -m gradientmail.data write|stdlib ...``, the same as ``gradientmail tokens ...``."""

import sys

from gradientmail.data.cli import main

sys.exit(main())
