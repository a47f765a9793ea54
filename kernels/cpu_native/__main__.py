"""``python -m arbor_kernels.cpu_native``: build the native CPU kernels; never fails the install.

A failed build prints one warning and exits 0, so ``make install`` goes on and the runtime uses
the torch reference. ``--strict`` exits 1 instead (for checking a build on purpose).
"""

from __future__ import annotations

import argparse
import sys
import time

from arbor_kernels import cpu_native


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m arbor_kernels.cpu_native", description=__doc__)
    parser.add_argument("--strict", action="store_true", help="exit 1 when the build fails")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args()
    start = time.perf_counter()
    try:
        library = cpu_native.build(verbose=args.verbose)
    except Exception as exc:
        print(
            f"WARNING: native CPU kernels failed to build; Arbor will use the torch reference "
            f"kernels on CPU (slower). Cause: {exc}",
            file=sys.stderr,
        )
        return 1 if args.strict else 0
    print(f"native CPU kernels built in {time.perf_counter() - start:.0f} s: {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
