"""Baseline: transformers' batched ``generate``, what a user would write first.

Replays Arbor's calls wave by wave (calls of one wave do not depend on each other, so a user
could batch them): within a wave, batches of ``batch_size`` calls in order, left-padded, each
batch generating its longest requested output greedily with EOS suppressed
(``min_new_tokens``); a call's tokens are the first ``output_len`` of its row. Prefill-only
calls (select's scoring) are one forward pass over the batch. There is no cache across calls.
A call arrives when its group's calls of earlier waves have finished; its tokens are timed
as ``generate`` streams each step.
"""

from __future__ import annotations

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from benchmarks.suite.systems.model_source import load_hf_model
from benchmarks.suite.trace import Call, Clock, SystemRun, Timing, replay_arrival

NOTE = "batched generate, calls replayed wave by wave"


class StepTimes(BaseStreamer):
    """Records when ``generate`` emits each decoding step (its first ``put`` is the prompt)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(self.clock())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class TransformersBaseline:
    """A model folder or GGUF file loaded with ``AutoModelForCausalLM`` in float32 (as Arbor
    runs on CPU; a GGUF file's weights dequantized)."""

    name = "transformers"

    def __init__(self, model_path: str, batch_size: int = 16) -> None:
        self.model = load_hf_model(model_path)
        config = self.model.config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.batch_size = batch_size

    def replay(self, calls: list[Call], note: str = "") -> SystemRun:
        """Run ``calls`` (Arbor's, in sending order); timings and outputs aligned with them."""
        self._generate([(10, 11, 12, 13)], 2, Clock())  # warm-up, untimed
        timings: list[Timing | None] = [None] * len(calls)
        outputs: list[tuple[int, ...]] = [()] * len(calls)
        group_finish: dict[tuple[int, int], float] = {}
        clock = Clock()
        with tqdm(total=len(calls), desc=self.name, unit="req", leave=False) as bar:
            for wave in sorted({c.wave for c in calls}):
                members = [i for i, c in enumerate(calls) if c.wave == wave]
                arrivals = {i: replay_arrival(calls[i], group_finish) for i in members}
                for batch in _batches([i for i in members if calls[i].output_len], self.batch_size):
                    self._run_generate(calls, batch, arrivals, timings, outputs, clock)
                    bar.update(len(batch))
                for batch in _batches(
                    [i for i in members if not calls[i].output_len], self.batch_size
                ):
                    self._run_forward(calls, batch, arrivals, timings, clock)
                    bar.update(len(batch))
                for i in members:
                    key = (calls[i].group, wave)
                    group_finish[key] = max(group_finish.get(key, 0.0), _done(timings[i]).finish)
        wall = clock()
        return SystemRun(
            self.name,
            calls,
            [_done(t) for t in timings],
            outputs,
            wall,
            None,
            "; ".join(x for x in (NOTE, note) if x),
        )

    def _run_generate(
        self,
        calls: list[Call],
        batch: list[int],
        arrivals: dict[int, float],
        timings: list[Timing | None],
        outputs: list[tuple[int, ...]],
        clock: Clock,
    ) -> None:
        prompts = [calls[i].prompt_ids for i in batch]
        steps, rows = self._generate(prompts, max(calls[i].output_len for i in batch), clock)
        for i, row in zip(batch, rows, strict=True):
            n = calls[i].output_len
            timings[i] = Timing(arrivals[i], steps[:n], steps[n - 1])
            outputs[i] = row[:n]

    def _generate(
        self, prompts: list[tuple[int, ...]], new_tokens: int, clock: Clock
    ) -> tuple[list[float], list[tuple[int, ...]]]:
        """Greedy ``generate`` of exactly ``new_tokens`` per row: (step times, new tokens)."""
        ids, mask = self._left_pad(prompts)
        streamer = StepTimes(clock)
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                streamer=streamer,
            )
        rows = [tuple(r) for r in out[:, ids.shape[1] :].tolist()]
        return streamer.times, rows

    def _run_forward(
        self,
        calls: list[Call],
        batch: list[int],
        arrivals: dict[int, float],
        timings: list[Timing | None],
        clock: Clock,
    ) -> None:
        """Prompt logprobs over each prompt's last tokens (what scoring needs), no cache."""
        ids, mask = self._left_pad([calls[i].prompt_ids for i in batch])
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask, logits_to_keep=9).logits
            torch.log_softmax(logits, dim=-1)
        now = clock()
        for i in batch:
            timings[i] = Timing(arrivals[i], [], now)

    def _left_pad(self, prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return ids, mask


def _batches(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _done(timing: Timing | None) -> Timing:
    if timing is None:
        raise AssertionError("a replayed call was never run")
    return timing
