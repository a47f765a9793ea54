"""An engine freezes its startup heap out of the garbage collector's passes, and gives it back."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

from runtime import Engine

REPO = Path(__file__).resolve().parents[2]


def test_engine_freezes_its_startup_heap_until_shutdown(tiny_model_path: Path) -> None:
    gc.unfreeze()  # an engine another test left running would count here
    with Engine(tiny_model_path, max_total_tokens=1024, disable_gc_freeze=True) as engine:
        assert gc.get_freeze_count() == 0
        assert engine.get_server_info()["gc_frozen_objects"] == 0
    with Engine(tiny_model_path, max_total_tokens=1024) as engine:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the model, tokenizer and libraries' objects
        assert engine.get_server_info()["gc_frozen_objects"] > 10_000  # freed ones leave it
        out = engine.generate("hello", {"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 4 or out["meta_info"]["finish_reason"]
    assert gc.get_freeze_count() == 0  # shut down: its cycles can be collected again


def test_a_frozen_process_exits_without_leak_reports() -> None:
    # Objects still frozen at exit outlive the extension modules' teardown, and triton's
    # nanobind bindings print a "leaked" line for each; the freeze hands them back at exit.
    code = (
        "import triton, triton.language\n"
        "from runtime.heap import freeze_startup_heap\n"
        "freeze_startup_heap('test')\n"
        "freeze_startup_heap('twice')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr + done.stdout
