"""The install lock: every package version that ``make install`` and CI install.

    python3 .ci/lock.py check     # exit 1, with one line, when the lock is out of date
    python3 .ci/lock.py refresh   # resolve anew with pip (newest allowed versions) and write it

The lock is ``requirements.lock``: one ``name==version`` a line, resolved by pip's own resolver
(``pip install --dry-run --report``) for this project with its ``dev`` and ``browser`` extras,
``torch`` pinned by ``constraints.txt``. Its first lines carry a fingerprint of what it was
resolved from (pyproject's requirements and constraints.txt), so an edit to either without a
refresh is caught before anything installs. ``make install`` installs with the lock as
constraints, so pip never picks a version the lock did not name.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
EXTRAS = ("dev", "browser")
REFRESH = "make lock"


def fingerprint() -> str:
    """A digest of every input the resolution reads from this repository."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    inputs = {
        "requires-python": project.get("requires-python", ""),
        "dependencies": sorted(project.get("dependencies", [])),
        "extras": {name: sorted(project["optional-dependencies"][name]) for name in EXTRAS},
        "constraints": sorted(
            line.strip()
            for line in (ROOT / "constraints.txt").read_text("utf-8").splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def locked_fingerprint() -> str | None:
    if not LOCK.exists():
        return None
    for line in LOCK.read_text("utf-8").splitlines():
        if line.startswith("# fingerprint: "):
            return line.removeprefix("# fingerprint: ").strip()
    return None


def check() -> int:
    locked = locked_fingerprint()
    if locked is None:
        print(f"requirements.lock is missing or unreadable: run `{REFRESH}`", file=sys.stderr)
        return 1
    if locked != fingerprint():
        print(
            f"requirements.lock is out of date against pyproject.toml/constraints.txt: "
            f"run `{REFRESH}`",
            file=sys.stderr,
        )
        return 1
    return 0


def resolve(python: str) -> dict[str, str]:
    """Name -> version of everything pip would install today into an empty environment."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        subprocess.run(
            [python, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
             "--report", str(report), "-c", str(ROOT / "constraints.txt"),
             f"{ROOT}[{','.join(EXTRAS)}]"],
            check=True,
        )
        installs = json.loads(report.read_text("utf-8"))["install"]
    pins = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs}
    pins.pop("arbor", None)
    return dict(sorted(pins.items()))


def refresh(python: str) -> int:
    pins = resolve(python)
    lines = [
        "# The install lock (.ci/lock.py): `make lock` rewrites it; do not edit by hand.",
        f"# Resolved for Python {sys.version_info.major}.{sys.version_info.minor} on Linux x86-64,"
        f" extras {', '.join(EXTRAS)}.",
        f"# fingerprint: {fingerprint()}",
        *(f"{name}=={version}" for name, version in pins.items()),
    ]
    LOCK.write_text("\n".join(lines) + "\n", "utf-8")
    print(f"requirements.lock: {len(pins)} packages")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        return check()
    if argv[:1] == ["refresh"]:
        return refresh(argv[1] if len(argv) > 1 else sys.executable)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
