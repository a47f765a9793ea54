"""Per-request sampling and stopping parameters (SGLang's native field names), validated."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object")


class InvalidSamplingParams(ValueError):
    """A sampling parameter is missing its contract; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"sampling_params.{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    # Constrained decoding: at most one of these (the grammar package validates them).
    json_schema: Any = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: Any = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False
    grammar_best_effort: bool = False  # compile schema features the backend cannot enforce
    grammar_max_whitespace: int = 0  # 0: compact JSON; N: ", " / ": " and whitespace runs <= N

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_grammar(self) -> bool:
        return any(getattr(self, name) not in (None, False, (), "") for name in GRAMMAR_FIELDS)

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Parse and validate; raise InvalidSamplingParams naming the first bad field."""
        params = dict(params or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - names)
        if unknown:
            raise InvalidSamplingParams(unknown[0], "unknown parameter")
        for name in ("stop", "stop_regex", "choice"):
            value = params.get(name)
            if isinstance(value, str):
                params[name] = (value,)
            elif value is not None:
                params[name] = tuple(value)
        if params.get("stop_token_ids") is not None:
            params["stop_token_ids"] = tuple(params["stop_token_ids"])
        if params.get("logit_bias") is not None:
            try:
                params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"].items()}
            except (AttributeError, TypeError, ValueError):
                raise InvalidSamplingParams("logit_bias", "must map token ids to numbers") from None
        for name in ("stop", "stop_token_ids", "stop_regex"):
            if params.get(name) is None:
                params.pop(name, None)
        try:
            result = cls(**params)
        except TypeError as exc:
            raise InvalidSamplingParams("?", str(exc)) from None
        result.validate()
        return result

    def validate(self, vocab_size: int | None = None) -> None:
        _check_int(self, "max_new_tokens", low=0)
        _check_int(self, "min_new_tokens", low=0)
        _check_int(self, "n", low=1)
        _check_int(self, "top_k", low=-1)
        if self.top_k == 0:
            raise InvalidSamplingParams("top_k", "must be -1 (off) or >= 1, got 0")
        _check_number(self, "temperature", low=0.0)
        _check_number(self, "top_p", low=0.0, high=1.0, low_open=True)
        _check_number(self, "min_p", low=0.0, high=1.0)
        _check_number(self, "frequency_penalty", low=-2.0, high=2.0)
        _check_number(self, "presence_penalty", low=-2.0, high=2.0)
        _check_number(self, "repetition_penalty", low=0.0, low_open=True, high=2.0**16)
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidSamplingParams(
                "min_new_tokens",
                f"{self.min_new_tokens} exceeds max_new_tokens {self.max_new_tokens}",
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidSamplingParams("seed", f"must be an integer, got {self.seed!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidSamplingParams("stop", "stop strings must be non-empty strings")
        for token in self.stop_token_ids:
            if not isinstance(token, int) or token < 0 or (vocab_size and token >= vocab_size):
                raise InvalidSamplingParams("stop_token_ids", f"invalid token id {token!r}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or (vocab_size and token >= vocab_size):
                raise InvalidSamplingParams("logit_bias", f"token id {token} is out of range")
            if not math.isfinite(bias) and bias != -math.inf:
                raise InvalidSamplingParams("logit_bias", f"bias {bias} for {token} is invalid")
        grammars = [n for n in GRAMMAR_FIELDS if getattr(self, n) not in (None, False, (), "")]
        if len(grammars) > 1:
            raise InvalidSamplingParams(
                grammars[1], f"only one constraint per request; also got {grammars[0]}"
            )


def _check_int(params: SamplingParams, name: str, low: int) -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingParams(name, f"must be an integer, got {value!r}")
    if value < low:
        raise InvalidSamplingParams(name, f"must be >= {low}, got {value}")


def _check_number(
    params: SamplingParams,
    name: str,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
) -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InvalidSamplingParams(name, f"must be a number, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise InvalidSamplingParams(name, f"must lie in {bracket}{low}, {high}], got {value}")
