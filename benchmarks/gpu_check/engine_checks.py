"""The Engine end to end: greedy tokens on the device under test against CPU float32, and with
CUDA graphs against without.

Greedy decoding with EOS ignored makes the output a pure function of the logits' argmax, and the
random-weight test models have clear argmax margins: float32 on both sides must give the same
token ids. bfloat16 is reported as the share of tokens that agree before the first divergence,
never failed on.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.gpu_check.checks import SKIPPED, Check, Deadline, compare_tokens, error_check
from runtime import Engine, ServerArgs
from runtime.test_model import cached_test_model

_PARAGRAPH = (
    "The river rose through the night, and by morning the lower streets of the town were under "
    "water. People carried what they could to the hill above the church, where the old school "
    "stood empty. "
)
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 5, 8, 13,",
    "<|im_start|>user\nWrite a haiku about trees.<|im_end|>\n<|im_start|>assistant\n",
    _PARAGRAPH * 8,  # a few hundred tokens: a longer prefill
)
# The CPU float32 oracle: the torch reference kernels.
REFERENCE = {"device": "cpu", "dtype": "float32", "kernel_backend": "torch"}


@dataclass(frozen=True)
class Target:
    """One configuration under test: Engine keyword arguments, and whether a token difference
    against the reference fails the run (float32) or is only reported (bfloat16)."""

    engine_kwargs: dict[str, Any]
    gating: bool

    @property
    def label(self) -> str:
        kwargs = self.engine_kwargs
        backend = kwargs.get("kernel_backend")
        device = kwargs["device"] + (f"/{backend}" if backend else "")
        return f"{device} {kwargs['dtype']}"


@dataclass(frozen=True)
class EnginePlan:
    """What one run compares: test models by (preset, arch), prompts, output length, the
    targets compared with CPU float32, and those compared with themselves, CUDA graphs on and
    off."""

    models: tuple[tuple[str, str], ...]
    prompts: tuple[str, ...]
    new_tokens: int
    max_total_tokens: int
    targets: tuple[Target, ...]
    graph_targets: tuple[Target, ...]


_CUDA_TARGETS = (
    Target({"device": "cuda", "dtype": "float32", "page_size": 16}, gating=True),
    Target({"device": "cuda", "dtype": "bfloat16", "page_size": 16}, gating=False),
)
GPU_PLAN = EnginePlan(
    models=(("tiny", "llama"), ("small", "qwen2")),
    prompts=PROMPTS,
    new_tokens=32,
    max_total_tokens=16384,
    targets=_CUDA_TARGETS,
    graph_targets=_CUDA_TARGETS,
)
# On CPU the fp32 target runs the triton kernels inside the Engine under the interpreter (slow:
# few tokens); bf16 and the graph comparison (graphs are CUDA-only: this only exercises the
# harness) run the torch kernels.
SMOKE_PLAN = EnginePlan(
    models=(("tiny", "llama"),),
    prompts=PROMPTS[:3],
    new_tokens=6,
    max_total_tokens=2048,
    targets=(
        Target({"device": "cpu", "dtype": "float32", "kernel_backend": "triton"}, gating=True),
        Target({"device": "cpu", "dtype": "bfloat16", "kernel_backend": "torch"}, gating=False),
    ),
    graph_targets=(
        Target({"device": "cpu", "dtype": "float32", "kernel_backend": "torch"}, gating=True),
    ),
)


def plan_for(smoke: bool) -> EnginePlan:
    return SMOKE_PLAN if smoke else GPU_PLAN


def cuda_graph_fields() -> set[str]:
    """The CUDA-graph fields ServerArgs has (none until the CUDA-graph runner is built)."""
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return names & {"disable_cuda_graph", "cuda_graph_max_bs"}


def greedy_tokens(
    model_path: str, batches: Sequence[Sequence[str]], new_tokens: int, **engine_kwargs: Any
) -> list[list[int]]:
    """Output token ids of each prompt, each batch generated together by one Engine."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    outputs: list[list[int]] = []
    with Engine(model_path, **engine_kwargs) as engine:
        for batch in batches:
            outputs += [result["output_ids"] for result in engine.generate(list(batch), params)]
    release_memory()
    return outputs


def release_memory() -> None:
    """Drop a finished Engine's tensors before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_engine_checks(smoke: bool, deadline: Deadline) -> list[Check]:
    """Each target's greedy tokens against CPU float32 on each test model."""
    plan = plan_for(smoke)
    checks: list[Check] = []
    for preset, arch in plan.models:
        model = f"{preset} {arch}"
        try:
            path = str(cached_test_model(preset, arch))
            expected = greedy_tokens(
                path, [plan.prompts], plan.new_tokens,
                max_total_tokens=plan.max_total_tokens, **REFERENCE,
            )  # fmt: skip
        except Exception as exc:
            checks.append(error_check(f"{model}: cpu float32 reference", exc))
            continue
        for target in plan.targets:
            relation = "=" if target.gating else "~"
            name = f"{model}: {target.label} {relation} cpu float32"
            if deadline.left() < 15:
                checks.append(Check(name, SKIPPED, "out of time", gating=False))
                continue
            try:
                actual = greedy_tokens(
                    path, [plan.prompts], plan.new_tokens,
                    max_total_tokens=plan.max_total_tokens, **target.engine_kwargs,
                )  # fmt: skip
                checks.append(compare_tokens(name, actual, expected, target.gating))
            except Exception as exc:
                checks.append(error_check(name, exc, target.gating))
    return checks


def run_cuda_graph_checks(smoke: bool, deadline: Deadline) -> list[Check]:
    """Greedy tokens with CUDA graphs equal those without, for a batch and a single prompt
    (graph batch sizes are padded: 6 prompts replay a larger graph)."""
    if "disable_cuda_graph" not in cuda_graph_fields():
        detail = "not built: ServerArgs has no disable_cuda_graph field"
        return [Check("cuda graphs = eager", SKIPPED, detail, gating=False)]
    plan = plan_for(smoke)
    batches = [plan.prompts, plan.prompts[:1]]
    checks: list[Check] = []
    for preset, arch in plan.models:
        model = f"{preset} {arch}"
        for target in plan.graph_targets:
            relation = "=" if target.gating else "~"
            name = f"{model}: {target.label} graphs {relation} eager"
            if deadline.left() < 15:
                checks.append(Check(name, SKIPPED, "out of time", gating=False))
                continue
            kwargs = {"max_total_tokens": plan.max_total_tokens, **target.engine_kwargs}
            try:
                path = str(cached_test_model(preset, arch))
                eager = greedy_tokens(
                    path, batches, plan.new_tokens, disable_cuda_graph=True, **kwargs
                )
                graphs = greedy_tokens(
                    path, batches, plan.new_tokens, disable_cuda_graph=False, **kwargs
                )
                checks.append(compare_tokens(name, graphs, eager, target.gating))
            except Exception as exc:
                checks.append(error_check(name, exc, target.gating))
    return checks
