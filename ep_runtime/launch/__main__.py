"""Entry point of ``python -m ep_runtime.launch``."""

import sys

from ep_runtime.launch.cli import main

sys.exit(main())
