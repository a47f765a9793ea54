"""Per-request sampling and stopping parameters (SGLang's native field names), validated.

``SamplingParams`` declares each parameter once, with what a request may send for it;
``SamplingParamsInput``, derived from those fields, is the typed, strict model of what a request
may ask (the native API's ``sampling_params`` object, the OpenAI APIs' fields mapped onto it,
and the Engine's dicts): no string-to-bool or float-to-int coercion, ranges that the kernels
can hold, bounded stop lists. ``SamplingParams.from_dict`` validates through it (plus the checks
that need the model: vocabulary size and ``--max-n``, as ``RequestLimits``) and returns the
frozen dataclass the runtime passes around.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, create_model

from grammar.options import MAX_WHITESPACE
from runtime.request_checks import (
    INT64_MAX,
    INT64_MIN,
    InvalidRequestValue,
    check_json_value,
    main_error,
)
from runtime.server_args import StrictMode

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object")

# Bounds on what one request may ask; docs/serving.md lists them.
MAX_STOP_STRINGS = 64
MAX_VALIDATION_ATTEMPTS = 16
MAX_STOP_LENGTH = 1024  # characters
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_REGEXES = 16
MAX_STOP_REGEX_LENGTH = 1024
MAX_CHOICES = 4096
MAX_GRAMMAR_WHITESPACE = MAX_WHITESPACE
MAX_DRY_BREAKERS = 64
MAX_DRY_BREAKER_LENGTH = 64  # characters
# llama.cpp's and text-generation-webui's default DRY sequence breakers.
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")
DEFAULT_MAX_N = 128
# Temperatures below this sample greedily: dividing logits by less overflows float32.
GREEDY_TEMPERATURE = 1e-5
# |logit_bias| beyond this acts as this: the distribution is already its limit in float32
# (e^-10000 is 0), and larger values would turn logits into infinities.
MAX_LOGIT_BIAS = 1e4
_DECIMAL = re.compile(r"-?[0-9]{1,30}")


class InvalidSamplingParams(ValueError):
    """A sampling parameter is missing its contract; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"sampling_params.{field_name}: {message}")
        self.field = field_name
        self.reason = message


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against once the model is known."""

    vocab_size: int
    max_n: int = DEFAULT_MAX_N


StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_LENGTH)]
StopRegexPattern = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_REGEX_LENGTH)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
NonEmpty = Annotated[str, StringConstraints(min_length=1)]


def _sent(default: Any, accepts: Any = None, **constraints: Any) -> Any:
    """A ``SamplingParams`` field: its default, and what a request may send for it (``accepts``:
    a type other than the field's, ``constraints``: pydantic ``Field`` arguments)."""
    return dataclasses.field(default=default, metadata={"accepts": accepts, **constraints})


def _sent_fields() -> type[BaseModel]:
    """``SamplingParams``' fields as a pydantic model; a request leaves an empty tuple unset."""
    hints = typing.get_type_hints(SamplingParams)
    fields: dict[str, Any] = {}
    for spec in dataclasses.fields(SamplingParams):
        constraints = dict(spec.metadata)
        accepts = constraints.pop("accepts", None) or hints[spec.name]
        default = None if spec.default == () else spec.default
        if isinstance(default, tuple):  # a list, as a request sends it
            default = list(default)
        fields[spec.name] = (accepts, Field(default, **constraints))
    return create_model("SamplingParamsFields", **fields)


StopStrings = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None
DryBreakers = Annotated[
    list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_DRY_BREAKER_LENGTH)]],
    Field(max_length=MAX_DRY_BREAKERS),
]
StopRegexes = (
    StopRegexPattern | Annotated[list[StopRegexPattern], Field(max_length=MAX_STOP_REGEXES)]
) | None
Choices = (NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_CHOICES)]) | None
LogitBias = dict[str, Annotated[float, Field(allow_inf_nan=True)]] | None


