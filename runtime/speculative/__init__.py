"""Speculative decoding: draft proposers and the verification of their drafts."""

from runtime.speculative.draft_worker import ChooseFn, DraftJob, DraftModelWorker

__all__ = ["ChooseFn", "DraftJob", "DraftModelWorker"]
