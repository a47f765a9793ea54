"""Next-token agreement between Arbor and llama.cpp on the same GGUF file, over real text.

Both read the same token ids (the English passage in benchmarks/data/, tokenized by Arbor's
tokenizer; llama.cpp's own tokenization of it is compared, not used) in one prefill with logits
at every position. Agreement is the share of positions whose top-1 (argmax) token is the same.
Also reported: how often each system's top-1 is the text's actual next token (both close to
each other and far above chance: both run the model, not agree on noise), the largest |logit
difference|, and each disagreement with the gap between the two candidates in Arbor's logits
(a near tie flips under any change of rounding). And perplexity on the text: Arbor's with
``quantization``, and, for ``gguf``, the dequantized float32 model's (``none``) beside it, so
quantized execution's cost in accuracy reads as one ratio (target: within 1%).

Arbor runs its model runner in float32 with ``quantization`` (``none``: the file's blocks
dequantized at load; ``gguf``: the blocks as they are, in the quantized kernels). llama.cpp
(llama-cpp-python) runs the file as it is, with its defaults (f16 KV cache; extra buffer types
unless they crash: benchmarks/suite/systems/llama_cpp_load.py) and ``logits_all=True``, on
Arbor's thread count.

    python -m benchmarks.llama_cpp_agreement [--model-path FILE.gguf]
        [--quantization none|gguf] [--text FILE] [--out result.json]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import ENGLISH_PASSAGE, print_table, write_json
from benchmarks.suite.systems.llama_cpp_load import extra_buffers_crash, open_llama
from runtime.model_files import load_tokenizer, resolve_model_path


@dataclass(frozen=True)
class Agreement:
    """Top-1 agreement over ``positions`` next-token predictions; ``disagreements`` lists
    (position, Arbor's token, llama.cpp's token, Arbor's logit gap between the two).
    ``perplexity``: Arbor's on the text; ``float_perplexity``: the dequantized float32
    model's (``quantization=none``), when that is not the model measured."""

    positions: int
    agreed: int
    arbor_text_top1: float
    llama_cpp_text_top1: float
    max_abs_logit_diff: float
    disagreements: list[tuple[int, int, int, float]] = field(default_factory=list)
    tokenizer_equal: bool | None = None
    perplexity: float | None = None
    float_perplexity: float | None = None

    @property
    def rate(self) -> float:
        return self.agreed / self.positions if self.positions else 0.0

    @property
    def perplexity_ratio(self) -> float | None:
        """Arbor's perplexity over the float32 model's (1.0 when they are one model)."""
        if self.perplexity is None:
            return None
        reference = self.float_perplexity or self.perplexity
        return self.perplexity / reference


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ``ids[1:]``, row i of ``logits`` ([len(ids),
    vocab]) predicting ``ids[i + 1]``."""
    rows = torch.from_numpy(np.asarray(logits[:-1], dtype=np.float64))
    log_probs = torch.log_softmax(rows, dim=-1)
    following = torch.tensor(ids[1:])
    nll = -log_probs[torch.arange(len(following)), following].mean()
    return float(torch.exp(nll))


def compare(ours: np.ndarray, theirs: np.ndarray, ids: list[int]) -> Agreement:
    """Agreement of two systems' logits ``ours`` and ``theirs`` ([positions, vocab] each, row
    i predicting the token after ``ids[i]``; the vocabularies may differ in padding: the
    shorter one is compared) over every position."""
    if ours.shape[0] != theirs.shape[0] or ours.shape[0] != len(ids):
        raise ValueError(f"logits {ours.shape} and {theirs.shape} for {len(ids)} tokens")
    vocab = min(ours.shape[1], theirs.shape[1])
    ours, theirs = ours[:, :vocab], theirs[:, :vocab]
    our_top, their_top = ours.argmax(-1), theirs.argmax(-1)
    rows = np.arange(len(ids))
    differ = np.flatnonzero(our_top != their_top)
    gaps = ours[differ, our_top[differ]] - ours[differ, their_top[differ]]
    following = np.asarray(ids[1:])
    return Agreement(
        positions=len(ids),
        agreed=int((our_top == their_top).sum()),
        arbor_text_top1=float((our_top[:-1] == following).mean()),
        llama_cpp_text_top1=float((their_top[:-1] == following).mean()),
        max_abs_logit_diff=float(np.abs(ours[rows] - theirs[rows]).max()),
        disagreements=[
            (int(p), int(our_top[p]), int(their_top[p]), float(g))
            for p, g in zip(differ, gaps, strict=True)
        ],
    )


def arbor_logits(
    model_path: str, ids: list[int], quantization: str = "none", dtype: str = "float32"
) -> np.ndarray:
    """Arbor's logits (computed in ``dtype``, returned as float32) at every position of
    ``ids`` ([len(ids), vocab]), one prefill."""
    from runtime.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(
        model_path, dtype=dtype, quantization=quantization, kernel_backend="auto",
        kv_slots=len(ids) + 8, max_requests=1, context_len=len(ids) + 8,
    ))  # fmt: skip
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    runner.req_to_token_pool.write(row, 0, torch.arange(1, len(ids) + 1))  # slot 0: padding
    logits = runner.forward(runner.build_batch([row], [0], [ids], logits="all"))
    return logits.float().numpy()


# llama.cpp against itself: configurations other than its default whose agreement with its
# default run is the bar Arbor's agreement is held to (issue 38's measure).
LLAMA_CPP_VARIANTS: dict[str, dict[str, Any]] = {
    "K/V cached in float32 (type_k/type_v F32)": {"type_k": 0, "type_v": 0},
    "flash attention on": {"flash_attn": True},
}


def llama_cpp_logits(
    gguf: str, ids: list[int], text: str, **options: Any
) -> tuple[np.ndarray, bool]:
    """llama.cpp's logits at every position of ``ids`` ([len(ids), n_vocab]), and whether its
    own tokenization of ``text`` gives ``ids``; ``options``: more ``Llama`` arguments."""
    threads = torch.get_num_threads()
    llm = open_llama(
        gguf, n_ctx=len(ids) + 8, n_batch=512, logits_all=True, n_threads=threads,
        n_threads_batch=threads, verbose=False, **options,
    )  # fmt: skip
    # add_bos=True adds BOS where the file says the model wants one, as the tokenizer does
    tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32), tokens == ids


def llama_cpp_self_agreement(
    model_path: str | None = None, text: str | None = None
) -> dict[str, Agreement]:
    """llama.cpp's default run against each of ``LLAMA_CPP_VARIANTS``, on the same ids."""
    path = resolve_model_path(model_path)
    text = ENGLISH_PASSAGE.read_text() if text is None else text
    ids = list(load_tokenizer(path)(text).input_ids)
    default, _ = llama_cpp_logits(path, ids, text)
    return {
        name: compare(llama_cpp_logits(path, ids, text, **options)[0], default, ids)
        for name, options in LLAMA_CPP_VARIANTS.items()
    }


