"""``python -m gradientmail.data write|stdlib ...``, the same as ``gradientmail tokens ...``."""

import sys

from gradientmail.cli.entry import tokens_main as main

sys.exit(main())
