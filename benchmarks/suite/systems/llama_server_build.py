"""Find or build llama.cpp's ``llama-server`` binary for the llama-server baseline.

Where the binary comes from, first match wins: ``--llama-server-bin PATH``, the
``ARBOR_LLAMA_SERVER_BIN`` environment variable, the cache
(``~/.cache/arbor/llama-server/VERSION/llama-server``), else a build: pip downloads the
``llama-cpp-python`` source distribution (the version installed, else ``PINNED_VERSION``),
its ``vendor/llama.cpp`` tree is configured with ``CMAKE_FLAGS`` and only the ``llama-server``
target is built (statically linked, so the cached binary needs nothing else), which takes
several minutes on 2 cores. The build's output goes to ``build.log`` next to the binary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TextIO

PINNED_VERSION = "0.3.36"  # the llama-cpp-python release the llama.cpp baseline was measured on
CACHE = Path.home() / ".cache" / "arbor" / "llama-server"
BIN_ENV = "ARBOR_LLAMA_SERVER_BIN"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this CPU's instruction sets (AVX-512 where present), as a user builds
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    # No network at build time: no HTTPS model downloads (curl in older trees, OpenSSL in
    # newer ones) and no web UI assets fetched from Hugging Face.
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
LOG_TAIL_LINES = 15


class BuildError(RuntimeError):
    """llama-server could not be found or built; the message says why and what to do."""


def llama_cpp_python_version() -> str:
    """The installed ``llama-cpp-python`` (so both llama.cpp baselines run the same llama.cpp),
    else ``PINNED_VERSION``."""
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return PINNED_VERSION


def cached_binary(version: str) -> Path:
    return CACHE / version / "llama-server"


def find_or_build(explicit: str | None = None, log: Callable[[str], None] = print) -> Path:
    """The binary to run: ``explicit``, ``$ARBOR_LLAMA_SERVER_BIN``, the cached build, or a
    new build (cached for later runs). Raises BuildError with the reason."""
    supplied = explicit or os.environ.get(BIN_ENV)
    if supplied:
        path = Path(supplied).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BuildError(f"{path} is not an executable file (--llama-server-bin / {BIN_ENV})")
        return path
    version = llama_cpp_python_version()
    binary = cached_binary(version)
    if binary.is_file():
        return binary
    return build(version, log)


def build(version: str, log: Callable[[str], None] = print) -> Path:
    """Download llama-cpp-python ``version``'s sdist, build ``llama-server`` from its vendored
    llama.cpp and install it at ``cached_binary(version)``, with ``build.json`` (flags,
    seconds) and ``build.log`` beside it."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cmake not found on PATH; install cmake or pass --llama-server-bin")
    out_dir = cached_binary(version).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "build.log"
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="arbor-llama-server-") as scratch,
        open(log_path, "w") as build_log,
    ):
        work = Path(scratch)
        log(f"llama-server: downloading the llama-cpp-python=={version} sdist (pip)")
        _run(_download_command(version, work), build_log, log_path)
        sdists = sorted(work.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise BuildError(f"pip download produced no llama_cpp_python sdist; see {log_path}")
        source = extract_vendored_llama_cpp(sdists[0], work / "src")
        build_dir = work / "build"
        configure, compile_ = build_commands(cmake, source, build_dir, os.cpu_count() or 1)
        log(f"llama-server: configuring llama.cpp with cmake (log: {log_path})")
        _run(configure, build_log, log_path)
        log(f"llama-server: compiling (several minutes on 2 cores; progress in {log_path})")
        _run(compile_, build_log, log_path)
        built = build_dir / "bin" / "llama-server"
        if not built.is_file():
            raise BuildError(f"the build finished without {built}; see {log_path}")
        partial = out_dir / "llama-server.partial"
        shutil.copy2(built, partial)
        partial.rename(cached_binary(version))
    seconds = time.perf_counter() - started
    info = {"llama_cpp_python": version, "cmake_flags": list(CMAKE_FLAGS), "seconds": seconds}
    (out_dir / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"llama-server: built in {seconds:.0f} s, cached at {cached_binary(version)}")
    return cached_binary(version)


def build_commands(
    cmake: str, source: Path, build_dir: Path, jobs: int
) -> tuple[list[str], list[str]]:
    """The cmake configure and build command lines (Ninja when it is installed)."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [cmake, "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_FLAGS]
    compile_ = [cmake, "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)]
    return configure, compile_


def extract_vendored_llama_cpp(sdist: Path, into: Path) -> Path:
    """Unpack only ``*/vendor/llama.cpp/**`` of the sdist under ``into``; returns that tree."""
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in f"{m.name}/"]
        if not members:
            raise BuildError(f"{sdist.name} has no vendor/llama.cpp tree")
        archive.extractall(into, members=members, filter="data")
    trees = sorted(into.glob("*/vendor/llama.cpp"))
    if not trees or not (trees[0] / "CMakeLists.txt").is_file():
        raise BuildError(f"{sdist.name}: vendor/llama.cpp has no CMakeLists.txt")
    return trees[0]


def _download_command(version: str, into: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        f"llama-cpp-python=={version}", "-d", str(into),
    ]  # fmt: skip


def _run(command: list[str], build_log: TextIO, log_path: Path) -> None:
    """Run ``command`` with its output appended to the build log; BuildError with the log's
    last lines when it fails."""
    build_log.write(f"$ {' '.join(command)}\n")
    build_log.flush()
    try:
        done = subprocess.run(command, stdout=build_log, stderr=subprocess.STDOUT, check=False)
    except OSError as exc:
        raise BuildError(f"{command[0]} could not run: {exc}") from exc
    if done.returncode != 0:
        build_log.flush()
        tail = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        raise BuildError(
            f"`{' '.join(command[:4])} ...` exited with {done.returncode}; last lines of "
            f"{log_path}:\n" + "\n".join(tail)
        )
