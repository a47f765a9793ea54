"""Native CPU kernels: a C++ extension built with ``torch.utils.cpp_extension``.

``make install`` builds it (``python -m arbor_kernels.cpu_native``) into the cache directory under
a key made of the sources, the compiler flags, torch's version and the CPU, so a source change,
a torch upgrade or another CPU gets a fresh build. At run time ``load()`` only imports a build
that already exists: a missing or failed build means the torch reference runs, with one
warning that says how to build. Nothing here is imported unless the native backend is wanted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

NAME = "arbor_cpu_kernels"
SOURCES = (
    "module.cpp",
    "attention.cpp",
    "elementwise.cpp",
    "quantized.cpp",
    "sampling.cpp",
    "kv_chunks.cpp",
    "deterministic.cpp",
)
HEADERS = ("common.h", "spin_pool.h")
# -march=native: AVX-512 where the building CPU has it, AVX2 or SSE where not. No -ffast-math:
# the kernels rely on -inf for masked keys; the reductions vectorize through `omp simd`.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-DNDEBUG")
_HERE = Path(__file__).resolve().parent
_state: dict[str, object] = {"module": None, "error": None, "tried": False}


def build_dir() -> Path:
    """Where this source tree's build for this torch and CPU lives."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((_HERE / name).read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(f"{sys.version_info[:2]}{platform.machine()}{_cpu_flags()}".encode())
    root = os.environ.get("ARBOR_CACHE_DIR") or Path.home() / ".cache" / "arbor"
    return Path(root) / "cpu_kernels" / digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _built_library(directory: Path) -> Path | None:
    found = sorted(directory.glob(f"{NAME}*.so"))
    return found[0] if found else None


def build(verbose: bool = False) -> Path:
    """Compile the extension (a minute or so) and return the built library's path."""
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=NAME,
        sources=[str(_HERE / name) for name in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=verbose,
    )
    library = _built_library(directory)
    if library is None:
        raise RuntimeError(f"the build left no {NAME}*.so in {directory}")
    return library


def load() -> ModuleType | None:
    """The built extension module, or None (after one warning) when there is no usable build."""
    if _state["tried"]:
        return _state["module"]  # type: ignore[return-value]
    _state["tried"] = True
    library = _built_library(build_dir())
    try:
        if library is None:
            raise FileNotFoundError(
                "not built for these sources, this torch and this CPU; build with "
                "`python -m arbor_kernels.cpu_native` (make install does)"
            )
        spec = importlib.util.spec_from_file_location(NAME, library)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # a broken build must never take the CPU path down
        _state["error"] = exc
        logger.warning("native CPU kernels unavailable, using the torch reference: %s", exc)
        return None
    _state["module"] = module
    return module


def load_error() -> Exception | None:
    """Why ``load()`` returned None (None when it has not been called or succeeded)."""
    return _state["error"]  # type: ignore[return-value]
