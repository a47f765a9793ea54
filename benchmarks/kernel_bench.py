"""Kernel speed: the triton kernels against torch on a GPU; the torch references on CPU.

On a GPU: decode attention (achieved HBM bandwidth vs the device's peak and vs torch SDPA on
gathered KV), extend attention (TFLOP/s vs torch SDPA flash on the same shapes), token-bitmask
application and sampling at batch 1/64/512 with a 151,936-token vocabulary, the elementwise
kernels, and end-to-end ``Engine`` decode throughput for the ``qwen2.5-0.5b-shape`` test model
at batch 1 and 64 (triton vs torch kernels).

On CPU (``--cpu``, or no GPU): the native quantized linear layers on SmolLM2-135M's shapes
(``bench_quantized_linear``), the torch references at small shapes; with TRITON_INTERPRET=1
in the environment, also a tiny correctness smoke of every triton kernel under the
interpreter (interpreted timings mean nothing).

    python -m benchmarks.kernel_bench [--quick] [--skip-engine]
    TRITON_INTERPRET=1 python -m benchmarks.kernel_bench --cpu
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch
from arbor_kernels import dispatch
from arbor_kernels.reference import attention as ref_attention
from arbor_kernels.reference import elementwise as ref_elementwise
from arbor_kernels.reference import sampling as ref_sampling

from benchmarks.common import best_time, print_table, write_json

VOCAB = 151936
# Peak HBM bandwidth (bytes/s) by device-name fragment; the first match wins.
PEAK_HBM = [
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
]
# (name, query heads, KV heads, head dim)
MODELS = [("qwen2.5-0.5b", 14, 2, 64), ("llama-3-8b", 32, 8, 128)]
Row = dict[str, Any]


def _time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return best_time(fn) * 1e3


def _paged_kv(
    batch: int, seq_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """K/V pools with each sequence in shuffled 16-slot pages, as the runtime allocates them."""
    page, pages_per_seq = 16, -(-seq_len // 16)
    order = torch.randperm(batch * pages_per_seq, device=device).view(batch, pages_per_seq)
    table = (order[:, :, None] * page + torch.arange(page, device=device)).flatten(1)
    slots = batch * pages_per_seq * page
    k = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=device)
    rows = torch.arange(batch, device=device)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int64, device=device)
    return k, v, table.contiguous(), rows, seq_lens


def _impls(op: str, device: torch.device) -> dict[str, Callable[..., Any]]:
    """The implementations to time: triton and the torch reference on a GPU, the reference
    alone on CPU (the interpreter's timings would mean nothing)."""
    registered = dispatch._impls[op]
    if device.type == "cuda":
        importlib.import_module("arbor_kernels.triton_ops")  # registers the triton implementations
        return {"triton": registered["triton"], "torch": registered["torch"]}
    return {"torch": registered["torch"]}


def _time_impls(
    impls: dict[str, Callable[..., Any]], args: tuple[Any, ...], device: torch.device
) -> dict[str, float]:
    """Milliseconds per call of each implementation on the same arguments."""
    return {name: _time_ms(functools.partial(fn, *args), device) for name, fn in impls.items()}


def _max_error(impls: dict[str, Callable[..., Any]], args: tuple[Any, ...]) -> dict[str, str]:
    """max |impl - torch reference| over the outputs, for impls that return tensors: a GPU run
    checks the compiled kernels at full size while it times them."""
    expected = impls["torch"](*args)
    errors: dict[str, str] = {}
    for name, fn in impls.items():
        out = fn(*args)
        pairs = zip(out, expected, strict=True) if isinstance(out, tuple) else [(out, expected)]
        errors[name] = f"{max(float((a.float() - b.float()).abs().max()) for a, b in pairs):.1e}"
    return errors


def bench_decode(device: torch.device, dtype: torch.dtype, quick: bool) -> list[Row]:
    rows: list[Row] = []
    peak = _peak_bandwidth(device)
    batches, lens = ([1, 64], [1024, 4096]) if device.type == "cuda" else ([1, 8], [256])
    for model, heads, kv_heads, dim in MODELS[:1] if quick else MODELS:
        for batch in batches:
            for seq_len in lens:
                k, v, table, req_rows, seq_lens = _paged_kv(
                    batch, seq_len, kv_heads, dim, dtype, device
                )
                q = torch.randn(batch, heads, dim, dtype=dtype, device=device)
                args = (q, k, v, table, req_rows, seq_lens, dim**-0.5)
                kv_bytes = 2 * batch * seq_len * kv_heads * dim * k.element_size()
                case = f"{model} B={batch} L={seq_len}"
                impls = _impls("decode_attention", device)
                # The lower bound for torch: SDPA on KV gathered into contiguous tensors ahead.
                kg = k[table[:, :seq_len]].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
                vg = v[table[:, :seq_len]].transpose(1, 2).contiguous()
                impls["torch sdpa, pre-gathered"] = lambda q, *_, kg=kg, vg=vg: (
                    torch.nn.functional.scaled_dot_product_attention(
                        q.unsqueeze(2), kg, vg, enable_gqa=True
                    ).squeeze(2)
                )
                errors = _max_error(impls, args)
                for name, ms in _time_impls(impls, args, device).items():
                    gbps = kv_bytes / ms / 1e6
                    pct = f"{100 * gbps * 1e9 / peak:.0f}%" if peak else "-"
                    rows.append(
                        {
                            "case": case,
                            "impl": name,
                            "ms": ms,
                            "GB/s": gbps,
                            "of peak": pct,
                            "max err": errors[name],
                        }
                    )
    return rows


def bench_extend(device: torch.device, dtype: torch.dtype, quick: bool) -> list[Row]:
    rows: list[Row] = []
    # (requests, prefix length, new tokens each)
    cases = [(4, 0, 1024), (4, 1024, 512), (1, 0, 4096)] if device.type == "cuda" else [(2, 64, 64)]
    for model, heads, kv_heads, dim in MODELS[:1] if quick else MODELS:
        for batch, prefix, ext in cases:
            seq_len = prefix + ext
            k, v, table, req_rows, seq_lens = _paged_kv(
                batch, seq_len, kv_heads, dim, dtype, device
            )
            q = torch.randn(batch * ext, heads, dim, dtype=dtype, device=device)
            ext_lens = torch.full((batch,), ext, dtype=torch.int64, device=device)
            args = (q, k, v, table, req_rows, seq_lens, ext_lens, dim**-0.5)
            # Each query sees its prefix and the new tokens up to itself: QK and PV, 2 FLOPs/MAC.
            flops = 4 * batch * heads * dim * (ext * prefix + ext * (ext + 1) / 2)
            impls = _impls("extend_attention", device)
            errors = _max_error(impls, args)
            impls["torch sdpa"] = _sdpa_same_shapes(q, k, v, table, batch, prefix, ext, heads)
            for name, ms in _time_impls(impls, args, device).items():
                rows.append(
                    {
                        "case": f"{model} B={batch} prefix={prefix} new={ext}",
                        "impl": name,
                        "ms": ms,
                        "TFLOP/s": flops / ms / 1e9,
                        "max err": errors.get(name, "-"),
                    }
                )
    return rows


def _sdpa_same_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    batch: int,
    prefix: int,
    ext: int,
    heads: int,
) -> Callable[[], torch.Tensor]:
    """torch SDPA (flash where it applies) on contiguous, head-expanded copies of the same
    attention: bottom-right causal, so new token j sees the prefix and new tokens 0..j."""
    from torch.nn.attention.bias import causal_lower_right

    group = heads // k.shape[1]
    qc = q.view(batch, ext, heads, -1).transpose(1, 2).contiguous()
    slots = table[:, : prefix + ext]
    kc = k[slots].transpose(1, 2).repeat_interleave(group, dim=1).contiguous()  # [B, H, L, D]
    vc = v[slots].transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
    mask = causal_lower_right(ext, prefix + ext)
    return lambda *_: torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask)


