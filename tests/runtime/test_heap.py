"""An engine freezes its startup heap out of the garbage collector's passes, and gives it back."""

from __future__ import annotations

import gc
from pathlib import Path

from runtime import Engine


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
