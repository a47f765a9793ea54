"""Compile every triton kernel for an NVIDIA GPU without one: the interpreter cannot catch what
only the compiler checks (``tl.dot`` shapes and precisions, types, control flow, shared memory).

Run with TRITON_INTERPRET unset (``@triton.jit`` would make interpreted functions otherwise):

    python tests/kernels/gpu_compile.py [--arch 90] [--arch 80]

Prints, per kernel configuration, registers per thread, spilled bytes and shared memory as
reported by ``ptxas -v``; exits non-zero when a configuration fails to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from arbor_kernels.triton_ops import (  # noqa: E402
    activation,
    bitmask,
    decode_attention,
    extend_attention,
    norm,
    rotary,
    sampling,
)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@dataclass
class KernelConfig:
    """One compilation: runtime argument types (``*bf16``, ``i32``, ``fp32``...) by name and
    constexpr values by name; every argument of the kernel appears in exactly one of them."""

    name: str
    fn: Any
    types: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    notes: dict[str, Any] = field(default_factory=dict)


def _strides(*names: str, unit: tuple[str, ...] = ()) -> tuple[dict[str, str], dict[str, int]]:
    """Stride arguments: i32, except those named in ``unit``, which a contiguous launch
    passes as 1 and triton specialises to the constant 1."""
    return {n: "i32" for n in names if n not in unit}, {n: 1 for n in unit}


def _attention_configs(
    dtype: str, heads: int, kv_heads: int, head_dim: int, windowed: bool = False
) -> list[KernelConfig]:
    tag = f"{dtype} H={heads} Hkv={kv_heads} D={head_dim}" + (" windowed" if windowed else "")
    group = heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = "tf32x3" if dtype == "fp32" else "tf32"
    dot_dtype = (
        tl.float32
        if dtype == "fp32"
        else getattr(tl, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
    )
    ext_strides, ext_units = _strides(
        "stride_qt", "stride_qh", "stride_qd", "stride_kt", "stride_kh", "stride_kd",
        "stride_vt", "stride_vh", "stride_vd", "stride_ot", "stride_oh", "stride_table",
        "stride_pos",
        unit=("stride_qd", "stride_kd", "stride_vd", "stride_pos"),
    )  # fmt: skip
    extend = KernelConfig(
        f"extend_attention {tag}",
        extend_attention._extend_attention_kernel,
        {
            "q_ptr": f"*{dtype}",
            "k_ptr": f"*{dtype}",
            "v_ptr": f"*{dtype}",
            "out_ptr": f"*{dtype}",
            "req_to_token_ptr": "*i64",
            "req_pool_indices_ptr": "*i64",
            "seq_lens_ptr": "*i64",
            "extend_lens_ptr": "*i64",
            "extend_starts_ptr": "*i64",
            "block_ends_ptr": "*i64",
            "batch_size": "i32",
            "qk_scale": "fp32",
            "window": "i32",
            **ext_strides,
        },
        {
            **ext_units,
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_V": head_dim,
            "BLOCK_D": block_d,
            "BLOCK_DV": block_d,
            "BLOCK_M": 64 if head_dim <= 128 else 32,
            "BLOCK_N": 64 if head_dim <= 64 else 32 if head_dim <= 128 else 16,
            "BLOCK_B": 64,
            "DOT_DTYPE": dot_dtype,
            "DOT_PRECISION": precision,
            "WINDOWED": windowed,
        },
        num_warps=8,
    )
    dec_strides, dec_units = _strides(
        "stride_qb", "stride_qh", "stride_qd", "stride_kt", "stride_kh", "stride_kd",
        "stride_vt", "stride_vh", "stride_vd", "stride_table", "stride_pos",
        unit=("stride_qd", "stride_kd", "stride_vd", "stride_pos"),
    )  # fmt: skip
    partial = KernelConfig(
        f"decode_partial {tag}",
        decode_attention._decode_partial_kernel,
        {
            "q_ptr": f"*{dtype}",
            "k_ptr": f"*{dtype}",
            "v_ptr": f"*{dtype}",
            "mid_out_ptr": "*fp32",
            "mid_lse_ptr": "*fp32",
            "req_to_token_ptr": "*i64",
            "req_pool_indices_ptr": "*i64",
            "seq_lens_ptr": "*i64",
            "qk_scale": "fp32",
            "window": "i32",
            **dec_strides,
            "num_kv_splits": "i32",
        },
        {
            **dec_units,
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_V": head_dim,
            "BLOCK_D": block_d,
            "BLOCK_DV": block_d,
            "BLOCK_H": max(16, triton.next_power_of_2(group)),
            "BLOCK_N": 64 if head_dim <= 128 else 32,
            "DOT_DTYPE": dot_dtype,
            "DOT_PRECISION": precision,
            "WINDOWED": windowed,
        },
        num_warps=4 if head_dim <= 64 else 8,
    )
    reduce = KernelConfig(
        f"decode_reduce {tag}",
        decode_attention._decode_reduce_kernel,
        {
            "mid_out_ptr": "*fp32",
            "mid_lse_ptr": "*fp32",
            "out_ptr": f"*{dtype}",
            "stride_ob": "i32",
            "stride_oh": "i32",
            "num_kv_splits": "i32",
        },
        {
            "stride_od": 1,
            "HEAD_DIM_V": head_dim,
            "BLOCK_SPLITS": decode_attention.MAX_KV_SPLITS,
            "BLOCK_DV": triton.next_power_of_2(head_dim),
        },
    )
    # The reduce kernel does not know about windows: compiled once, with the unwindowed set.
    return [extend, partial] if windowed else [extend, partial, reduce]


def _other_configs(dtype: str) -> list[KernelConfig]:
    return [
        KernelConfig(
            f"apply_token_bitmask {dtype}",
            bitmask._apply_token_bitmask_kernel,
            {
                "logits_ptr": f"*{dtype}",
                "bitmask_ptr": "*i32",
                "indices_ptr": "*i64",
                "vocab_size": "i32",
                "num_words": "i32",
                "stride_logits_row": "i32",
                "stride_mask_row": "i32",
            },
            {"stride_logits_col": 1, "stride_mask_col": 1, "HAS_INDICES": True, "BLOCK_V": 4096},
        ),
        KernelConfig(
            f"fused_add_rms_norm {dtype}",
            norm._rms_norm_kernel,
            {
                "x_ptr": f"*{dtype}",
                "residual_ptr": f"*{dtype}",
                "weight_ptr": f"*{dtype}",
                "out_ptr": f"*{dtype}",
                "residual_out_ptr": f"*{dtype}",
                "hidden": "i32",
                "eps": "fp32",
            },
            {"HAS_RESIDUAL": True, "BLOCK": 4096},
            num_warps=16,
        ),
        KernelConfig(
            f"apply_rotary_emb {dtype}",
            rotary._rotary_kernel,
            {
                "q_ptr": f"*{dtype}",
                "k_ptr": f"*{dtype}",
                "cos_ptr": "*fp32",
                "sin_ptr": "*fp32",
                "q_out_ptr": f"*{dtype}",
                "k_out_ptr": f"*{dtype}",
                "stride_qt": "i32",
                "stride_qh": "i32",
                "stride_kt": "i32",
                "stride_kh": "i32",
                "stride_ct": "i32",
                "stride_st": "i32",
            },
            {
                "stride_qd": 1,
                "stride_kd": 1,
                "stride_cd": 1,
                "stride_sd": 1,
                "NUM_Q_HEADS": 32,
                "NUM_K_HEADS": 8,
                "HALF": 64,
                "BLOCK_HQ": 32,
                "BLOCK_HK": 8,
                "BLOCK_HALF": 64,
            },
        ),
        KernelConfig(
            f"silu_and_mul {dtype}",
            activation._silu_and_mul_kernel,
            {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "inter": "i32"},
            {"BLOCK": 1024},
        ),
    ]


def _sampling_config() -> KernelConfig:
    return KernelConfig(
        "filtered_sample",
        sampling._filtered_sample_kernel,
        {
            "probs_ptr": "*fp32",
            "top_k_ptr": "*i64",
            "top_p_ptr": "*fp32",
            "min_p_ptr": "*fp32",
            "seeds_ptr": "*i64",
            "offsets_ptr": "*i64",
            "tokens_ptr": "*i64",
            "thresholds_ptr": "*fp32",
            "vocab_size": "i32",
            "stride_row": "i32",
        },
        {"stride_col": 1, "DRAW": True, "BLOCK_V": 1024},
        num_warps=8,
    )


def all_configs() -> list[KernelConfig]:
    configs: list[KernelConfig] = []
    for dtype in ("bf16", "fp32"):
        configs += _attention_configs(dtype, heads=14, kv_heads=2, head_dim=64)  # Qwen2.5-0.5B
        configs += _attention_configs(dtype, heads=32, kv_heads=8, head_dim=128)  # Llama-3-8B
        for windowed in (False, True):  # Gemma 3 270M: global and sliding-window layers
            configs += _attention_configs(dtype, 4, 1, 256, windowed)
        configs += _other_configs(dtype)
    configs.append(_sampling_config())
    return configs


def compile_config(config: KernelConfig, arch: int) -> dict[str, Any]:
    """Compile for compute capability ``arch``; returns the ptxas resource usage."""
    arg_names = config.fn.arg_names
    missing = set(arg_names) - set(config.types) - set(config.constexprs)
    if missing:
        raise ValueError(f"{config.name}: no type or value for {sorted(missing)}")
    signature = {
        name: config.types[name] if name in config.types else "constexpr" for name in arg_names
    }
    source = ASTSource(fn=config.fn, signature=signature, constexprs=config.constexprs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return {"shared_bytes": compiled.metadata.shared, **_ptxas_usage(compiled.asm["ptx"], arch)}


def _ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        log = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", str(src), "-o", str(src) + ".o"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {
        "registers": int(registers.group(1)) if registers else -1,
        "spill_bytes": int(spills.group(1)) if spills else 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, action="append", help="compute capability, e.g. 90")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
        return 2
    failures = 0
    for arch in args.arch or [90]:
        for config in all_configs():
            try:
                usage = compile_config(config, arch)
            except Exception as exc:  # report every failing configuration, not just the first
                failures += 1
                print(f"FAIL sm_{arch} {config.name}: {type(exc).__name__}: {exc}")
                continue
            print(
                f"ok   sm_{arch} {config.name}: {usage['registers']} regs, "
                f"{usage['spill_bytes']} B spilled, {usage['shared_bytes']} B shared"
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
