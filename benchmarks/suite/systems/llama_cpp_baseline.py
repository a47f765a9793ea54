"""Baseline: llama.cpp through ``llama-cpp-python``, on the same GGUF file, or on a GGUF
conversion of the same folder.

``Llama`` runs one sequence at a time and keeps the KV of the previous prompt, reusing its
longest common prefix (a one-slot prefix cache). A user loops over the work: groups (sessions,
programs) one after another, each group's calls in order. Generating calls take
``len(output_ids)`` greedy tokens from ``Llama.generate`` (which never stops at EOS by itself);
prefill-only calls (select's scoring) evaluate the prompt. Before any number is trusted, the
file is checked against transformers on the same model: the tokenizer, the last-token logits
of a long prompt and 32 greedy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.suite.contention import measured
from benchmarks.suite.systems.gguf_export import UnsupportedModel
from benchmarks.suite.systems.llama_cpp_load import (
    NO_EXTRA_BUFFERS_NOTE,
    extra_buffers_crash,
    open_llama,
)
from benchmarks.suite.systems.model_source import context_length, llama_cpp_file, load_hf_model
from benchmarks.suite.trace import Call, Clock, SystemRun, Timing, replay_arrival

NOTE = "one sequence at a time, group by group; reuses the previous prompt's prefix"
CHECK_TEXT = "def parse(self, value):\n    return value.strip() + 'ok'  # Hello, world!\n"


@dataclass
class Outcome:
    """``run`` when the baseline ran; else ``reason`` says why not. ``check`` holds the
    conversion check's numbers (when it got that far)."""

    run: SystemRun | None = None
    reason: str = ""
    check: dict[str, Any] = field(default_factory=dict)


def replay(model_path: str, calls: list[Call], note: str = "", gguf: str | None = None) -> Outcome:
    """Convert a folder (cached), load, check, then replay ``calls``; any failure is an
    Outcome with a reason, so the rest of the benchmark still runs."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return Outcome(
            reason=f"llama_cpp not importable ({exc}); pip install -e '.[bench]' "
            "and llama-cpp-python (builds from source, ~9 min)"
        )
    try:
        path = Path(gguf) if gguf else llama_cpp_file(model_path)
    except (UnsupportedModel, ImportError, OSError) as exc:
        return Outcome(reason=f"GGUF conversion failed: {exc}")
    longest = max(len(c.prompt_ids) + c.output_len for c in calls) + 8
    llm = open_llama(
        str(path),
        n_ctx=min(max(longest, 1024), context_length(model_path)),
        n_threads=torch.get_num_threads(),
        n_threads_batch=torch.get_num_threads(),
        verbose=False,
    )
    try:
        check = check_against_transformers(llm, model_path)
    except UnsupportedModel as exc:
        return Outcome(reason=f"no check against transformers possible: {exc}")
    if not check["ok"]:
        return Outcome(reason=f"conversion check failed: {check}", check=check)
    buffers = NO_EXTRA_BUFFERS_NOTE if extra_buffers_crash(str(path)) else ""
    full_note = "; ".join(x for x in (NOTE, buffers, note) if x)
    return Outcome(run=measured(lambda: LlamaCppReplay(llm).run(calls, full_note)), check=check)


def check_against_transformers(llm: Any, model_path: str) -> dict[str, Any]:
    """Tokenizer equality, max |logit difference| at the last of ~300 prompt tokens, and how
    many of 32 greedy tokens agree; ``ok`` when the tokens and the greedy run are identical."""
    import llama_cpp

    text = CHECK_TEXT * 12
    ids, reference, greedy = transformers_reference(model_path, text)
    tokenizer_equal = llm.tokenize(text.encode(), add_bos=True, special=True) == ids
    llm.reset()
    llm.eval(ids)
    last_row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # overwritten by the next eval
    logits = np.ctypeslib.as_array(last_row, shape=(llm.n_vocab(),)).copy()
    theirs = _take(llm, tuple(ids), 32)
    llm.reset()
    same = sum(a == b for a, b in zip(greedy, theirs, strict=True))
    return {
        "tokenizer_equal": tokenizer_equal,
        "prompt_tokens": len(ids),
        "max_abs_logit_diff": float(np.abs(reference - logits).max()),
        "greedy_tokens_equal": f"{same}/32",
        "ok": tokenizer_equal and same == 32,
    }


def transformers_reference(
    model_path: str, text: str, new_tokens: int = 32
) -> tuple[list[int], np.ndarray, list[int]]:
    """What transformers (float32) makes of ``text``: its token ids, the logits after the last
    one (shape [vocab]) and ``new_tokens`` greedy tokens (EOS not stopping them)."""
    from runtime.model_files import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    model = load_hf_model(model_path)
    ids = tokenizer(text).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].numpy()
        greedy = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )[0, len(ids) :].tolist()
    return ids, logits, greedy


class LlamaCppReplay:
    """Replays calls on one ``Llama`` (sequential), timing each token as it is yielded."""

    name = "llama.cpp"

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def run(self, calls: list[Call], note: str) -> SystemRun:
        _take(self.llm, (10, 11, 12, 13), 2)  # warm-up, untimed
        self.llm.reset()
        order = sorted(range(len(calls)), key=lambda i: (calls[i].group, calls[i].wave, i))
        timings: list[Timing] = [Timing(0.0)] * len(calls)
        outputs: list[tuple[int, ...]] = [()] * len(calls)
        finished: dict[tuple[int, int], float] = {}
        reused = 0
        clock = Clock()
        with tqdm(total=len(calls), desc=self.name, unit="req", leave=False) as bar:
            for i in order:
                call = calls[i]
                timing = Timing(max(replay_arrival(call, finished), 0.0))
                reused += self._reusable(call.prompt_ids)
                if call.output_len:
                    outputs[i] = _take(self.llm, call.prompt_ids, call.output_len, clock, timing)
                else:
                    self._prefill(call.prompt_ids)
                timing.finish = clock()
                timings[i] = timing
                key = (call.group, call.wave)
                finished[key] = max(finished.get(key, 0.0), timing.finish)
                bar.update(1)
        prompt_tokens = sum(len(c.prompt_ids) for c in calls)
        return SystemRun(self.name, calls, timings, outputs, clock(), reused / prompt_tokens, note)

    def _reusable(self, prompt: tuple[int, ...]) -> int:
        """How many prompt tokens ``Llama.generate`` will reuse from the previous sequence
        (its rule: the common prefix, one less when it covers the whole prompt)."""
        common = 0
        for a, b in zip(self.llm._input_ids.tolist(), prompt, strict=False):
            if a != b:
                break
            common += 1
        return common - 1 if common == len(prompt) and common else common

    def _prefill(self, prompt: tuple[int, ...]) -> None:
        """Evaluate the prompt after the reusable prefix, as ``generate`` would before sampling."""
        self.llm.n_tokens = self._reusable(prompt)
        self.llm.eval(list(prompt[self.llm.n_tokens :]))


def _take(
    llm: Any,
    prompt: tuple[int, ...],
    count: int,
    clock: Clock | None = None,
    timing: Timing | None = None,
) -> tuple[int, ...]:
    """``count`` greedy tokens from ``Llama.generate`` (EOS does not stop it)."""
    tokens: list[int] = []
    for token in llm.generate(list(prompt), temp=0.0):
        tokens.append(token)
        if clock is not None and timing is not None:
            timing.token_times.append(clock())
        if len(tokens) == count:
            break
    return tuple(tokens)