@dataclass(frozen=True)
class SamplingParams:
    """One request's validated parameters; each field declares what a request may send for it
    (``SamplingParamsInput`` is derived from them)."""

    max_new_tokens: int = _sent(128, Count)
    min_new_tokens: int = _sent(0, Count)
    temperature: float = _sent(1.0, ge=0.0)
    top_p: float = _sent(1.0, gt=0.0, le=1.0)
    top_k: int = _sent(-1, ge=-1, le=INT64_MAX, description="-1: off; else 1..vocab size")
    min_p: float = _sent(0.0, ge=0.0, le=1.0)
    frequency_penalty: float = _sent(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = _sent(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = _sent(1.0, gt=0.0, le=2.0**16)
    # DRY, the sequence repetition penalty (runtime/dry_penalty.py); dry_multiplier 0: off.
    dry_multiplier: float = _sent(0.0, ge=0.0, le=1e3, description="DRY strength; 0: off")
    dry_base: float = _sent(1.75, ge=1.0, le=1e3, description="DRY growth per repeated token")
    dry_allowed_length: int = _sent(
        2, ge=1, le=INT64_MAX, description="DRY: repeats this long are not penalised"
    )
    dry_penalty_last_n: int = _sent(
        -1, ge=-1, le=INT64_MAX, description="DRY: the last N context tokens; -1 all, 0 off"
    )
    dry_sequence_breakers: tuple[str, ...] = _sent(
        DEFAULT_DRY_BREAKERS,
        DryBreakers,
        description="DRY: a token whose text contains one of these ends a repeat",
    )
    dry_output_only: bool = _sent(
        False, description="DRY: look for repeats in the output only, never in the prompt"
    )
    logit_bias: dict[int, float] | None = _sent(
        None, LogitBias, description="token id -> bias; -Infinity bans the token"
    )
    seed: int | None = _sent(None, Int64 | None)
    stop: tuple[str, ...] = _sent((), StopStrings)
    stop_token_ids: tuple[int, ...] = _sent(
        (), Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    )
    stop_regex: tuple[str, ...] = _sent((), StopRegexes)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = _sent(1, ge=1, le=INT64_MAX)
    # Constrained decoding: at most one of these (the grammar package validates them).
    json_schema: Any = _sent(None, dict[str, Any] | NonEmpty | None)
    regex: str | None = _sent(None, NonEmpty | None)
    ebnf: str | None = _sent(None, NonEmpty | None)
    structural_tag: Any = _sent(None, dict[str, Any] | NonEmpty | None)
    choice: tuple[str, ...] | None = _sent(None, Choices)
    json_object: bool = False
    grammar_best_effort: bool = False  # compile schema features the backend cannot enforce
    # JSON constraints' whitespace (grammar.options.GrammarOptions): json_format "aligned"
    # (None: the default) allows a pretty-printer's layouts, "compact" none; or, as before
    # json_format, grammar_max_whitespace 0 for compact JSON, N for whitespace runs <= N.
    json_format: str | None = _sent(
        None,
        Literal["aligned", "compact"] | None,
        description="JSON output: aligned (the default: the whitespace a pretty-printer "
        "writes, bounded) or compact (none)",
    )
    grammar_max_whitespace: int | None = _sent(
        None,
        Annotated[int, Field(ge=0, le=MAX_GRAMMAR_WHITESPACE)] | None,
        description="instead of json_format: 0 compact JSON, N whitespace runs of at most N",
    )
    # A prefilled answer (a continued assistant turn): the prompt's last N tokens are output
    # the constraint already covers; its matcher takes them before the first new token, so
    # the constraint holds over the prefill and the continuation together.
    grammar_prefix_len: int = _sent(
        0,
        Count,
        description="with a constraint: the prompt's last N tokens are output it already "
        "covers (a prefilled answer the output continues)",
    )
    # Reasoning models (runtime/scheduler/reasoning_gate.py): the constraint applies to the
    # output after the token that ends the reasoning (e.g. </think>), the thinking is free. With
    # a start token (e.g. <think>) the output may open its reasoning with it, or not reason at
    # all (then it is constrained from its first token); without, it starts inside the
    # reasoning. A prompt whose last non-whitespace token is the end token is already past it.
    reasoning_end_token_id: int | None = _sent(
        None,
        TokenId | None,
        description="with a constraint: it applies after this token (e.g. </think>)",
    )
    reasoning_start_token_id: int | None = _sent(
        None,
        TokenId | None,
        description="with reasoning_end_token_id: a first token that opens reasoning",
    )
    # Opt out of the server's speculative decoding (outputs are the same either way; this only
    # spares the verify work, e.g. for requests known not to repeat their context).
    no_speculation: bool = _sent(
        False, description="do not speculate for this request (--speculative-algorithm)"
    )
    # json_schema keywords no automaton enforces: "exact" refuses them; "validate" compiles the
    # rest, validates each finished output and draws again, up to validation_attempts outputs
    # (the tokenizer manager does it). None: the server's default (--schema-strict-mode).
    strict_mode: str | None = _sent(
        None,
        StrictMode | None,
        description="json_schema: exact (refuse what cannot be enforced) or validate (enforce "
        "what can be, validate finished outputs, draw again); default: --schema-strict-mode",
    )
    validation_attempts: int | None = _sent(
        None, ge=1, le=MAX_VALIDATION_ATTEMPTS, description="validate: the most outputs drawn"
    )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_grammar(self) -> bool:
        return self.grammar_field is not None

    @property
    def grammar_field(self) -> str | None:
        """The name of the constraint parameter that is set (at most one is), or None."""
        return next(
            (name for name in GRAMMAR_FIELDS if getattr(self, name) not in (None, False, (), "")),
            None,
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def has_dry(self) -> bool:
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``: n == 1 and, with a seed, seed + index
        (wrapping around within int64, so any valid seed works with any n)."""
        seed = self.seed
        if seed is not None:
            seed = (seed + index - INT64_MIN) % 2**64 + INT64_MIN
        return dataclasses.replace(self, n=1, seed=seed)

    @classmethod
    def from_dict(
        cls, params: dict[str, Any] | None, limits: RequestLimits | None = None
    ) -> SamplingParams:
        """Parse and validate; raise InvalidSamplingParams naming the first bad field.

        ``json_schema`` may also be a pydantic model class (the Engine's callers); ``logit_bias``
        keys may be ints or their decimal strings.
        """
        if params is not None and not isinstance(params, dict):
            raise InvalidSamplingParams("", f"must be an object, got {type(params).__name__}")
        raw = dict(params or {})
        schema = raw.get("json_schema")
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            raw["json_schema"] = schema.model_json_schema()
        bias = raw.get("logit_bias")
        if isinstance(bias, dict):
            raw["logit_bias"] = {_bias_key(k): v for k, v in bias.items()}
        try:
            checked = SamplingParamsInput.model_validate(raw)
        except ValidationError as exc:
            loc, message, kind = main_error(exc.errors())
            item = next((f"item {p}: " for p in loc[1:] if isinstance(p, int)), "")
            message = "unknown parameter" if kind == "extra_forbidden" else item + message
            raise InvalidSamplingParams(str(loc[0]) if loc else "", message) from None
        result = cls._from_input(checked)
        result.validate(limits)
        return result

    @classmethod
    def _from_input(cls, checked: SamplingParamsInput) -> SamplingParams:
        values = checked.model_dump()
        for name in ("stop", "stop_regex", "choice"):
            value = values[name]
            if isinstance(value, str):
                values[name] = (value,)
            elif value is not None:
                values[name] = tuple(value)
        for name in ("stop", "stop_regex"):
            values[name] = values[name] or ()
        values["stop_token_ids"] = tuple(values["stop_token_ids"] or ())
        values["dry_sequence_breakers"] = tuple(values["dry_sequence_breakers"])
        if values["logit_bias"] is not None:
            values["logit_bias"] = {
                _token_id(k): _clamped_bias(v) for k, v in values["logit_bias"].items()
            }
        return cls(**values)

    def validate(self, limits: RequestLimits | int | None = None) -> None:
        """The checks beyond the input model's: cross-field rules, surrogates and nesting in
        text and constraints, and (given ``limits``, or just a vocabulary size) token ids,
        ``top_k`` and ``n``. Raise InvalidSamplingParams naming the field."""
        if isinstance(limits, int):
            limits = RequestLimits(vocab_size=limits, max_n=INT64_MAX)
        if self.top_k == 0:
            raise InvalidSamplingParams("top_k", "must be -1 (off) or >= 1, got 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidSamplingParams(
                "min_new_tokens",
                f"{self.min_new_tokens} exceeds max_new_tokens {self.max_new_tokens}",
            )
        for token, bias in (self.logit_bias or {}).items():
            if math.isnan(bias) or bias == math.inf:
                raise InvalidSamplingParams(
                    "logit_bias", f"bias {bias} for token {token} is invalid"
                )
        grammars = [n for n in GRAMMAR_FIELDS if getattr(self, n) not in (None, False, (), "")]
        if len(grammars) > 1:
            raise InvalidSamplingParams(
                grammars[1], f"only one constraint per request; also got {grammars[0]}"
            )
        self._validate_reasoning_tokens(bool(grammars))
        if self.json_format is not None and self.grammar_max_whitespace is not None:
            raise InvalidSamplingParams(
                "json_format",
                "give json_format or grammar_max_whitespace, not both (both set the "
                "whitespace of JSON output)",
            )
        if self.strict_mode == "validate" and self.json_schema is None:
            raise InvalidSamplingParams("strict_mode", "validate needs a json_schema to check")
        try:
            for name in ("stop", "stop_regex", *GRAMMAR_FIELDS):  # json_object: a bool, passes
                check_json_value(getattr(self, name), name)
        except InvalidRequestValue as exc:
            raise InvalidSamplingParams(exc.field.split(".")[0], exc.reason) from None
        if limits is not None:
            self._validate_limits(limits)

    def _validate_reasoning_tokens(self, has_grammar: bool) -> None:
        end, start = self.reasoning_end_token_id, self.reasoning_start_token_id
        if start is not None and end is None:
            raise InvalidSamplingParams("reasoning_start_token_id", "needs reasoning_end_token_id")
        if end is not None and not has_grammar:
            raise InvalidSamplingParams(
                "reasoning_end_token_id",
                "needs a constraint (json_schema, regex, ebnf, choice, structural_tag or "
                "json_object) to start after the reasoning",
            )
        if start is not None and start == end:
            raise InvalidSamplingParams(
                "reasoning_start_token_id", "must differ from reasoning_end_token_id"
            )

    def _validate_limits(self, limits: RequestLimits) -> None:
        vocab = limits.vocab_size
        if self.top_k > vocab:
            raise InvalidSamplingParams(
                "top_k",
                f"must be -1 (off) or at most the vocabulary size {vocab}, got {self.top_k}",
            )
        if self.n > limits.max_n:
            raise InvalidSamplingParams(
                "n", f"must be at most {limits.max_n} (--max-n), got {self.n}"
            )
        for token in self.stop_token_ids:
            if token >= vocab:
                raise InvalidSamplingParams(
                    "stop_token_ids", f"token id {token} is outside the vocabulary [0, {vocab})"
                )
        for name in ("reasoning_end_token_id", "reasoning_start_token_id"):
            value = getattr(self, name)
            if value is not None and value >= vocab:
                raise InvalidSamplingParams(
                    name, f"token id {value} is outside the vocabulary [0, {vocab})"
                )
        for token in self.logit_bias or {}:
            if not 0 <= token < vocab:
                raise InvalidSamplingParams(
                    "logit_bias", f"token id {token} is outside the vocabulary [0, {vocab})"
                )


class SamplingParamsInput(_sent_fields()):  # type: ignore[misc]  # fields: SamplingParams'
    """A request's sampling parameters as sent: strict types, bounded sizes, finite numbers.

    Token ids are checked against the vocabulary, ``top_k`` against its size and ``n`` against
    ``--max-n`` by ``SamplingParams.from_dict`` when limits are given.
    """

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _bias_key(key: Any) -> Any:
    """logit_bias keys arrive as JSON strings ("42") or, from Python, as ints."""
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    return key


def _clamped_bias(bias: float) -> float:
    """-inf (a ban), NaN and +inf (refused later) as given; the rest within MAX_LOGIT_BIAS."""
    if math.isinf(bias) or math.isnan(bias):
        return bias
    return max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, bias))


def _token_id(key: str) -> int:
    if not _DECIMAL.fullmatch(key):
        raise InvalidSamplingParams("logit_bias", f"keys must be token ids, got {key!r}")
    token = int(key)
    if not 0 <= token <= INT64_MAX:
        raise InvalidSamplingParams("logit_bias", f"token id {token} is out of range")
    return token
