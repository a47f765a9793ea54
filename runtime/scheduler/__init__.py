"""The scheduler process: one thread that owns the model, the KV pool and the radix tree.

``scheduler``: ``Scheduler``, the loop (receive, pick the next batch, run it, process the
results) that composes the managers, each with one job: ``prefill_admission`` (which waiting
requests prefill), ``decode_manager`` (a slot for every running decode, retracting under
pressure), ``kv_manager`` (``KVCacheManager``: a request's KV from admission to release, on
``runtime/kv_accounting.py``), ``grammar_manager`` (constraints and their masks),
``output_processor`` (after a forward: tokens, stops, outputs) and ``program_admission`` with
``program_pins`` (compiled DSL programs). ``req``: ``Req``, the scheduler's view of one request,
each part written by one manager. ``step_batch``: ``StepBatch``, one step's work. Observers read
``activity_log`` and ``cache_view``; ``disk_tier`` keeps what the pool loses on disk.

Importing the package loads none of them (nor torch): each name loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports

if TYPE_CHECKING:
    from runtime.scheduler.kv_manager import KVCacheManager
    from runtime.scheduler.req import Req, Status
    from runtime.scheduler.scheduler import Scheduler
    from runtime.scheduler.step_batch import StepBatch

__all__, __getattr__ = lazy_exports(__name__)