def bench_bitmask(device: torch.device, quick: bool) -> list[Row]:
    rows: list[Row] = []
    vocab = VOCAB if device.type == "cuda" else 32000
    for batch in [1, 64] if quick else [1, 64, 512]:
        logits = torch.randn(batch, vocab, device=device)
        words = -(-vocab // 32)
        bitmask = torch.randint(-(2**31), 2**31, (batch, words), device=device).to(torch.int32)
        indices = torch.arange(batch, device=device)
        impls = _impls("apply_token_bitmask", device)
        try:
            from xgrammar import apply_token_bitmask_inplace

            impls["xgrammar"] = lambda lg, bm, _: apply_token_bitmask_inplace(lg, bm)  # all rows
        except ImportError:
            pass
        for name, ms in _time_impls(impls, (logits, bitmask, indices), device).items():
            rows.append({"case": f"B={batch} V={vocab}", "impl": name, "ms": ms})
    return rows


def bench_sampling(device: torch.device, quick: bool) -> list[Row]:
    rows: list[Row] = []
    vocab = VOCAB if device.type == "cuda" else 32000
    for batch in [1, 64] if quick else [1, 64, 512]:
        probs = torch.softmax(torch.randn(batch, vocab, device=device) * 3, -1)
        seeds = torch.arange(batch, device=device)
        for label, top_k, top_p in [("no filter", 0, 1.0), ("top-k 50 + top-p 0.9", 50, 0.9)]:
            filters = (
                torch.full((batch,), top_k, device=device),
                torch.full((batch,), top_p, device=device),
                torch.zeros(batch, device=device),
            )
            args = (probs, *filters, seeds, seeds)
            for name, ms in _time_impls(_impls("sample_from_probs", device), args, device).items():
                rows.append({"case": f"B={batch} {label}", "impl": name, "ms": ms})
    return rows


def bench_elementwise(device: torch.device, dtype: torch.dtype) -> list[Row]:
    rows: list[Row] = []
    hidden, heads, kv_heads, dim, inter = 896, 14, 2, 64, 4864  # Qwen2.5-0.5B
    for tokens in [1, 64, 4096] if device.type == "cuda" else [1, 64]:
        x = torch.randn(tokens, hidden, dtype=dtype, device=device)
        weight = torch.randn(hidden, dtype=dtype, device=device)
        q = torch.randn(tokens, heads, dim, dtype=dtype, device=device)
        k = torch.randn(tokens, kv_heads, dim, dtype=dtype, device=device)
        cos = torch.randn(tokens, dim, device=device)
        gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
        calls: dict[str, tuple[Any, ...]] = {
            "fused_add_rms_norm": (x, x, weight, 1e-6),
            "apply_rotary_emb": (q, k, cos, cos),
            "silu_and_mul": (gate_up,),
        }
        for op, args in calls.items():
            impls = _impls(op, device)
            errors = _max_error(impls, args)
            for name, ms in _time_impls(impls, args, device).items():
                rows.append(
                    {"case": f"{op} T={tokens}", "impl": name, "ms": ms, "max err": errors[name]}
                )
    return rows


def bench_engine(device: torch.device, preset: str, quick: bool) -> list[Row]:
    """Decode tokens/s of the in-process Engine at batch 1 and 64, triton vs torch kernels."""
    try:
        from runtime import Engine
        from runtime.test_model import cached_test_model
    except ImportError as exc:
        print(f"\nskipping the Engine benchmark: runtime.Engine is unavailable ({exc})")
        return []
    path = str(cached_test_model(preset, "qwen2"))
    prompt_len, new_tokens = 128, 32 if quick else 128
    backends = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    rows: list[Row] = []
    for backend in backends:
        with Engine(
            path,
            kernel_backend=backend,
            page_size=16,
            max_total_tokens=64 * 512,
            disable_radix_cache=True,  # every run prefills and decodes in full
        ) as engine:
            for batch in [1, 64]:
                ids = [
                    [(31 * b + 7 * j) % 5000 + 100 for j in range(prompt_len)] for b in range(batch)
                ]

                def run(n: int, ids: list[list[int]] = ids) -> float:
                    params = {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0}
                    return best_time(
                        lambda: engine.generate(input_ids=ids, sampling_params=params), 1
                    )

                decode_s = run(new_tokens) - run(1)  # the prefill and first token cancel out
                tok_s = batch * (new_tokens - 1) / decode_s
                rows.append({"case": f"{preset} B={batch}", "impl": backend, "decode tok/s": tok_s})
    return rows


# SmolLM2-135M's linear layers (n, k, bits, count per token): q, k|v, o, gate|up, down as Q4_1
# (4-bit codes, block 32), and the tied Q8_0 embedding as the LM head.
SMOLLM2_LINEARS = [
    ("q/o 576x576", 576, 576, 4, 60),
    ("k|v 192x576", 192, 576, 4, 30),
    ("gate|up 3072x576", 3072, 576, 4, 30),
    ("down 576x1536", 576, 1536, 4, 30),
    ("lm head 49152x576 (Q8_0)", 49152, 576, 8, 1),
]


def bench_quantized_linear(quick: bool) -> list[Row]:
    """``quantized_linear`` (native: AVX-512 VNNI where built, and forced portable) against
    torch's float32 oneDNN path (``packed_linear``) on SmolLM2-135M's shapes; GB/s is the
    packed weight's bytes over the native time. Per token at M = 1, the layers times their
    count (121 linears) give the linears' share of a decode step."""
    from arbor_kernels.quantized import BlockWeights, pack

    from runtime.layers.basic import pack_weight, packed_linear

    native = dispatch._impls["quantized_linear"].get("native")
    if native is None:
        return []
    rows: list[Row] = []
    for name, n, k, bits, count in SMOLLM2_LINEARS:
        q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
        scale = (torch.rand(n, k // 32) * 0.02).half().float()
        blocks = BlockWeights(q, scale, -scale * 2 ** (bits - 1), bits, 32)
        weight, dense = pack(blocks), pack_weight(blocks.dequantize())
        for m in [1, 32] if quick else [1, 32, 512]:
            x = torch.randn(m, k)
            calls = max(1, 2_000_000 // (n * k * m))

            def timed(fn: Callable[[], Any], portable: bool = False, calls: int = calls) -> float:
                def run() -> None:
                    for _ in range(calls):
                        fn()

                before = os.environ.get("ARBOR_CPU_PORTABLE")
                os.environ["ARBOR_CPU_PORTABLE"] = "1" if portable else "0"
                try:
                    return best_time(run, 5) / calls * 1e3
                finally:
                    os.environ.pop("ARBOR_CPU_PORTABLE")
                    if before is not None:
                        os.environ["ARBOR_CPU_PORTABLE"] = before

            quantized = functools.partial(native, x, weight, None)
            vnni, portable = timed(quantized), timed(quantized, portable=True)
            fp32 = timed(functools.partial(packed_linear, x, dense, None))
            rows.append(
                {
                    "layer": name,
                    "M": m,
                    "native ms": f"{vnni:.4f}",
                    "portable ms": f"{portable:.4f}",
                    "fp32 oneDNN ms": f"{fp32:.4f}",
                    "fp32 / native": f"{fp32 / vnni:.2f}x",
                    "weight GB/s": f"{weight.nbytes() / vnni / 1e6:.1f}",
                    "ms per token": f"{vnni * count:.3f}" if m == 1 else "",
                }
            )
    return rows


def _peak_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for fragment, bw in PEAK_HBM if fragment in name), None)


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write): a measured practical peak."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_time_ms(lambda: dst.copy_(src), device) / 1e3)


def interpreter_smoke() -> list[Row]:
    """Each triton kernel once at tiny shapes under the interpreter: max |triton - torch|."""
    import arbor_kernels.triton_ops as tops

    torch.manual_seed(0)
    k, v, table, rows, seq_lens = _paged_kv(2, 40, 2, 16, torch.float32, torch.device("cpu"))
    q = torch.randn(2, 4, 16)
    ext = torch.tensor([5, 40])
    qe = torch.randn(45, 4, 16)
    x, w = torch.randn(3, 32), torch.randn(32)
    probs = torch.softmax(torch.randn(2, 64), -1)
    filters = (torch.tensor([5, 0]), torch.tensor([1.0, 0.8]), torch.tensor([0.0, 0.1]))
    kept = ref_sampling.filter_probs(probs, *filters) > 0
    thresholds = tops.sampling.keep_thresholds(probs, *filters)
    checks = {
        "decode_attention": (
            tops.decode_attention.decode_attention(q, k, v, table, rows, seq_lens, 0.25),
            ref_attention.decode_attention(q, k, v, table, rows, seq_lens, 0.25),
        ),
        "extend_attention": (
            tops.extend_attention.extend_attention(qe, k, v, table, rows, seq_lens, ext, 0.25),
            ref_attention.extend_attention(qe, k, v, table, rows, seq_lens, ext, 0.25),
        ),
        "rms_norm": (tops.norm.rms_norm(x, w, 1e-6), ref_elementwise.rms_norm(x, w, 1e-6)),
        "sampling kept set": (
            ((probs >= thresholds[:, None]) & (probs > 0)).float(),
            kept.float(),
        ),
    }
    return [
        {"kernel": name, "max abs err": f"{float((a - b).abs().max()):.1e}"}
        for name, (a, b) in checks.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and batches")
    parser.add_argument("--skip-engine", action="store_true", help="kernels only")
    parser.add_argument("--engine-preset", default="qwen2.5-0.5b-shape")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    payload: dict[str, Any] = {"device": str(device), "dtype": str(dtype)}
    if device.type == "cuda":
        payload["gpu"] = torch.cuda.get_device_name(device)
        payload["peak_hbm_bytes_per_s"] = _peak_bandwidth(device)
        payload["copy_bytes_per_s"] = _copy_bandwidth(device)
        print(f"{payload['gpu']}: 1 GiB copy {payload['copy_bytes_per_s'] / 1e9:,.0f} GB/s")
    sections: dict[str, list[Row]] = {
        "decode attention": bench_decode(device, dtype, args.quick),
        "extend attention": bench_extend(device, dtype, args.quick),
        "token bitmask": bench_bitmask(device, args.quick),
        "sampling": bench_sampling(device, args.quick),
        "elementwise": bench_elementwise(device, dtype),
    }
    if device.type == "cpu":
        sections = {"quantized linear": bench_quantized_linear(args.quick), **sections}
    if device.type == "cuda" and not args.skip_engine:
        sections["engine decode"] = bench_engine(device, args.engine_preset, args.quick)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        sections["interpreter smoke"] = interpreter_smoke()
    for title, rows in sections.items():
        if rows:
            print(f"\n{title} ({device}, {dtype})\n")
            print_table(list(rows[0]), [list(r.values()) for r in rows])
    write_json("kernel_bench", {**payload, "sections": sections}, args.out)


if __name__ == "__main__":
    main()
