"""One generate call, validated once and expanded into the sub-requests the scheduler runs.

``GenerateInput.parse`` normalises the Engine's ``generate`` arguments and the native
``POST /generate`` body alike (SGLang's fields: ``text`` or ``input_ids``, one prompt or a
batch; ``sampling_params`` one for all prompts or one per prompt; ``rid`` one, or one per
prompt). Everything is checked before any prompt is tokenized; a bad value raises
``InvalidRequestValue`` (or ``InvalidSamplingParams``) naming the field. ``expand`` makes one
``SubRequest`` per prompt and per sample of ``n``, prompt-major; the OpenAI completions and
chat handlers call it on the prompts they render, and the Responses API makes its one
``SubRequest`` itself.

Sub-request ids follow the shape of the request, one suffix per dimension it has:

- prompt i of a batch is ``{rid}-{i}``, or ``rid[i]`` when ``rid`` is a list;
- with ``n`` > 1, sample j of a prompt is ``{the prompt's id}-{j}``.

So one prompt with n == 1 runs as ``rid``, its n samples as ``rid-0`` .. ``rid-{n-1}``, a
batch's prompts as ``rid-0``, ``rid-1``, ... and their samples as ``rid-{i}-{j}``. Without a
rid, sub-requests have none (the tokenizer manager labels them with internal ids). Sample j
uses seed + j when a seed is given (``SamplingParams.for_sample``). Every sub-request of a call
carries the call's ``cache_salt``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.ipc import CachePin
from runtime.request_checks import (
    InvalidRequestValue,
    check_cache_salt,
    check_text,
    check_token_ids,
)
from runtime.sampling_params import RequestLimits, SamplingParams

if TYPE_CHECKING:
    from runtime.tokenizer_manager import RequestOutput
    from runtime.validate_retry import ValidatedGeneration

# Alternatives returned per position with logprobs.
MAX_TOP_LOGPROBS = 1024

# Sampling params as a caller gives them: one dict (or None) for all prompts, or one per prompt.
SamplingParamsGiven = dict[str, Any] | list[Any] | None
# Token ids of ``text``; ``field`` names it in the error if the tokenizer refuses it.
Tokenize = Callable[[str, str], Awaitable[list[int]]]


@dataclass(frozen=True)
class LogprobOptions:
    """What logprobs a request returns: none, or those of the output (and of the prompt from
    ``logprob_start_len``, -1 for none), each with ``top_logprobs_num`` alternatives."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0

    def check(self) -> None:
        """Raise InvalidRequestValue naming the field unless the values are in range."""
        if self.logprob_start_len < -1:
            raise InvalidRequestValue(
                "logprob_start_len", f"must be -1 (none) or >= 0, got {self.logprob_start_len}"
            )
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise InvalidRequestValue(
                "top_logprobs_num",
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}",
            )


