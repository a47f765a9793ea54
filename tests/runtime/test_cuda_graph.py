"""CUDA graphs for decode (runtime/cuda_graph_runner.py).

On CPU the graph is an eager stand-in (tests/runtime/graph_standin.py) whose replay re-runs the
captured forward on the static buffers: that covers the buffers, padding, bucket choice and
fallbacks. The tests marked ``cuda`` capture real ``torch.cuda`` graphs and need a GPU; run
them in a session without tests/kernels, whose conftest turns the triton interpreter on for
the whole process.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import arbor_kernels as kernels
import pytest
import torch

from runtime import Engine, model_runner
from runtime.cuda_graph_runner import CudaGraphFactory, capture_batch_sizes
from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.memory_pool import PADDING_SLOT
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.server_args import ServerArgs
from tests.runtime.graph_standin import CountingGraphFactory
from tests.runtime.helpers import random_prompts
from tests.runtime.paged_driver import PagedDriver

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MAX_BS = 16  # buckets 1, 2, 4, 8, 16
# Decode batch sizes in an order that exercises exact buckets, sizes between buckets (padding)
# and shrinking batches (rows a bigger batch filled must become padding again).
SIZES = [16, 11, 3, 1, 5, 12, 2, 16, 7]


@pytest.fixture
def standin() -> Iterator[CountingGraphFactory]:
    """Forces the graph path on CPU for ModelRunners built while it is active (test-only hook)."""
    factory = CountingGraphFactory()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "_TEST_GRAPH_FACTORY", factory)
        yield factory


def _runner(path: Path, device: str = "cpu", **kwargs: object) -> ModelRunner:
    return ModelRunner(RunnerConfig(
        str(path), dtype="float32", device=device, kv_slots=4096, max_requests=32,
        cascade_min_prefix=None, cuda_graph_max_bs=MAX_BS, **kwargs,  # type: ignore[arg-type]
    ))  # fmt: skip


def _prefilled(runner: ModelRunner, count: int, seed: int) -> tuple[PagedDriver, list[int]]:
    """``count`` sequences of assorted lengths, prefilled; returns the driver and each one's
    greedy next token."""
    driver = PagedDriver(runner, seed=seed)
    prompts = random_prompts([3 + 7 * i for i in range(count)], seed=seed)
    seqs = [driver.new_sequence() for _ in prompts]
    next_ids = driver.extend(seqs, prompts).argmax(-1).tolist()
    return driver, next_ids


def _graph_vs_eager(
    runner: ModelRunner, factory: CountingGraphFactory, atol: float, rtol: float
) -> None:
    """Decode batches of each size in SIZES through the graph path and eagerly on the same
    batch; the logits must agree and each batch must have been a replay."""
    driver, next_ids = _prefilled(runner, MAX_BS, seed=5)
    for size in SIZES:
        batch = driver.batch(list(range(size)), [[t] for t in next_ids[:size]])
        assert runner.graph_runner is not None and runner.graph_runner.can_run(batch)
        before = factory.replays
        with torch.inference_mode():
            eager = runner.model(batch)
        graph = runner.forward(batch)
        assert factory.replays == before + 1
        assert graph.shape == (size, runner.config.vocab_size)
        torch.testing.assert_close(graph, eager, atol=atol, rtol=rtol)
        next_ids[:size] = graph.argmax(-1).tolist()


# ---- CPU: the eager stand-in ----------------------------------------------------------------


def test_buckets() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(160) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144,
                                        160]  # fmt: skip
    assert capture_batch_sizes(100)[-3:] == [80, 96, 100]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


def test_no_capture_on_cpu_or_when_disabled(tiny_model_path: Path, standin: CountingGraphFactory):
    assert _runner(tiny_model_path, disable_cuda_graph=True).graph_runner is None
    assert standin.captured == 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "_TEST_GRAPH_FACTORY", None)
        assert _runner(tiny_model_path).graph_runner is None


def test_captures_each_bucket_capped_by_request_rows(
    tiny_model_path: Path, standin: CountingGraphFactory
) -> None:
    runner = _runner(tiny_model_path)
    assert runner.graph_runner is not None
    assert sorted(runner.graph_runner.graphs) == [1, 2, 4, 8, 16]
    assert standin.captured == 5
    small = ModelRunner(RunnerConfig(str(tiny_model_path), kv_slots=1024, max_requests=6))
    assert small.graph_runner is not None and small.graph_runner.max_bs == 6  # not 160


def test_padded_replay_equals_eager(tiny_model_path: Path, standin: CountingGraphFactory) -> None:
    runner = _runner(tiny_model_path)
    _graph_vs_eager(runner, standin, atol=1e-5, rtol=1e-5)


def test_padded_replay_equals_eager_on_the_triton_kernels(
    tiny_model_path: Path, standin: CountingGraphFactory
) -> None:
    """The kernels a GPU graph captures, run under the triton interpreter."""
    previous = kernels.kernel_backend()
    kernels.set_kernel_backend("triton")
    try:
        runner = ModelRunner(
            RunnerConfig(
                str(tiny_model_path), kv_slots=512, max_requests=4, cascade_min_prefix=None
            )
        )
        driver, next_ids = _prefilled(runner, 4, seed=13)
        for size in (3, 1, 4, 2):
            batch = driver.batch(list(range(size)), [[t] for t in next_ids[:size]])
            with torch.inference_mode():
                eager = runner.model(batch)
            graph = runner.forward(batch)
            torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
            next_ids[:size] = graph.argmax(-1).tolist()
        assert standin.replays == 4
    finally:
        kernels.set_kernel_backend(previous)


def test_padding_rows_write_only_the_padding_slot(
    tiny_model_path: Path, standin: CountingGraphFactory
) -> None:
    runner = _runner(tiny_model_path)
    driver, next_ids = _prefilled(runner, 8, seed=7)
    first = driver.batch(list(range(8)), [[t] for t in next_ids])
    next_ids = runner.forward(first).argmax(-1).tolist()
    pool = runner.kv_pool
    for buffer in pool.k_buffers + pool.v_buffers:
        buffer[PADDING_SLOT] = 0  # capturing ran padding rows already
        # Real KV that rows 5-7 of the last replay wrote: stale rows must not write it again.
        buffer[first.out_cache_loc] = 7.0
    batch = driver.batch(list(range(5)), [[t] for t in next_ids[:5]])  # padded to 8
    before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    runner.forward(batch)
    assert standin.replays == 2
    written = set(batch.out_cache_loc.tolist())
    untouched = [s for s in range(pool.num_slots) if s not in written and s != PADDING_SLOT]
    after = pool.k_buffers + pool.v_buffers
    for old, new in zip(before, after, strict=True):
        # bit for bit (the pool starts unwritten: torch.empty, so NaN bit patterns may be there)
        assert torch.equal(old[untouched].view(torch.int32), new[untouched].view(torch.int32))
        assert new[PADDING_SLOT].any()  # the 3 padding rows did write somewhere: here
    graph_kv = [b[batch.out_cache_loc].clone() for b in after]
    for old, new in zip(before, after, strict=True):
        new.copy_(old)
    with torch.inference_mode():
        runner.model(batch)
    for mine, eager in zip(graph_kv, after, strict=True):
        torch.testing.assert_close(mine, eager[batch.out_cache_loc], atol=1e-6, rtol=1e-6)


def test_batches_that_do_not_fit_run_eagerly(
    tiny_model_path: Path, standin: CountingGraphFactory
) -> None:
    runner = _runner(tiny_model_path)
    graphs = runner.graph_runner
    assert graphs is not None
    driver, next_ids = _prefilled(runner, MAX_BS + 1, seed=9)
    one_each = [[t] for t in next_ids]
    extend = driver.batch([0, 1], [[5, 6, 7], [8, 9]])
    too_big = driver.batch(list(range(MAX_BS + 1)), one_each)
    # Rows that are not one per request, as prompt logprobs or drafts would ask for.
    logprob_rows = driver.batch([2, 3], one_each[2:4], logits=torch.tensor([0, 0, 1]))
    some_rows = driver.batch([4, 5], one_each[4:6], logits=torch.tensor([1]))
    explicit_rows = driver.batch([6, 7], one_each[6:8], logits=torch.tensor([0, 1]))
    assert extend.mode is ForwardMode.EXTEND and too_big.mode is ForwardMode.DECODE
    assert explicit_rows.logits_last_per_request  # given as the scheduler gives them, on CPU
    cascade = _cascade_batch(runner)
    for batch in (extend, too_big, logprob_rows, some_rows, cascade):
        assert not graphs.can_run(batch)
        with torch.inference_mode():
            expected = runner.model(batch)
        assert torch.equal(runner.forward(batch), expected)
    assert standin.replays == 0
    assert graphs.can_run(explicit_rows)


def _cascade_batch(runner: ModelRunner) -> ForwardBatch:
    """Two decode requests sharing a 40-token prefix, built with a cascade plan."""
    pool = runner.req_to_token_pool
    kv = runner.kv_pool
    # The prefix's slots hold K/V as a prefill would have left them (the pool starts unwritten,
    # and attention may only read written slots).
    written = torch.cat([torch.arange(100, 140), torch.tensor([200, 201])])
    gen = torch.Generator().manual_seed(3)
    for layer in range(kv.num_layers):
        shape = (len(written), *kv.k_buffers[layer].shape[1:])
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        kv.write(layer, written, k, v)
    rows = []
    for i in range(2):
        row = pool.alloc()
        assert row is not None
        pool.write(row, 0, torch.cat([torch.arange(100, 140), torch.tensor([200 + i])]))
        rows.append(row)
    batch = ForwardBatch.build(
        rows, [40, 40], [[11], [12]], runner.kv_pool, pool, cascade_min_prefix=16
    )
    assert batch.cascade is not None
    return batch


def test_flags_parse() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = ["--model-path", "m", "--disable-cuda-graph", "--cuda-graph-max-bs", "48"]
    args = ServerArgs.from_cli(parser.parse_args(flags))
    assert args.disable_cuda_graph and args.cuda_graph_max_bs == 48
    default = ServerArgs.from_cli(parser.parse_args(["--model-path", "m"]))
    assert not default.disable_cuda_graph and default.cuda_graph_max_bs is None
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(model_path="m", cuda_graph_max_bs=0)


GREEDY = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}


def _engine_greedy(path: Path, **kwargs: object) -> list[tuple[list[int], list[float]]]:
    """Greedy outputs and their logprobs: five prompts batched, then one alone (batch 1)."""
    prompts = random_prompts([4, 9, 15, 22, 31], seed=11)
    with Engine(path, max_total_tokens=4096, max_running_requests=8, **kwargs) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        results.append(
            engine.generate(input_ids=prompts[0], sampling_params=GREEDY, return_logprob=True)
        )
    return [
        (r["output_ids"], [lp for lp, _ in r["meta_info"]["output_token_logprobs"]])
        for r in results
    ]


def _assert_same_outputs(
    graphed: list[tuple[list[int], list[float]]],
    eager: list[tuple[list[int], list[float]]],
    tolerance: float,
) -> None:
    assert [ids for ids, _ in graphed] == [ids for ids, _ in eager]
    for (_, mine), (_, theirs) in zip(graphed, eager, strict=True):
        assert mine == pytest.approx(theirs, abs=tolerance)


def test_engine_greedy_equal_with_graph_path_on(tiny_model_path: Path) -> None:
    eager = _engine_greedy(tiny_model_path, disable_cuda_graph=True)
    factory = CountingGraphFactory()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "_TEST_GRAPH_FACTORY", factory)
        graphed = _engine_greedy(tiny_model_path)
    assert factory.captured == len(capture_batch_sizes(8))
    assert factory.replays >= 2 * 19  # 19 decode steps of the batch, 19 of the lone request
    _assert_same_outputs(graphed, eager, tolerance=1e-5)


# ---- CUDA: real graphs ------------------------------------------------------------------------


@cuda
def test_cuda_graph_replay_equals_eager(tiny_model_path: Path) -> None:
    counting = CountingGraphFactory(CudaGraphFactory())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "_TEST_GRAPH_FACTORY", counting)
        runner = _runner(tiny_model_path, device="cuda")
    assert counting.captured == len(capture_batch_sizes(MAX_BS))
    # fp32 on both paths; they differ only in GEMM shapes and decode split counts.
    _graph_vs_eager(runner, counting, atol=1e-3, rtol=1e-3)


@cuda
def test_cuda_runner_captures_by_default(tiny_model_path: Path) -> None:
    runner = _runner(tiny_model_path, device="cuda")
    assert runner.graph_runner is not None, "not captured: is the kernel backend graph-safe?"
    assert _runner(tiny_model_path, device="cuda", disable_cuda_graph=True).graph_runner is None
    previous = kernels.kernel_backend()
    kernels.set_kernel_backend("torch")  # its decode attention syncs with the host
    try:
        assert _runner(tiny_model_path, device="cuda").graph_runner is None
    finally:
        kernels.set_kernel_backend(previous)


@cuda
def test_cuda_padding_rows_write_only_the_padding_slot(tiny_model_path: Path) -> None:
    runner = _runner(tiny_model_path, device="cuda")
    driver, next_ids = _prefilled(runner, 5, seed=7)
    batch = driver.batch(list(range(5)), [[t] for t in next_ids])
    pool = runner.kv_pool
    before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    runner.forward(batch)
    torch.cuda.synchronize()
    keep = torch.ones(pool.num_slots, dtype=torch.bool, device="cuda")
    keep[batch.out_cache_loc] = False
    keep[PADDING_SLOT] = False
    for old, new in zip(before, pool.k_buffers + pool.v_buffers, strict=True):
        assert torch.equal(old[keep], new[keep])


@cuda
def test_cuda_graph_decode_attention_reads_longer_sequences_than_captured() -> None:
    from arbor_kernels.reference import attention as reference

    torch.manual_seed(0)
    slots, heads, kv_heads, dim, batch = 4096, 8, 2, 64, 4
    k = torch.randn(slots, kv_heads, dim, device="cuda")
    v = torch.randn(slots, kv_heads, dim, device="cuda")
    table = torch.randperm(slots, device="cuda")[: batch * 1000].view(batch, 1000)
    rows = torch.arange(batch, device="cuda")
    q = torch.randn(batch, heads, dim, device="cuda")
    seq_lens = torch.full((batch,), 3, device="cuda")
    out = kernels.decode_attention(q, k, v, table, rows, seq_lens, dim**-0.5)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.decode_attention(q, k, v, table, rows, seq_lens, dim**-0.5)
    for lengths in ([1, 5, 64, 65], [999, 1, 300, 700]):
        seq_lens.copy_(torch.tensor(lengths))
        q.copy_(torch.randn_like(q))
        graph.replay()
        expected = reference.decode_attention(q, k, v, table, rows, seq_lens, dim**-0.5)
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@cuda
def test_cuda_engine_greedy_equal_with_graphs(tiny_model_path: Path) -> None:
    eager = _engine_greedy(tiny_model_path, dtype="float32", disable_cuda_graph=True)
    graphed = _engine_greedy(tiny_model_path, dtype="float32")
    _assert_same_outputs(graphed, eager, tolerance=1e-3)
