"""``python -m ep_runtime.bench``: the layer against its own GEMMs on one GPU (bench/layer.py)."""

import sys

from ep_runtime.bench.layer import main

sys.exit(main())
