"""``python -m benchmarks compare|prepare|render|chart|steps``: see benchmarks/__init__.py and docs/benchmarks.md."""

import sys

if sys.argv[1:2] == ["chart"]:  # step time and efficiency against GPUs (benchmarks/chart.py)
    from benchmarks.chart import main

    sys.exit(main(sys.argv[2:]))

if sys.argv[1:2] == ["steps"]:  # a trace's GPU time step by step (benchmarks/trace_steps.py)
    from benchmarks.trace_steps import main

    sys.exit(main(sys.argv[2:]))

from benchmarks.compare import main  # noqa: E402

sys.exit(main())
