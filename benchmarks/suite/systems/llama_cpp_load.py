"""Loading a GGUF file into llama.cpp on a machine whose CPU advertises AMX it cannot run.

ggml built for the CPU it runs on puts quantized weights into extra buffer types (AMX tiles
where the CPU reports ``amx_int8``, repacked layouts for some types). On the 2026-11-26 VM
(Intel Xeon under KVM, ``amx_bf16 amx_int8 amx_tile`` in its flags) the first matmul on an AMX
buffer dies: SIGSEGV at ``ldtilecfg`` in ``ggml_backend_amx_mul_mat``, for llama-cpp-python and
llama-server alike; float32 files never use those buffers and run. llama.cpp's switch is
``use_extra_bufts`` (llama-server: ``--no-repack``): the weights stay in the plain CPU buffer
and run on its AVX-512 kernels. Whether a file needs it is probed once per process, in a child
process (a crash there costs the probe only), so machines where the extra buffers work keep them;
without llama-cpp-python there is no probe, and llama-server keeps its defaults.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

PROBE = """
import sys
from llama_cpp import Llama
Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False).eval([1, 2, 3])
"""
NO_EXTRA_BUFFERS_NOTE = (
    "llama.cpp's extra buffer types (AMX, repacking) crash on this CPU (SIGSEGV), so they "
    "are off: use_extra_bufts=False / --no-repack"
)


@functools.lru_cache(maxsize=16)
def extra_buffers_crash(gguf: str) -> bool:
    """Whether llama.cpp dies evaluating ``gguf`` with its default (extra) buffer types."""
    if importlib.util.find_spec("llama_cpp") is None:
        return False
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, gguf], capture_output=True, text=True, timeout=300
    )
    if probe.returncode == 0:
        return False
    if probe.returncode < 0:  # killed by a signal: the crash this module works around
        return True
    raise RuntimeError(f"llama.cpp cannot load {gguf}: {probe.stderr.strip()[-500:]}")


def open_llama(gguf: str, **kwargs: Any) -> Any:
    """``llama_cpp.Llama(model_path=gguf, **kwargs)``, without extra buffer types where they
    crash (``extra_buffers_crash``)."""
    from llama_cpp import Llama

    crash = extra_buffers_crash(gguf)
    with _without_extra_buffers() if crash else contextlib.nullcontext():
        return Llama(model_path=gguf, **kwargs)


def server_flags(gguf: str) -> list[str]:
    """llama-server flags ``gguf`` needs here: ``--no-repack`` where extra buffers crash."""
    return ["--no-repack"] if extra_buffers_crash(gguf) else []


@contextlib.contextmanager
def _without_extra_buffers() -> Iterator[None]:
    """``Llama`` has no argument for ``use_extra_bufts``; it starts from
    ``llama_model_default_params()``, so that is wrapped while one model loads."""
    import llama_cpp.llama_cpp as bindings

    default = bindings.llama_model_default_params

    def params() -> Any:
        chosen = default()
        chosen.use_extra_bufts = False
        return chosen

    bindings.llama_model_default_params = params
    try:
        yield
    finally:
        bindings.llama_model_default_params = default