def measure(
    model_path: str | None = None, text: str | None = None, quantization: str = "none"
) -> Agreement:
    """Agreement on ``model_path`` (a GGUF file; default the built-in model) over ``text``
    (default the English passage), and perplexities (``Agreement.perplexity``; for a
    ``quantization`` other than ``none`` also the dequantized model's). Needs
    llama-cpp-python."""
    path = resolve_model_path(model_path)
    text = ENGLISH_PASSAGE.read_text() if text is None else text
    ids = list(load_tokenizer(path)(text).input_ids)
    theirs, tokenizer_equal = llama_cpp_logits(path, ids, text)
    ours = arbor_logits(path, ids, quantization)
    float_perplexity = None
    if quantization != "none":
        float_perplexity = perplexity(arbor_logits(path, ids, "none"), ids)
    return replace(
        compare(ours, theirs, ids),
        tokenizer_equal=tokenizer_equal,
        perplexity=perplexity(ours, ids),
        float_perplexity=float_perplexity,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="a GGUF file (default: the built-in model)")
    parser.add_argument(
        "--quantization", default="none", choices=["none", "gguf", "auto"],
        help="Arbor's (default none; gguf also measures none's perplexity)",
    )  # fmt: skip
    parser.add_argument("--text", help=f"a UTF-8 text file (default {ENGLISH_PASSAGE.name})")
    parser.add_argument("--out", help="JSON results path")
    parser.add_argument(
        "--llama-cpp-self", action="store_true",
        help="also llama.cpp's default run against its other configurations (the bar)",
    )  # fmt: skip
    args = parser.parse_args()
    text = Path(args.text).read_text() if args.text else None
    result = measure(args.model_path, text, args.quantization)
    float_ppl = result.float_perplexity
    print_table(
        ["quantization", "positions", "top-1 agreement", "arbor = text", "llama.cpp = text",
         "max |logit diff|", "tokenizer equal", "perplexity", "float32 perplexity",
         "perplexity / float32"],
        [[args.quantization, result.positions, f"{result.rate:.2%}",
          f"{result.arbor_text_top1:.2%}", f"{result.llama_cpp_text_top1:.2%}",
          result.max_abs_logit_diff, result.tokenizer_equal, f"{result.perplexity:.4f}",
          "-" if float_ppl is None else f"{float_ppl:.4f}", f"{result.perplexity_ratio:.4f}"]],
    )  # fmt: skip
    gaps = sorted(d[3] for d in result.disagreements)
    if gaps:
        print(f"\n{len(gaps)} disagreements; Arbor's logit gap between the two candidates: "
              f"median {gaps[len(gaps) // 2]:.3f}, max {gaps[-1]:.3f}")  # fmt: skip
    own = llama_cpp_self_agreement(args.model_path, text) if args.llama_cpp_self else {}
    if own:
        print("\nllama.cpp against its own default run")
        print_table(
            ["configuration", "positions", "top-1 agreement", "max |logit diff|"],
            [[name, a.positions, f"{a.rate:.2%}", a.max_abs_logit_diff] for name, a in own.items()],
        )
    payload: dict[str, Any] = {
        "llama_cpp_self": {
            name: {"agreed": a.agreed, "positions": a.positions, "rate": a.rate}
            for name, a in own.items()
        },  # fmt: skip
        "model_path": resolve_model_path(args.model_path),
        "quantization": args.quantization,
        "llama_cpp_extra_buffers_off": extra_buffers_crash(resolve_model_path(args.model_path)),
        "text": args.text or str(ENGLISH_PASSAGE),
        **asdict(result),
        "rate": result.rate,
        "perplexity_ratio": result.perplexity_ratio,
    }
    write_json("llama_cpp_agreement", payload, args.out)


if __name__ == "__main__":
    main()
