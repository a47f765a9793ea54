"""ServerArgs as the one source of the ``arbor serve`` flags: help, choices, types, defaults,
and the device defaults the scheduler fills in."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from runtime.cli import main
from runtime.server_args import (
    DEFAULT_CUDA_GRAPH_MAX_BS,
    DTYPES,
    EVICTION_POLICIES,
    GRAMMAR_BACKENDS,
    LOG_LEVELS,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    SPECULATIVE_POLICIES,
    ServerArgs,
)

FIELDS = dataclasses.fields(ServerArgs)
ENUMERATED = [f for f in FIELDS if f.metadata.get("choices")]


def _parse(*flags: str) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="arbor serve")
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli(parser.parse_args(["--model-path", "m", *flags]))


def _squeezed(text: str) -> str:
    """``text`` without whitespace: argparse wraps help lines (also at hyphens)."""
    return "".join(text.split())


# ---- help ----------------------------------------------------------------------------------


def test_every_field_has_help_that_serve_help_prints(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    printed = _squeezed(capsys.readouterr().out)
    for f in FIELDS:
        help_text = f.metadata["help"]
        assert len(help_text) > 10, f.name
        flag = "--" + f.name.replace("_", "-")
        assert _squeezed(flag + " ") in printed, flag
        assert _squeezed(help_text) in printed, f.name


def test_help_names_the_choices_and_defaults(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    printed = _squeezed(capsys.readouterr().out)
    assert "--eviction-policy{lru,lfu,fifo}" in printed
    assert "(default:lpm)" in printed and "(default:30000)" in printed


# ---- choices -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ENUMERATED, ids=lambda f: f.name)
def test_a_bad_enumerated_value_is_an_argparse_error(
    field: dataclasses.Field, capsys: pytest.CaptureFixture[str]
):
    flag = "--" + field.name.replace("_", "-")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model-path", "/no/such/model", flag, "bogus"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: 'bogus'" in error
    assert all(repr(choice) in error for choice in field.metadata["choices"])


def test_flags_are_checked_before_anything_loads():
    """The launching process refuses bad flags without importing torch or the server."""
    code = (
        "import sys\n"
        "from runtime.cli import main\n"
        "try:\n"
        "    main(['serve', '--model-path', '/no/such/model', '--schedule-policy', 'sjf'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules, 'runtime.server' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.split() == ["2", "False", "False"], result.stderr
    assert "choose from 'lpm', 'dfs-weight', 'fcfs'" in result.stderr


def test_flags_that_parse_but_do_not_hold_are_an_argparse_error(
    capsys: pytest.CaptureFixture[str],
):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model-path", "m", "--page-size", "4", "--max-total-tokens", "6"])
    assert exit_info.value.code == 2
    assert "max_total_tokens must be at least 8" in capsys.readouterr().err


@pytest.mark.parametrize("field", ENUMERATED, ids=lambda f: f.name)
def test_server_args_refuse_what_the_flag_refuses(field: dataclasses.Field):
    """The Engine takes the same fields as keywords, checked against the same choices."""
    with pytest.raises(ValueError, match=f"{field.name} must be one of"):
        ServerArgs(model_path="m", **{field.name: "bogus"})
    for choice in field.metadata["choices"]:
        extra = _NEEDED_WITH.get((field.name, choice), {})
        args = ServerArgs(model_path="m", **{field.name: choice}, **extra)
        assert getattr(args, field.name) == choice


# Choices that need another field set with them.
_NEEDED_WITH = {("speculative_algorithm", "draft"): {"speculative_draft_model_path": "d"}}


def test_speculative_flags_that_do_not_go_together_are_refused():
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        ServerArgs(model_path="m", speculative_algorithm="draft")
    with pytest.raises(ValueError, match="only used with speculative_algorithm draft"):
        ServerArgs(model_path="m", speculative_algorithm="ngram", speculative_draft_model_path="d")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens must be in"):
        ServerArgs(model_path="m", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="speculative_ngram_min_match"):
        ServerArgs(model_path="m", speculative_ngram_min_match=4, speculative_ngram_max_match=3)


def test_only_optional_enumerated_fields_take_none():
    assert ServerArgs(model_path="m", reasoning_parser=None).reasoning_parser is None
    with pytest.raises(ValueError, match="dtype must be one of"):
        ServerArgs(model_path="m", dtype=None)  # type: ignore[arg-type]


def test_duplicated_names_match_what_implements_them():
    import uvicorn.config

    from grammar import backend
    from radix_cache import eviction
    from runtime import model_config, model_loader
    from runtime.scheduler.schedule_policy import make_policy

    assert set(DTYPES) == {"auto", *model_config._DTYPES}
    for name in QUANTIZATIONS:
        assert model_loader.resolve_quantization(name) == "none"
    # The registries' own entries (tests register more in the same process).
    builtin_policies = {
        n for n, c in eviction._POLICIES.items() if c.__module__ == "radix_cache.eviction"
    }
    assert set(EVICTION_POLICIES) == builtin_policies
    assert set(GRAMMAR_BACKENDS) == set(backend.BUILTIN_BACKENDS)
    for name, module in backend.BUILTIN_BACKENDS.items():  # each module registers its name
        importlib.import_module(module)
        assert backend._BACKENDS[name].__module__ == module
    for name in SCHEDULE_POLICIES:
        make_policy(name, lpm_max_queue=4)
    for level in LOG_LEVELS:
        assert level in uvicorn.config.LOG_LEVELS
        assert isinstance(logging.getLevelName(level.upper()), int)
    from runtime.speculative.drafts import DRAFT_MODEL, NGRAM

    assert SPECULATIVE_ALGORITHMS == (NGRAM, DRAFT_MODEL)
    assert SPECULATIVE_POLICIES == ("adaptive", "always")  # SpeculationConfig.adaptive


# ---- types and defaults ------------------------------------------------------------------


def test_values_take_the_fields_types():
    args = _parse(
        "--max-total-tokens", "4096",
        "--mem-fraction-static", "0.5",
        "--header-timeout-s", "2",
        "--context-length", "512",
        "--disable-radix-cache",
        "--api-key", "123",
    )  # fmt: skip
    assert args.max_total_tokens == 4096 and type(args.max_total_tokens) is int
    assert args.mem_fraction_static == 0.5
    assert args.header_timeout_s == 2.0 and type(args.header_timeout_s) is float
    assert args.context_length == 512
    assert args.disable_radix_cache is True and args.disable_jump_forward is False
    assert args.api_key == "123"  # a str field keeps digits as text


def test_an_int_flag_refuses_a_float(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model-path", "m", "--page-size", "1.5"])
    assert exit_info.value.code == 2
    assert "argument --page-size: invalid int value: '1.5'" in capsys.readouterr().err


def test_tp_flag_and_its_alias_set_tp_size():
    assert _parse("--tp", "2").tp_size == 2
    assert _parse("--tp-size", "4").tp_size == 4
    assert _parse().tp_size == 1


def test_a_tp_size_the_model_cannot_split_is_an_argparse_error(
    tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
):
    for value, message in (
        ("0", "tp_size must be >= 1, got 0"),
        ("3", "num_attention_heads=4, num_key_value_heads=2"),
        ("8", "this model takes tp_size 1, 2, 4"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--model-path", str(tiny_model_path), "--tp", value])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_flags_left_out_keep_the_fields_defaults():
    assert _parse() == ServerArgs(model_path="m")
    assert _parse().max_prefill_tokens is None  # an optional int stays None on the command line


def test_every_bool_field_is_a_switch():
    hints = typing.get_type_hints(ServerArgs)
    switches = [f.name for f in FIELDS if hints[f.name] is bool]
    assert "disable_cuda_graph" in switches
    flags = ["--" + name.replace("_", "-") for name in switches]
    assert all(getattr(_parse(*flags), name) is True for name in switches)


# ---- device defaults ---------------------------------------------------------------------


def test_for_device_fills_in_the_cpu_defaults():
    args = ServerArgs(model_path="m").for_device(cuda_available=False)
    assert (args.device, args.dtype, args.kv_cache_dtype) == ("cpu", "float32", "fp32")
    assert (args.max_prefill_tokens, args.chunked_prefill_size) == (2048, 1024)
    assert args.cuda_graph_max_bs == 128  # min(max_running_requests, 160)


def test_for_device_fills_in_the_gpu_defaults():
    args = ServerArgs(model_path="m", max_running_requests=256).for_device(cuda_available=True)
    assert (args.device, args.dtype, args.kv_cache_dtype) == ("cuda", "bfloat16", "bf16")
    assert (args.max_prefill_tokens, args.chunked_prefill_size) == (16384, 8192)
    assert args.cuda_graph_max_bs == DEFAULT_CUDA_GRAPH_MAX_BS
    on_second_gpu = ServerArgs(model_path="m", device="cuda:1").for_device(cuda_available=True)
    assert (on_second_gpu.device, on_second_gpu.dtype) == ("cuda:1", "bfloat16")


BF16_CPU = frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})
PLAIN_AVX512_CPU = frozenset({"avx512f", "avx512bw", "avx512_vnni"})


@pytest.mark.parametrize(
    ("stored", "flags", "dtype", "kv"),
    [
        ("bfloat16", BF16_CPU, "bfloat16", "bf16"),
        ("bfloat16", PLAIN_AVX512_CPU, "float32", "fp32"),
        ("bfloat16", frozenset(), "float32", "fp32"),
        ("float32", BF16_CPU, "float32", "fp32"),
        ("float16", BF16_CPU, "float32", "fp32"),
    ],
)
def test_auto_dtype_keeps_a_bfloat16_checkpoint_only_on_a_cpu_with_bf16_dot_products(
    stored: str, flags: frozenset[str], dtype: str, kv: str
):
    args = ServerArgs(model_path="m").for_device(False, stored, flags)
    assert (args.dtype, args.kv_cache_dtype) == (dtype, kv)


def test_the_cpu_flags_change_neither_a_gpu_nor_a_given_dtype():
    on_gpu = ServerArgs(model_path="m").for_device(True, "bfloat16", PLAIN_AVX512_CPU)
    assert on_gpu.dtype == "bfloat16"
    given = ServerArgs(model_path="m", dtype="float32").for_device(False, "bfloat16", BF16_CPU)
    assert given.dtype == "float32"


def test_for_device_keeps_what_was_given():
    given = ServerArgs(
        model_path="m",
        device="cpu",
        dtype="bfloat16",
        max_prefill_tokens=512,
        chunked_prefill_size=0,
        cuda_graph_max_bs=300,
        max_running_requests=64,
    )
    args = given.for_device(cuda_available=True)
    assert (args.device, args.dtype, args.kv_cache_dtype) == ("cpu", "bfloat16", "bf16")
    assert (args.max_prefill_tokens, args.chunked_prefill_size) == (512, 0)
    assert args.cuda_graph_max_bs == 64  # no decode batch holds more requests
    assert args.for_device(cuda_available=False) == args
    explicit_kv = ServerArgs(model_path="m", kv_cache_dtype="fp16").for_device(False)
    assert explicit_kv.kv_cache_dtype == "fp16"
