"""Validate-and-retry, a wrapper around ``TokenizerManager.generate``: a json_schema request in
strict mode "validate" compiles the schema's enforceable part (best effort), each finished
output is checked against the whole schema (``grammar.output_validator``, in a killable process:
a schema's patterns may backtrack for ever), and the request is drawn again (seed + attempt
when seeded) until an output passes; with ``grammar_prefix_len`` (a prefilled answer) the check
reads the prefill and the output together. Every other request passes straight through."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from runtime.errors import RequestError
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tokenizer_manager import (
    TOKENIZE_THREADS,
    RequestOutput,
    TokenizerManager,
    final_output,
)


class ValidatedGeneration:
    """``generate`` as the tokenizer manager's, with validate-and-retry. The defaults of
    json_schema requests that set none: ``args.schema_strict_mode``,
    ``schema_validation_attempts``; ``schema_validation_timeout``: one output check's limit."""

    def __init__(self, manager: TokenizerManager, args: ServerArgs) -> None:
        self.manager = manager
        self.strict_mode = args.schema_strict_mode
        self.attempts = args.schema_validation_attempts
        self.timeout = args.schema_validation_timeout
        self._checker: Any = None  # grammar.validate.ValidationPool, started on first use

    def close(self) -> None:
        """Stop the output checkers (if any started)."""
        if self._checker is not None:
            self._checker.shutdown()

    async def generate(
        self, input_ids: list[int], sampling_params: SamplingParams, **options: Any
    ) -> AsyncIterator[RequestOutput]:
        """``TokenizerManager.generate``'s outputs. A request validated: after its attempts
        fail, RequestError 422 naming what the last output broke; an output cut by
        max_new_tokens is returned unchecked, as in exact mode (its finish_reason says so);
        greedy requests get one attempt (another would repeat it); a stream gets the whole
        output in one chunk once it has passed; ``validation_attempts``: the outputs drawn."""
        params = sampling_params
        mode = params.strict_mode or self.strict_mode
        if params.json_schema is None or mode != "validate":
            async for output in self.manager.generate(input_ids, params, **options):
                yield output
            return
        schema = params.json_schema
        schema_text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            json.loads(schema_text)
        except ValueError as exc:
            message = f"json_schema is not valid JSON: {exc}"
            raise RequestError(message, 400, "json_schema") from None
        attempts = 1 if params.is_greedy else params.validation_attempts or self.attempts
        compiled = dataclasses.replace(params, grammar_best_effort=True, strict_mode="validate")
        stream = options.pop("stream", False)
        prefill = input_ids[len(input_ids) - params.grammar_prefix_len :]
        prefix = self.manager.tokenizer.decode(prefill) if params.grammar_prefix_len else ""
        reason = ""
        for attempt in range(attempts):
            sample = compiled.for_sample(attempt)
            final = await final_output(self.manager.generate(input_ids, sample, **options))
            failure = await self._check(schema_text, final, prefix)
            if failure is None:
                final.validation_attempts = attempt + 1
                if stream:
                    final.delta = final.text
                yield final
                return
            reason = failure
        raise RequestError(
            f"no output satisfied json_schema in {attempts} attempt"
            f"{'s' if attempts > 1 else ''} (strict_mode validate); the last: {reason}",
            422,
            "json_schema",
        )

    async def _check(self, schema_text: str, final: RequestOutput, prefix: str) -> str | None:
        """What ``prefix`` + ``final`` breaks in the schema (None: nothing, or it was cut by
        length)."""
        from grammar.validate import ValidationPool, ValidationTimeout

        if final.finish_reason is not None and final.finish_reason.type == "length":
            return None
        if self._checker is None:
            self._checker = ValidationPool(TOKENIZE_THREADS, self.timeout)
        loop = asyncio.get_running_loop()
        try:
            failure: str | None = await loop.run_in_executor(
                None, self._checker.check, schema_text, prefix + final.text
            )
        except (ValueError, ValidationTimeout) as exc:  # the schema's fault
            raise RequestError(f"json_schema: {exc}", 400, "json_schema") from None
        return failure
