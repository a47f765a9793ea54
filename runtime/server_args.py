"""All runtime configuration in one frozen dataclass, and the one place CLI flags become it."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
# auto: the model's compute dtype. The names map to torch dtypes in runtime.memory_pool.
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16")
# kernels.BACKENDS, named here so that parsing flags does not import torch (a test keeps the
# two equal).
KERNEL_BACKENDS = ("auto", "torch", "triton", "native")
# runtime.server.reasoning.REASONING_FORMATS, named here for the same reason (a test keeps the
# two equal).
REASONING_PARSERS = ("qwen3", "deepseek-r1")
# Tool-call formats of chat completions (runtime.server.tool_call_formats; qwen is hermes),
# named here for the same reason (a test keeps the two equal).
TOOL_CALL_PARSERS = ("hermes", "qwen", "llama3", "mistral")
# Flags whose values argparse checks, so a bad one is refused before anything loads.
_CLI_CHOICES = {
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "kernel_backend": KERNEL_BACKENDS,
    "reasoning_parser": REASONING_PARSERS,
    "tool_call_parser": TOOL_CALL_PARSERS,
}


@dataclass(frozen=True)
class ServerArgs:
    """Configuration of an Engine or server. Field names follow SGLang's server arguments."""

    model_path: str
    tokenizer_path: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda when available, else cpu
    kernel_backend: str = "auto"  # auto | torch | triton | native
    context_length: int | None = None  # default: the model's max_position_embeddings
    # KV memory
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens; None: mem_fraction_static
    mem_fraction_static: float = 0.3
    kv_cache_dtype: str = "auto"  # auto | fp32 | bf16 | fp16: the dtype K/V are stored in
    # Scheduling
    max_running_requests: int = 128
    # New prompt tokens per step and the longest chunk of one prompt (<= 0: no chunking).
    # None: 2048 / 1024 on CPU, where a big step stalls every running stream, 16384 / 8192 on GPU.
    max_prefill_tokens: int | None = None
    chunked_prefill_size: int | None = None
    schedule_policy: str = "lpm"
    schedule_conservativeness: float = 1.0  # scales the KV reserved for running decodes
    starvation_timeout_s: float = 10.0  # a request waiting this long is admitted first
    lpm_max_queue: int = 128  # queues longer than this fall back from lpm to fcfs
    disable_radix_cache: bool = False
    eviction_policy: str = "lru"
    # Sampling
    random_seed: int = 0
    # Grammar
    grammar_backend: str = "xgrammar"
    grammar_compile_timeout: float = 30.0  # hard deadline of one constraint's preparation
    grammar_workers: int = 2  # processes that prepare constraints (each killable)
    disable_jump_forward: bool = False
    # Run each step's CPU work that does not need its logits while the forward runs.
    disable_overlap_schedule: bool = False
    # Decode requests sharing a prefix attend to it in one batched pass (runtime/cascade.py).
    disable_cascade_attention: bool = False
    # Keep projection weights in torch's plain layout (F.linear) instead of oneDNN's on CPU.
    disable_weight_packing: bool = False
    # On CUDA, decode batches of up to cuda_graph_max_bs requests replay CUDA graphs captured
    # at start-up (runtime/cuda_graph_runner.py). None: min(max_running_requests, 160).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # Serving
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    stream_interval: int = 1
    max_request_bytes: int = 8 * 1024 * 1024
    header_timeout_s: float = 10.0  # a request line and headers must arrive within this
    body_timeout_s: float = 30.0  # a request body must arrive within this (else 408)
    timeout_keep_alive_s: int = 5  # idle keep-alive connections are closed after this
    max_connections: int = 4096  # concurrent connections; beyond them uvicorn answers 503
    max_n: int = 128  # the largest n (samples per prompt) a request may ask for
    responses_store_size: int = 1024  # responses kept for GET and previous_response_id
    # Split chat outputs into reasoning_content and content, and start constraints after the
    # reasoning (runtime/server/reasoning.py): qwen3 | deepseek-r1; None: no reasoning model.
    reasoning_parser: str | None = None
    # How chat completions write and read tool calls: hermes | qwen | llama3 | mistral.
    # None: detected from the chat template (hermes when it gives no hint).
    tool_call_parser: str | None = None
    # Debugging
    debug_invariants: bool = False  # check radix-cache accounting after every step
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                f"got {self.schedule_policy!r}"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}, "
                f"got {self.kernel_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"max_total_tokens must be at least {2 * self.page_size}")

    def prefill_budgets(self, device_type: str) -> tuple[int, int]:
        """(max_prefill_tokens, chunked_prefill_size) with device defaults filled in."""
        cpu = device_type == "cpu"
        step = self.max_prefill_tokens or (2048 if cpu else 16384)
        chunk = self.chunked_prefill_size
        if chunk is None:
            chunk = 1024 if cpu else 8192
        return step, chunk

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments, naming any that are not server arguments."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server arguments: {', '.join(unknown)}")
        return cls(model_path=model_path, **kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field: ``--max-total-tokens`` for ``max_total_tokens``."""
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                parser.add_argument(flag, action="store_true", default=f.default)
            elif f.name == "model_path":
                parser.add_argument(flag, required=True)
            else:
                kind = {"int": int, "float": float}.get(str(f.type).replace(" | None", ""), str)
                choices = _CLI_CHOICES.get(f.name)
                parser.add_argument(flag, type=kind, default=f.default, choices=choices)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
