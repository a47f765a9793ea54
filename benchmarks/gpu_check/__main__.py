"""``python -m benchmarks.gpu_check``: see the package docstring."""

import sys

from benchmarks.gpu_check.cli import main

sys.exit(main())
