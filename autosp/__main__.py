"""``python -m autosp plan ...``: see ``autosp._cli``."""

import sys

from ._cli import main

sys.exit(main())
