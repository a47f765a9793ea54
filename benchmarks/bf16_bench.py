"""bfloat16 weights on CPU against float32: the projections alone, single-stream decode, and
top-1 agreement, on a bfloat16 Hugging Face checkpoint made from a GGUF file.

The checkpoint: the file (default: the built-in SmolLM2-135M-Instruct) loaded by transformers'
GGUF loader (dequantized), its weights copied into a fresh ``LlamaForCausalLM`` and saved in
bfloat16 with ``save_pretrained``, beside Arbor's converted config (``dtype: bfloat16``) and
tokenizer; made once, cached under the Arbor cache directory.

- ``linears``: microseconds per projection at M rows, on the model's shapes (q/o, k/v,
  gate|up, down, the LM head): oneDNN-packed float32 (what float32 runs), ``F.linear`` on
  bfloat16 (what ``--dtype bfloat16`` ran before packing), oneDNN-packed bfloat16 (what it runs
  now where the CPU has AVX512-BF16), and packed bfloat16 fed float32 (converted each call).
- ``decode``: an ``Engine`` per dtype on the checkpoint, a ``--prompt-len`` prompt of English
  text, ``--steps`` greedy tokens streamed: prefill tokens/s (to the first token) and decode
  tokens/s (the tokens after the first over their time); ``--rounds`` interleaved, best kept.
- ``agreement``: next-token top-1 agreement of bfloat16 against float32 logits over every
  position of the English passage (one prefill each; benchmarks.llama_cpp_agreement.compare).

    python -m benchmarks.bf16_bench [--model-path FILE.gguf] [--rounds 3] [--steps 64]
        [--prompt-len 512] [--skip linears,decode,agreement] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import ENGLISH_PASSAGE, machine, print_table, write_json
from benchmarks.llama_cpp_agreement import arbor_logits, compare
from benchmarks.suite.systems.arbor import stream_call
from benchmarks.suite.trace import Clock
from runtime.cache_dir import cache_root
from runtime.cpu_features import cpu_flags, has_bf16_dot
from runtime.layers.basic import pack_weight, packed_linear
from runtime.model_files import load_tokenizer, locate_model, resolve_model_path

ROWS = (1, 8, 32, 512)
DTYPES = ("float32", "bfloat16")
# Arbor's converted folder holds these besides config.json; the weights come from transformers.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")  # fmt: skip


def bf16_checkpoint(model_path: str) -> Path:
    """The bfloat16 Hugging Face folder of GGUF file ``model_path``, made once and cached."""
    files = locate_model(model_path)
    assert files.gguf is not None, f"{model_path} is not a GGUF file"
    stat = files.path.stat()
    key = hashlib.sha256(f"{files.path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache_root() / "hf-bf16" / f"{files.path.stem}-{key[:12]}"
    if (out / "config.json").is_file():
        return out
    from transformers import LlamaForCausalLM

    from benchmarks.suite.systems.model_source import load_hf_model

    source = load_hf_model(str(files.path))  # refuses save_pretrained: marked quantized
    fresh = LlamaForCausalLM(source.config)
    fresh.load_state_dict(source.state_dict())
    partial = out.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    fresh.to(torch.bfloat16).save_pretrained(partial)
    for name in TOKENIZER_FILES:
        if (files.config_dir / name).is_file():
            shutil.copy(files.config_dir / name, partial / name)
    config = {**files.config(), "dtype": "bfloat16"}
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    partial.rename(out)
    return out


def _micros(call: Callable[[], Any], budget_s: float = 0.2) -> float:
    """Best microseconds per call over three timed batches, after two warm-up calls."""
    call(), call()
    start = time.perf_counter()
    call()
    count = max(1, int(budget_s / max(time.perf_counter() - start, 1e-6) / 3))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(count):
            call()
        best = min(best, (time.perf_counter() - start) / count)
    return best * 1e6


def linears(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Each option's microseconds per call for every (shape, rows)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = (config.get("num_key_value_heads") or heads) * (config.get("head_dim") or hidden // heads)
    shapes = {"q, o": (hidden, hidden), "k, v": (kv, hidden), "gate|up": (2 * inter, hidden),
              "down": (hidden, inter), "lm head": (config["vocab_size"], hidden)}  # fmt: skip
    bf16_dot = has_bf16_dot(cpu_flags())
    results = []
    gen = torch.Generator().manual_seed(0)
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features, generator=gen) * 0.05
        plain_bf16 = weight.bfloat16()
        packed = pack_weight(weight)
        packed_bf16 = pack_weight(plain_bf16) if bf16_dot else None
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=gen)
            row = {"shape": f"{name} {out_features}x{in_features}", "rows": rows}
            row.update(_options(x, plain_bf16, packed, packed_bf16))
            results.append(row)
    return results


def _options(
    x: torch.Tensor,
    plain_bf16: torch.Tensor,
    packed: torch.Tensor,
    packed_bf16: torch.Tensor | None,
) -> dict[str, float]:
    """Microseconds of each option on rows ``x`` (float32)."""
    x_bf16 = x.bfloat16()
    times = {
        "float32 packed": _micros(lambda: packed_linear(x, packed, None)),
        "bf16 F.linear": _micros(lambda: F.linear(x_bf16, plain_bf16)),
    }
    if packed_bf16 is not None:
        times["bf16 packed"] = _micros(lambda: packed_linear(x_bf16, packed_bf16, None))
        times["bf16 packed, float32 in/out"] = _micros(
            lambda: packed_linear(x.bfloat16(), packed_bf16, None).float()
        )
    return times


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""


def decode(folder: Path, dtype: str, prompt: list[int], steps: int) -> dict[str, float]:
    """Prefill and single-stream decode tokens/s of an Engine computing in ``dtype``."""
    from runtime import Engine

    sampling = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": steps + 1}
    engine = Engine(str(folder), dtype=dtype, device="cpu", disable_radix_cache=True,
                    max_total_tokens=len(prompt) + steps + 64, max_running_requests=1)  # fmt: skip
    with engine:

        async def run() -> tuple[float, float]:
            clock = Clock()
            _, timing, _ = await stream_call(engine, clock, tuple(prompt), sampling)
            first, last = timing.token_times[0], timing.token_times[-1]
            return len(prompt) / (first - timing.arrival), steps / (last - first)

        asyncio.run(run())  # warm-up
        rates = [asyncio.run(run()) for _ in range(2)]
    return {"prefill": max(r[0] for r in rates), "decode_b1": max(r[1] for r in rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="a GGUF file (default: the built-in model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip")
    parser.add_argument("--out", help="JSON results path")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    folder = bf16_checkpoint(resolve_model_path(args.model_path))
    config = json.loads((folder / "config.json").read_text())
    flags = cpu_flags()
    cpu = {"model": cpu_model(), "bf16_dot": has_bf16_dot(flags),
           "flags": sorted(f for f in flags if f.startswith(("avx512", "amx")))}  # fmt: skip
    print(f"checkpoint {folder}; {torch.get_num_threads()} threads; {cpu}", flush=True)
    payload: dict[str, Any] = {"checkpoint": str(folder), "cpu": cpu, "machine": machine(),
                               "threads": torch.get_num_threads()}  # fmt: skip
    if "linears" not in skip:
        table = linears(config)
        payload["linears"] = table
        options = [k for k in table[0] if k not in ("shape", "rows")]
        rows = [[r["shape"], r["rows"], *(round(r[k]) for k in options)] for r in table]
        print_table(["us per call", "M", *options], rows)
    ids = load_tokenizer(str(folder))(ENGLISH_PASSAGE.read_text()).input_ids
    if "decode" not in skip:
        prompt = (ids * (args.prompt_len // len(ids) + 1))[: args.prompt_len]
        rounds = [{d: decode(folder, d, prompt, args.steps) for d in DTYPES}
                  for _ in range(args.rounds)]  # fmt: skip
        best = {d: {k: max(r[d][k] for r in rounds) for k in rounds[0][d]} for d in DTYPES}
        payload.update(decode_rounds=rounds, decode_best=best)
        print_table(["tokens/s (best of rounds)", *DTYPES, "bfloat16 / float32"],
                    [[k, *(round(best[d][k], 1) for d in DTYPES),
                      f"{best['bfloat16'][k] / best['float32'][k]:.2f}x"]
                     for k in best["float32"]])  # fmt: skip
    if "agreement" not in skip:
        ours = arbor_logits(str(folder), ids, dtype="bfloat16")
        theirs = arbor_logits(str(folder), ids, dtype="float32")
        agreement = compare(ours, theirs, ids)
        payload["agreement"] = {"positions": agreement.positions, "rate": agreement.rate,
                                "bf16_text_top1": agreement.arbor_text_top1,
                                "float32_text_top1": agreement.llama_cpp_text_top1,
                                "max_abs_logit_diff": agreement.max_abs_logit_diff}  # fmt: skip
        print(f"top-1 agreement bfloat16 vs float32: {agreement.agreed}/{agreement.positions} "
              f"({agreement.rate:.1%}); next text token top-1: bfloat16 "
              f"{agreement.arbor_text_top1:.1%}, float32 {agreement.llama_cpp_text_top1:.1%}; "
              f"max |logit diff| {agreement.max_abs_logit_diff:.3f}")  # fmt: skip
    write_json("bf16_bench", payload, args.out)


if __name__ == "__main__":
    main()
