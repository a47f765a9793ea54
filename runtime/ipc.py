"""Messages between the tokenizer manager, the scheduler and the detokenizer, and their codec.

Grouped by direction. In ``serve`` mode they cross process boundaries over ZMQ; the in-process
Engine passes the same objects through queues. Nothing else crosses between the three.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.sampling_params import SamplingParams

# ---- tokenizer manager -> scheduler -------------------------------------------------------


@dataclass(frozen=True)
class ProgramStep:
    """A request that is one step of a compiled DSL program (``runtime/program``).

    ``continue_from``: the branch whose pinned KV this request's prompt extends; its first
    ``reuse_len`` tokens are that branch's tokens, so admission starts from the pinned node
    instead of matching the prompt from the root (fewer when token healing re-encoded the
    branch's last tokens). ``keep_as``: when the request finishes, pin the KV of its prompt and
    output under this branch (replacing the branch's pin). ``group``: requests of one fork,
    admitted together. Keys are branch names within ``program``.
    """

    program: str
    continue_from: str | None = None
    reuse_len: int = 0
    keep_as: str | None = None
    group: str | None = None


@dataclass
class ProgramRelease:
    """Unpin the KV of ``branches`` of ``program`` (all of its branches when None): the
    program joined those branches or ended."""

    program: str
    branches: list[str] | None = None


@dataclass(frozen=True)
class CachePin:
    """Keep a request's KV cached after it finishes (``RadixCache.pin``): the first
    ``prompt_tokens`` tokens of its prompt (None: its whole prompt and output) for ``ttl_s``
    seconds, capped at ``--max-pin-seconds``. Pins give way to running requests, so a pin
    saves recomputation but never refuses work."""

    ttl_s: float
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class PinPrefix:
    """Pin the cached prefix of ``token_ids`` in ``cache_salt``'s namespace for ``ttl_s``
    seconds (``RadixCache.pin``, capped at ``--max-pin-seconds``): the server's word, once it
    has read a finished turn's tool calls (only it parses them), that the turn (its prompt and
    output, which the scheduler cached as the request finished) waits on tools whose results
    come back in the next turn (``--tool-wait-ttl``). A prefix evicted meanwhile is not pinned."""

    token_ids: list[int]
    ttl_s: float
    cache_salt: str | None = None


@dataclass
class GenerateRequest:
    """One tokenized request. ``logprob_start_len`` -1: no prompt logprobs. ``cache_salt``:
    the request reuses cached KV only of requests with the same salt (None is a salt of its
    own); checked by the tokenizer manager (printable ASCII, at most 256 characters).
    ``routing_key``: the client's cache-affinity key (OpenAI's ``prompt_cache_key``); a routed
    server (``--dp``) sends the requests of one key and salt to one replica. ``pin``: what
    of its KV to keep cached after it finishes, and for how long (None: nothing, LRU only)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    program: ProgramStep | None = None
    cache_salt: str | None = None
    routing_key: str | None = None
    pin: CachePin | None = None


@dataclass
class AbortRequest:
    rid: str


class ControlCommand(enum.StrEnum):
    """What a ControlRequest asks the scheduler; ``args`` as noted."""

    FLUSH_CACHE = "flush_cache"
    SERVER_INFO = "server_info"
    CHECK_INVARIANTS = "check_invariants"
    CACHE_TREE = "cache_tree"  # args: max_nodes
    DASHBOARD = "dashboard"  # args: max_nodes
    NODE_PREFIX = "node_prefix"  # args: node


@dataclass
class ControlRequest:
    """A ControlCommand; answered by a ControlReply with the same ``request_id``."""

    request_id: str
    command: ControlCommand
    args: dict[str, Any] = field(default_factory=dict)


