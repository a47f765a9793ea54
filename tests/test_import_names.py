"""The project's top-level import names against every installed distribution's.

A name this project imports at the top level (or that its checkout makes importable by path) and
that another installed distribution also provides is a collision: whichever comes first on
``sys.path`` wins, and the other side's imports break (transformers 5.25 and Hugging Face's
``kernels`` did this). Each such name must be gone, or be listed in ``SHARED`` with the reason it
cannot break, and that reason is checked here.
"""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# name -> why sharing it cannot break anything (each reason has a test below).
SHARED = {
    "kernels": (
        "Hugging Face's kernels (transformers >= 5.25 imports it). Arbor's folder kernels/ "
        "installs as arbor_kernels, and found by path under the name kernels it hands it over"
    ),
}


def _project_names() -> set[str]:
    """What the project installs at the top level, and what its checkout's root makes importable."""
    installed = {
        name for name, dists in metadata.packages_distributions().items() if "arbor" in dists
    }
    by_path = {
        entry.stem if entry.suffix == ".py" else entry.name
        for entry in ROOT.iterdir()
        if (entry.is_dir() and not entry.name.startswith(".") and "." not in entry.name
            and any(entry.glob("**/*.py")))
        or entry.suffix == ".py"
    }
    return installed | by_path


def _other_providers(name: str) -> list[str]:
    return sorted(
        {dist for dist in metadata.packages_distributions().get(name, []) if dist != "arbor"}
    )


def test_no_unlisted_collision() -> None:
    names = _project_names()
    assert {"runtime", "grammar", "radix_cache", "frontend_lang", "arbor_kernels"} <= names
    unlisted = {
        name: providers
        for name in sorted(names)
        if (providers := _other_providers(name)) and name not in SHARED
    }
    assert not unlisted, (
        f"installed distributions also provide these top-level names of Arbor: {unlisted}; "
        "rename ours, or list the name in SHARED with the reason it cannot break"
    )


def test_arbor_never_installs_kernels() -> None:
    installed = {
        name for name, dists in metadata.packages_distributions().items() if "arbor" in dists
    }
    assert "kernels" not in installed
    assert "arbor_kernels" in installed


def _run(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", **env},
    )


# From the repository root ("" first on sys.path, as under `python -m pytest`), and from a
# folder outside it: both Arbor and whatever distribution owns "kernels" import side by side.
_BOTH = """
import importlib.metadata as md
import arbor_kernels, runtime.engine
assert arbor_kernels.__file__.startswith("{root}/kernels/"), arbor_kernels.__file__
try:
    owner = md.distribution("kernels")
except md.PackageNotFoundError:
    owner = None
try:
    import kernels
except ModuleNotFoundError as exc:
    assert owner is None, exc
    assert "arbor_kernels" in str(exc)
    print("no kernels distribution; the name is not found")
else:
    assert owner is not None, kernels.__file__
    assert not kernels.__file__.startswith("{root}/kernels"), kernels.__file__
    print("kernels is", owner.metadata["Name"], owner.version)
"""


@pytest.mark.parametrize("where", ["repo_root", "elsewhere"])
def test_kernels_name_is_handed_over(where: str, tmp_path: Path) -> None:
    cwd = ROOT if where == "repo_root" else tmp_path
    done = _run(_BOTH.format(root=ROOT), cwd)
    assert done.returncode == 0, done.stderr[-3000:]


def test_transformers_kernels_integration_imports_beside_arbor() -> None:
    """transformers' hub-kernels integration (what the GGUF tokenizer conversion pulls in)."""
    pytest.importorskip("transformers")
    code = (
        "import arbor_kernels, runtime.engine\n"
        "import transformers.integrations.hub_kernels as hub\n"
        "print(hub.__name__)\n"
    )
    done = _run(code, ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def test_wheel_install_has_no_kernels_and_imports(tmp_path: Path) -> None:
    """A non-editable install: the wheel's top-level names, and the product imported from it."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("arbor-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/", 1)[0] for name in names if "/" in name and ".dist-info" not in name}
    assert "kernels" not in top
    assert {"arbor_kernels", "runtime", "grammar", "radix_cache", "frontend_lang"} <= top
    assert "arbor_kernels/cpu_native/quantized.cpp" in names  # built where it runs
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    code = (
        "import arbor_kernels, runtime.engine, grammar, radix_cache, frontend_lang\n"
        f"assert arbor_kernels.__file__.startswith({str(target)!r}), arbor_kernels.__file__\n"
        f"assert runtime.engine.__file__.startswith({str(target)!r}), runtime.engine.__file__\n"
    )
    # -I keeps the checkout off sys.path; the wheel's files come first, the venv's site-packages
    # (torch and the rest) after them.
    done = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path[:0] = [{str(target)!r}]\n" + code],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
