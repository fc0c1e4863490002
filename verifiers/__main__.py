"""``python -m verifiers``: see ``verifiers.cli``."""

import sys

from verifiers.cli import main

sys.exit(main())