# ---- scheduler -> detokenizer -------------------------------------------------------------


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended: "stop" (an EOS or stop token, a stop string or regex: ``matched``;
    None when the grammar ended the output), "length" (``max_new_tokens`` or the context:
    ``length``), or "abort" — by the caller, or with an error for them (``status_code``,
    ``message``, and ``param``: the sampling parameter it is about, if one is). ``to_dict``
    is the shape APIs return as ``meta_info["finish_reason"]``."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    param: str | None = None

    @classmethod
    def stop(cls, matched: int | str | None) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def cut(cls, length: int) -> FinishReason:
        return cls("length", length=length)

    @classmethod
    def aborted(cls) -> FinishReason:
        return cls("abort", message="aborted")

    @classmethod
    def error(cls, status_code: int, message: str, param: str | None = None) -> FinishReason:
        return cls("abort", message=message, status_code=status_code, param=param)

    @property
    def failed(self) -> bool:
        return self.status_code is not None

    def to_dict(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        reason: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            reason["status_code"] = self.status_code
        return reason


@dataclass(frozen=True)
class SpeculationStats:
    """A speculating request's numbers so far: forward steps that gave it tokens, draft
    tokens proposed for it, and those the target accepted."""

    steps: int
    draft_tokens: int
    accepted_tokens: int

    def to_meta(self, completion_tokens: int) -> dict[str, Any]:
        """The ``meta_info`` entries: ``spec_accept_len`` is the mean number of tokens one
        forward gave the request (1.0 without speculation)."""
        return {
            "spec_verify_ct": self.steps,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_accept_len": completion_tokens / self.steps if self.steps else 0.0,
        }


@dataclass(frozen=True)
class PhaseTimes:
    """Where a finished request's time went in the scheduler, in seconds: waiting before its
    first admission (grammar compilation included), from then to its first output token (its
    prefill, chunks and retractions included), and from that token to its finish. Phases it
    never reached are 0."""

    queue_s: float
    prefill_s: float
    decode_s: float

    def to_meta(self) -> dict[str, float]:
        """The ``meta_info`` entries."""
        return {
            "queue_time": self.queue_s,
            "prefill_time": self.prefill_s,
            "decode_time": self.decode_s,
        }


@dataclass
class TokenOutput:
    """New tokens of one request since its last TokenOutput, and its state."""

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Decoding options the detokenizer needs (stop strings are trimmed there).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    no_stop_trim: bool = False
    # Sent with a request's first output: the prompt's last tokens give the incremental
    # decoder context, so the first word's leading space decodes right (SentencePiece).
    prompt_tail_ids: list[int] | None = None
    # Logprob entries are (logprob, token_id, [(logprob, token_id), ...] top alternatives).
    output_logprobs: list[tuple[float, int, list[tuple[float, int]]]] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int, list[tuple[float, int]]]] | None = None
    spec: SpeculationStats | None = None  # when the request speculates
    times: PhaseTimes | None = None  # on its last output only
    # With the final output: how the request's constraint was applied (a JSON layout it
    # asked for and could not get), for the caller's meta_info.
    grammar_notes: tuple[str, ...] = ()


@dataclass
class TokenOutputBatch:
    outputs: list[TokenOutput]


# ---- detokenizer -> tokenizer manager ---------------------------------------------------


@dataclass
class TextOutput:
    """What a client sees: the new text (complete UTF-8 characters only) and the request state."""

    rid: str
    text_delta: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[tuple[float, int, list[tuple[float, int]]]] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int, list[tuple[float, int]]]] | None = None
    spec: SpeculationStats | None = None
    grammar_notes: tuple[str, ...] = ()
    times: PhaseTimes | None = None
    # The detokenizer failed this request while the scheduler still runs it: the tokenizer
    # manager fails the caller, aborts it, and waits for the scheduler's final output.
    detokenizer_failed: bool = False


@dataclass
class TextOutputBatch:
    outputs: list[TextOutput]


# ---- scheduler -> tokenizer manager -----------------------------------------------------


@dataclass
class ControlReply:
    request_id: str
    payload: dict[str, Any]


@dataclass
class SchedulerReady:
    """Sent once, when the model is loaded and the loop is running."""

    info: dict[str, Any]


@dataclass
class SchedulerFailed:
    """The scheduler hit an unrecoverable error; the server reports it and exits."""

    error: str


def encode(message: object) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)
