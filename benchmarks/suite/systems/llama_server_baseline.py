"""Baseline: llama.cpp's own HTTP server, ``llama-server``, on the same GGUF as the llama.cpp
baseline (the model's own file, or a folder's float32 conversion): what a CPU user would deploy
for serving.

The server runs on 127.0.0.1 with ``-np`` slots and continuous batching; each slot keeps the
KV of its last prompt (``cache_prompt``) and a request goes to the slot whose cache shares
the most with it. ``-np`` is the trace's peak concurrency (the most calls in one wave, which
can all run at once), at most ``MAX_SLOTS`` (Arbor's default ``max_running_requests``).
``-c`` is split evenly across slots, so it is ``slots x`` the longest call's context. Calls
stream from ``POST /completion`` with their exact prompt token ids, greedy, ``ignore_eos``,
``n_predict`` = Arbor's output length (0 for a scoring call: the prompt is only evaluated);
each call is sent as soon as its group's calls of earlier waves have finished (asyncio +
httpx, one connection per call; calls beyond the slots wait in the server's queue, which
counts in their TTFT). Before the replay the server is checked against transformers: the
tokenizer (``/tokenize``), 32 greedy tokens and the first token's top log-probabilities.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from tqdm import tqdm

from benchmarks.suite.contention import others_share, sample
from benchmarks.suite.systems.gguf_export import UnsupportedModel
from benchmarks.suite.systems.llama_cpp_baseline import (
    CHECK_TEXT,
    Outcome,
    transformers_reference,
)
from benchmarks.suite.systems.llama_cpp_load import server_flags
from benchmarks.suite.systems.llama_server_build import BuildError, find_or_build
from benchmarks.suite.systems.llama_server_process import LlamaServer, ServerConfig, ServerError
from benchmarks.suite.systems.llama_server_stream import (
    StreamedCompletion,
    completion_body,
    parse_event,
)
from benchmarks.suite.systems.model_source import llama_cpp_file
from benchmarks.suite.trace import Call, Clock, SystemRun, Timing

NOTE = "continuous batching, a prompt cache per slot; each call sent when ready"
MAX_SLOTS = 128
CONTEXT_MARGIN = 16  # n_predict may overshoot by a token or two (an incomplete UTF-8 piece)
CONTEXT_ALIGN = 256
CHECK_TOKENS = 32
CHECK_CONTEXT = 512  # the check's ~300-token prompt and its 32 tokens fit in every slot
CHECK_TOP = 5


def slot_count(calls: list[Call]) -> int:
    """The trace's peak concurrency: the most calls sharing one wave (they depend on no
    call of their own wave, so all may be in flight together), capped at ``MAX_SLOTS``."""
    per_wave: dict[int, int] = {}
    for call in calls:
        per_wave[call.wave] = per_wave.get(call.wave, 0) + 1
    return max(1, min(max(per_wave.values(), default=1), MAX_SLOTS))


def slot_context(calls: list[Call]) -> int:
    """KV tokens one slot needs: the longest prompt + output, with a margin, rounded up (at
    least ``CHECK_CONTEXT``)."""
    longest = max((len(c.prompt_ids) + c.output_len for c in calls), default=0)
    needed = max(longest + CONTEXT_MARGIN, CHECK_CONTEXT)
    return -(-needed // CONTEXT_ALIGN) * CONTEXT_ALIGN


def replay(
    model_path: str,
    calls: list[Call],
    note: str = "",
    gguf: str | None = None,
    binary: str | None = None,
    log: Callable[[str], None] = print,
) -> Outcome:
    """Find or build the server, convert a folder (cached), start, check, replay ``calls``,
    stop. Any failure is an Outcome with a reason, so the rest of the benchmark still runs."""
    try:
        server_binary = find_or_build(binary, log)
    except BuildError as exc:
        return Outcome(reason=f"llama-server unavailable: {exc}")
    try:
        path = Path(gguf) if gguf else llama_cpp_file(model_path)
    except (UnsupportedModel, ImportError, OSError) as exc:
        return Outcome(reason=f"GGUF conversion failed: {exc}")
    config = ServerConfig(
        server_binary,
        path,
        slot_count(calls),
        slot_context(calls),
        torch.get_num_threads(),
        free_port(),
        extra_flags=tuple(server_flags(str(path))),
    )
    log(f"llama-server: {' '.join(config.command())}")
    try:
        with LlamaServer(config.command(), config.url) as server:
            try:
                check = check_against_transformers(config.url, model_path)
            except UnsupportedModel as exc:
                return Outcome(reason=f"no check against transformers possible: {exc}")
            if not check["ok"]:
                return Outcome(reason=f"llama-server check failed: {check}", check=check)
            settings = ", ".join(
                [f"-np {config.slots}", f"-c {config.context}", f"-t {config.threads}",
                 *config.extra_flags]
            )  # fmt: skip
            full_note = "; ".join(x for x in (f"{NOTE} ({settings})", note) if x)
            start = sample((server.pid,))
            run = LlamaServerReplay(config.url).run(calls, full_note)
            run.other_cpu_share = others_share(start, sample((server.pid,)))
            return Outcome(run=run, check=check)
    except (ServerError, httpx.HTTPError, OSError) as exc:
        return Outcome(reason=f"llama-server failed: {exc}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def check_against_transformers(url: str, model_path: str) -> dict[str, Any]:
    """Tokenizer equality, ``CHECK_TOKENS`` greedy tokens and the max |log-probability
    difference| over the server's top ``CHECK_TOP`` candidates for the first token, against
    transformers; ``ok`` when the tokens and the greedy run are identical."""
    text = CHECK_TEXT * 12
    ids, logits, greedy = transformers_reference(model_path, text, CHECK_TOKENS)
    with httpx.Client(base_url=url, timeout=120) as client:
        tokenized = _ok(client.post("/tokenize", json={"content": text, "add_special": True}))
        body = {**completion_body(ids, CHECK_TOKENS), "stream": False, "cache_prompt": False}
        answer = _ok(client.post("/completion", json={**body, "n_probs": CHECK_TOP}))
    result = answer.json()
    theirs = list(result.get("tokens", []))[:CHECK_TOKENS]
    same = sum(a == b for a, b in zip(greedy, theirs, strict=False))
    tokenizer_equal = tokenized.json().get("tokens") == ids
    return {
        "tokenizer_equal": tokenizer_equal,
        "prompt_tokens": len(ids),
        "max_abs_logprob_diff_top": _top_logprob_diff(result, logits),
        "greedy_tokens_equal": f"{same}/{CHECK_TOKENS}",
        "ok": tokenizer_equal and same == CHECK_TOKENS,
    }


def _ok(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        raise ServerError(
            f"{response.request.url.path} answered HTTP {response.status_code}: "
            f"{response.text[:300]}"
        )
    return response


def _top_logprob_diff(result: dict[str, Any], logits: np.ndarray) -> float | None:
    """Max |server log-prob - transformers log-prob| over the first token's top candidates
    (None when the server returned none)."""
    probabilities = result.get("completion_probabilities") or []
    if not probabilities:
        return None
    top = probabilities[0].get("top_logprobs") or []
    reference = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
    diffs = [abs(float(c["logprob"]) - float(reference[int(c["id"])])) for c in top]
    return max(diffs, default=None)


class LlamaServerReplay:
    """Replays calls against a running llama-server, concurrently, each call streamed."""

    name = "llama-server"

    def __init__(self, url: str) -> None:
        self.url = url

    def run(self, calls: list[Call], note: str) -> SystemRun:
        """``calls`` (Arbor's, in sending order); timings and outputs aligned with them."""
        return asyncio.run(self._run(calls, note))

    async def _run(self, calls: list[Call], note: str) -> SystemRun:
        timeout = httpx.Timeout(None, connect=30.0)
        # No keep-alive: llama-server closes idle connections on its own timer, and a call sent
        # on a connection it just closed fails with "Server disconnected" (multi-turn and
        # tree-of-thought calls wait on earlier ones, so their connections sit idle).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits) as client:
            await self._stream(client, (10, 11, 12, 13), 2, Clock(), Timing(0.0))  # warm-up
            waves = _WaveTracker(calls)
            timings = [Timing(0.0) for _ in calls]
            streams = [StreamedCompletion(0) for _ in calls]
            clock = Clock()
            with tqdm(total=len(calls), desc=self.name, unit="req", leave=False) as bar:

                async def one(i: int) -> None:
                    call = calls[i]
                    await waves.ready(call)
                    timings[i] = Timing(clock())
                    streams[i] = await self._stream(
                        client, call.prompt_ids, call.output_len, clock, timings[i]
                    )
                    timings[i].finish = clock()
                    waves.finished(call)
                    bar.update(1)

                await asyncio.gather(*(one(i) for i in range(len(calls))))
            wall = clock()
            outputs: list[tuple[int, ...]] = []  # ids a stream held back: read now, untimed
            for call, stream in zip(calls, streams, strict=True):
                streamed = stream.output_ids
                outputs.append(
                    streamed if streamed is not None else await self._token_ids(client, call)
                )
        unstreamed = sum(stream.output_ids is None for stream in streams)
        if unstreamed:
            reread = (
                f"token ids of {unstreamed} calls re-read unstreamed, untimed (a token ending "
                "inside a UTF-8 character is never streamed)"
            )
            note = "; ".join(x for x in (note, reread) if x)
        prompt_tokens = sum(len(c.prompt_ids) for c in calls)
        cached = sum(stream.cache_n for stream in streams)
        return SystemRun(self.name, calls, timings, outputs, wall, cached / prompt_tokens, note)

    async def _stream(
        self,
        client: httpx.AsyncClient,
        prompt: tuple[int, ...],
        new_tokens: int,
        clock: Clock,
        timing: Timing,
    ) -> StreamedCompletion:
        """One streamed completion; each token's arrival time goes into ``timing``."""
        stream = StreamedCompletion(new_tokens)
        body = completion_body(prompt, new_tokens)
        async with client.stream("POST", "/completion", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:300]
                raise ServerError(f"/completion answered HTTP {response.status_code}: {detail!r}")
            async for line in response.aiter_lines():
                event = parse_event(line)
                if event is not None:
                    timing.token_times += [clock()] * stream.add(event)
        if not stream.stopped or stream.count != new_tokens:
            raise ServerError(f"llama-server returned {stream.count} of {new_tokens} tokens")
        return stream

    async def _token_ids(self, client: httpx.AsyncClient, call: Call) -> tuple[int, ...]:
        """The call's tokens from an unstreamed completion (which returns every id)."""
        body = {**completion_body(call.prompt_ids, call.output_len), "stream": False}
        tokens = _ok(await client.post("/completion", json=body)).json().get("tokens") or []
        return tuple(int(t) for t in tokens[: call.output_len])


class _WaveTracker:
    """Which waves of each group have finished, so a call waits for exactly its group's calls
    of earlier waves (as every replay does)."""

    def __init__(self, calls: list[Call]) -> None:
        self.pending: dict[tuple[int, int], int] = {}
        for call in calls:
            key = (call.group, call.wave)
            self.pending[key] = self.pending.get(key, 0) + 1
        self.done = {key: asyncio.Event() for key in self.pending}

    async def ready(self, call: Call) -> None:
        for (group, wave), event in self.done.items():
            if group == call.group and wave < call.wave:
                await event.wait()

    def finished(self, call: Call) -> None:
        key = (call.group, call.wave)
        self.pending[key] -= 1
        if not self.pending[key]:
            self.done[key].set()
