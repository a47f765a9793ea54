#!/usr/bin/env bash
# GPU validation on a machine that cannot reach a package registry: install the wheels brought
# along in .whl/ (made by `make gpu-wheels`) into a private folder, then run
# `python -m benchmarks.gpu_check` with any arguments given here (--budget-s, --out ...).
# docs/benchmarks.md, "GPU validation: benchmarks/gpu_check", says how to use it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=${ARBOR_WHEEL_SITE:-/tmp/arbor-gpu-check-site}

shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
    echo "installing ${#wheels[@]} wheels from .whl/ into $SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "no wheels in .whl/: using the packages already installed (make gpu-wheels brings them)"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m benchmarks.gpu_check "$@"
