"""``python -m tools.soak`` (``scripts/soak``; ``_driver CONFIG``: a driver process)."""

import sys

from tools.soak.cli import main

sys.exit(main())
