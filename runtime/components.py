"""The one assembly of the three components: scheduler, detokenizer and tokenizer manager.

The in-process Engine builds all three in one process, ``arbor serve`` one in each of its
processes, a ``--dp`` replica the scheduler and the detokenizer. Each gives
``build_components`` the channel ends it has; a component is built where its inbox is given.
Torch is imported only where a scheduler is built.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.channels import Receiver, Sender
from runtime.heartbeat import Heartbeat
from runtime.model_files import load_tokenizer
from runtime.server_args import ServerArgs

if TYPE_CHECKING:
    from runtime.detokenizer import DetokenizerManager
    from runtime.scheduler.scheduler import Scheduler
    from runtime.tokenizer_manager import TokenizerManager


@dataclass(frozen=True)
class Channels:
    """Each component's inbox and the senders to the others, as one process holds them."""

    scheduler_inbox: Receiver | None = None
    detokenizer_inbox: Receiver | None = None
    tokenizer_inbox: Receiver | None = None
    to_scheduler: Sender | None = None
    to_detokenizer: Sender | None = None
    to_tokenizer: Sender | None = None
    # Where the scheduler's loop proves it turns, read by the server process (/health).
    scheduler_heartbeat: Heartbeat | None = None


@dataclass
class Components:
    """What ``build_components`` built; None for a component whose inbox was not given."""

    channels: Channels
    scheduler: Scheduler | None
    detokenizer: DetokenizerManager | None
    tokenizer_manager: TokenizerManager | None
    tokenizer: Any  # the model's tokenizer; None where only a scheduler was built

    def run_detokenizer(self) -> None:
        """The detokenizer's loop, until a None message arrives."""
        assert self.detokenizer is not None and self.channels.detokenizer_inbox is not None
        assert self.channels.to_tokenizer is not None
        self.detokenizer.event_loop(self.channels.detokenizer_inbox, self.channels.to_tokenizer)

    def start_threads(self, run_scheduler: Callable[[], None]) -> list[threading.Thread]:
        """Run ``run_scheduler`` (which runs the scheduler's loop) and the detokenizer on
        daemon threads of this process, as the Engine and a replica do."""
        threads = [
            threading.Thread(target=run_scheduler, name="scheduler", daemon=True),
            threading.Thread(target=self.run_detokenizer, name="detokenizer", daemon=True),
        ]
        for thread in threads:
            thread.start()
        return threads


def build_components(args: ServerArgs, channels: Channels, replica: int = 0) -> Components:
    """Build the components whose inbox ``channels`` holds, wired to the senders it holds
    (``replica``: a ``--dp`` replica's index, which its scheduler's disk tier is kept under).

    The scheduler comes first: a model that cannot be loaded raises ModelLoadError before the
    others exist. Raises AssertionError if a built component's sender is missing.
    """
    scheduler = tokenizer = detokenizer = tokenizer_manager = None
    if channels.scheduler_inbox is not None:
        from runtime.scheduler.scheduler import Scheduler  # imports torch

        assert channels.to_detokenizer is not None and channels.to_tokenizer is not None
        scheduler = Scheduler(
            args,
            channels.scheduler_inbox,
            channels.to_detokenizer,
            channels.to_tokenizer,
            replica,
            channels.scheduler_heartbeat,
        )
    if channels.detokenizer_inbox is not None or channels.tokenizer_inbox is not None:
        tokenizer = load_tokenizer(args.model_path, args.tokenizer_path, args.chat_template)
    if channels.detokenizer_inbox is not None:
        from runtime.detokenizer import DetokenizerManager

        detokenizer = DetokenizerManager(tokenizer)
    if channels.tokenizer_inbox is not None:
        from runtime.tokenizer_manager import TokenizerManager

        assert channels.to_scheduler is not None
        tokenizer_manager = TokenizerManager(tokenizer, channels.to_scheduler, max_n=args.max_n)
    return Components(channels, scheduler, detokenizer, tokenizer_manager, tokenizer)