@dataclass(frozen=True)
class SubRequest:
    """One request to the scheduler: a prompt with one sample's sampling params (n == 1).
    ``prompt_index`` and ``sample_index`` place it in the request it came from; it shares
    cached KV only with requests of the same ``cache_salt``."""

    input_ids: list[int]
    sampling: SamplingParams
    rid: str | None = None
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    prompt_index: int = 0
    sample_index: int = 0
    cache_salt: str | None = None
    routing_key: str | None = None  # the client's cache-affinity key (GenerateRequest's)
    pin: CachePin | None = None  # what of its KV stays cached after it (GenerateRequest's)

    def run(
        self, generation: ValidatedGeneration, stream: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Its outputs (``TokenizerManager.generate``, through validate-and-retry): with
        ``stream`` one per output step, else one at the end."""
        return generation.generate(
            self.input_ids,
            self.sampling,
            rid=self.rid,
            return_logprob=self.logprobs.return_logprob,
            logprob_start_len=self.logprobs.logprob_start_len,
            top_logprobs_num=self.logprobs.top_logprobs_num,
            stream=stream,
            cache_salt=self.cache_salt,
            routing_key=self.routing_key,
            pin=self.pin,
        )


def expand(
    prompts: Sequence[list[int]],
    sampling: Sequence[SamplingParams],
    rids: Sequence[str | None] | None = None,
    logprobs: LogprobOptions | None = None,
    cache_salt: str | None = None,
    routing_key: str | None = None,
    pin: CachePin | None = None,
) -> list[SubRequest]:
    """Prompt i's ``sampling[i].n`` samples as sub-requests, prompt-major (sub-request
    ``i * n + j`` when every prompt has the same n). ``rids[i]`` is prompt i's id (None: no
    ids); with n > 1 its samples are ``{rids[i]}-{j}``. The samples share the prompt's KV
    through the radix cache, all under ``cache_salt`` (checked by the caller), and carry
    ``routing_key`` (the client's cache-affinity key) and ``pin``."""
    rids = rids if rids is not None else [None] * len(prompts)
    logprobs = logprobs or LogprobOptions()
    subs = []
    for i, (ids, params, rid) in enumerate(zip(prompts, sampling, rids, strict=True)):
        for j in range(params.n):
            sub_rid = rid if rid is None or params.n == 1 else f"{rid}-{j}"
            subs.append(
                SubRequest(
                    list(ids), params.for_sample(j), sub_rid, logprobs, i, j, cache_salt,
                    routing_key, pin,
                )
            )
    return subs


@dataclass(frozen=True)
class GenerateInput:
    """A generate call, validated: its prompts (texts, or token ids checked against the
    vocabulary), each prompt's sampling params and id, the logprob options and the cache salt.
    ``text_field`` is what the caller calls the text (``prompt`` in the Engine), for errors."""

    prompts: list[str | list[int]]  # all texts, or all token ids
    sampling: list[SamplingParams]
    rids: list[str | None]
    is_batch: bool
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    text_field: str = "text"
    cache_salt: str | None = None
    pin: CachePin | None = None

    @classmethod
    def parse(
        cls,
        text: str | list[str] | None,
        input_ids: Sequence[Any] | None,
        sampling_params: SamplingParamsGiven,
        rid: str | list[str] | None,
        logprobs: LogprobOptions,
        limits: RequestLimits,
        text_field: str = "text",
        cache_salt: str | None = None,
        pin_ttl_s: float | None = None,
    ) -> GenerateInput:
        """Validate a call's fields. Raise InvalidRequestValue naming the field (the text as
        ``text_field``) or InvalidSamplingParams naming the parameter. ``pin_ttl_s``: keep
        each prompt's and output's KV cached that many seconds after it finishes."""
        if text is None and input_ids is None:
            raise InvalidRequestValue(text_field, f"missing: give {text_field} or input_ids")
        if text is not None and input_ids is not None:
            raise InvalidRequestValue("input_ids", f"give {text_field} or input_ids, not both")
        prompts: list[Any]
        if text is not None:
            is_batch = isinstance(text, list)
            prompts = list(text) if isinstance(text, list) else [text]
            given = text_field
        else:
            assert input_ids is not None
            is_batch = len(input_ids) > 0 and isinstance(input_ids[0], list)
            prompts = list(input_ids) if is_batch else [input_ids]
            given = "input_ids"
        if not prompts:
            raise InvalidRequestValue(given, "the batch is empty")
        logprobs.check()
        check_cache_salt(cache_salt)
        pin = None
        if pin_ttl_s is not None:
            if not isinstance(pin_ttl_s, int | float) or not 0 < pin_ttl_s < float("inf"):
                raise InvalidRequestValue("pin_ttl_s", "must be a positive number of seconds")
            pin = CachePin(float(pin_ttl_s))
        sampling = _parse_sampling(sampling_params, len(prompts), limits)
        rids = _prompt_rids(rid, len(prompts), is_batch)
        for i, prompt in enumerate(prompts):
            name = f"{given}.{i}" if is_batch else given
            if text is not None:
                if not isinstance(prompt, str):
                    raise InvalidRequestValue(name, f"expected text, got {type(prompt).__name__}")
                check_text(prompt, name)
                continue
            if is_batch and not isinstance(prompt, list):
                raise InvalidRequestValue(name, "expected a list of token ids")
            check_token_ids(prompt, limits.vocab_size, name)
            prompts[i] = list(prompt)
        return cls(prompts, sampling, rids, is_batch, logprobs, text_field, cache_salt, pin)

    async def sub_requests(self, tokenize: Tokenize) -> list[SubRequest]:
        """Tokenize the texts (``tokenize`` names the field if it refuses one) and expand."""
        ids: list[list[int]] = []
        for i, prompt in enumerate(self.prompts):
            if isinstance(prompt, str):
                name = f"{self.text_field}.{i}" if self.is_batch else self.text_field
                ids.append(await tokenize(prompt, name))
            else:
                ids.append(prompt)
        return expand(
            ids, self.sampling, self.rids, self.logprobs, self.cache_salt, pin=self.pin
        )


def _parse_sampling(
    params: SamplingParamsGiven, count: int, limits: RequestLimits
) -> list[SamplingParams]:
    """Each prompt's sampling params: one dict for all, or a list of one per prompt."""
    if not isinstance(params, list):
        return [SamplingParams.from_dict(params, limits)] * count
    if len(params) != count:
        raise InvalidRequestValue("sampling_params", f"{len(params)} given for {count} prompts")
    return [SamplingParams.from_dict(p, limits) for p in params]


def _prompt_rids(rid: str | list[str] | None, count: int, is_batch: bool) -> list[str | None]:
    """Each prompt's id: ``rid`` itself for one prompt, ``{rid}-{i}`` or ``rid[i]`` for a
    batch."""
    if rid is None:
        return [None] * count
    if isinstance(rid, list):
        if len(rid) != count:
            raise InvalidRequestValue("rid", f"{len(rid)} given for {count} prompts")
        return list(rid)
    return [f"{rid}-{i}" for i in range(count)] if is_batch else [rid]
