"""Request bodies of the native (SGLang-compatible) API. Unknown fields are refused (400)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from runtime.generate_input import MAX_TOP_LOGPROBS
from runtime.request_checks import INT64_MAX, CacheSalt
from runtime.sampling_params import SamplingParamsInput

RequestId = Annotated[str, StringConstraints(min_length=1, max_length=1024)]


class NativeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class GenerateReqInput(NativeRequest):
    """``POST /generate``: exactly one of ``text`` and ``input_ids``, each single or a batch.

    ``sampling_params`` is one dict for all prompts or one per prompt (validated by
    ``SamplingParams.from_dict``). ``rid`` is one id, or one per prompt for a batch.
    ``cache_salt``: share cached KV only with requests of the same salt.
    ``require_reasoning``: with the server's reasoning parser, constraints start after the
    reasoning and results carry it apart (``runtime.server.native_api``). Checked further and
    expanded by ``runtime.generate_input.GenerateInput``.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsInput | list[SamplingParamsInput] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, ge=-1, le=INT64_MAX)
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: RequestId | list[RequestId] | None = None
    cache_salt: CacheSalt | None = None
    require_reasoning: bool = False


class AbortReqInput(NativeRequest):
    """``POST /abort_request``: abort the running request with this id and salt (the one its
    request gave); 404 if none is running."""

    rid: RequestId
    cache_salt: CacheSalt | None = None
