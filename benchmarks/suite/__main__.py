"""``python -m benchmarks.suite WORKLOAD ...``: the same as ``arbor bench``."""

import sys

from benchmarks.suite.cli import main

sys.exit(main())
