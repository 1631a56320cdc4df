"""``python -m benchmarks compare|prepare|render``: see benchmarks/__init__.py and docs/benchmarks.md."""

import sys

from benchmarks.compare import main

sys.exit(main())
