"""Keeping the cyclic garbage collector's full passes off the serving path.

Once started, a serving process holds a few hundred thousand long-lived objects that are never
garbage (the model's modules and parameters, the tokenizer, the imported libraries' state:
421,000 tracked objects in an in-process Engine on the `small` model). CPython's oldest-generation
collection walks every one of them, and it runs whenever enough new container objects have
survived, which a busy step loop produces: measured on the 2-core VM, 215-250 ms per full
collection, landing in the middle of a forward step or between two (one per tree-of-thought
benchmark round, about 7% of its wall time). ``freeze_startup_heap`` collects once and moves
everything alive at the end of startup into the permanent generation, which collections skip:
the same full collections then take 11-14 ms. Objects created later are collected as usual;
frozen ones that later become cyclic garbage stay until ``unfreeze_heap`` (an in-process Engine
calls it on shutdown). ``--disable-gc-freeze`` leaves the heap alone; tensor-parallel ranks
other than 0 always freeze (they run nothing but the leader's forwards, and their flags are the
model runner's).
"""

from __future__ import annotations

import atexit
import gc
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)
_unfreeze_at_exit = False
# gc.get_freeze_count() walks the frozen generation (~20 ms for a server's heap): counted once
# at each freeze, read by /get_server_info without stalling the scheduler's thread.
_frozen_objects = 0


def freeze_startup_heap(where: str, args: ServerArgs | None = None) -> bool:
    """Collect, then freeze every object alive now, unless ``args`` says
    ``--disable-gc-freeze`` (None: always). Returns whether it froze."""
    if args is not None and args.disable_gc_freeze:
        return False
    gc.collect()
    gc.freeze()
    global _frozen_objects
    _frozen_objects = gc.get_freeze_count()
    # At exit the objects go back to the collector, so the interpreter's last collections free
    # them (frozen ones outlive the extension modules' teardown: triton's nanobind bindings
    # then report each as leaked).
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    logger.debug("%s: %d objects frozen out of the collector's passes", where, _frozen_objects)
    return True


def unfreeze_heap() -> None:
    """Hand frozen objects back to the collector (an in-process engine that shuts down: what it
    held in reference cycles can be freed again)."""
    global _frozen_objects
    gc.unfreeze()
    _frozen_objects = 0


def frozen_objects() -> int:
    """How many objects the last freeze left out of the collector's passes (0 unfrozen)."""
    return _frozen_objects
