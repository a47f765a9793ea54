"""The tensor-parallel layers against the unsharded ones, on two real gloo ranks.

Both ranks (processes started once for the module) build each layer twice from the same
seeded checkpoint tensors: whole (tp_size 1) and as their shard, and run every check; rank 0's
results come back to the test. Checks run with plain weights and with oneDNN-packed ones."""

from __future__ import annotations

import multiprocessing
import queue
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from runtime.distributed.group import (
    SINGLE,
    TPGroup,
    connect_store,
    destroy_tp_group,
    init_tp_group,
    open_store,
)
from runtime.distributed.partition import HeadPartition, Shard
from runtime.layers.basic import Linear
from runtime.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 4
VOCAB = 11  # not a multiple of 2: the last rank's block is padded
TP = 2


def _checkpoint(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _qkv(tp: TPGroup, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked q|k|v with biases: the sharded output is the rank's heads of the whole one."""
    part = HeadPartition.of_rank(HEADS, KV_HEADS, tp.rank, tp.size)
    d = HEAD_DIM
    pieces = {
        "q": Shard(HEADS * d, part.q_start * d, part.num_heads * d),
        "k": Shard(KV_HEADS * d, part.kv_start * d, part.num_kv_heads * d),
        "v": Shard(KV_HEADS * d, part.kv_start * d, part.num_kv_heads * d),
    }
    whole = Linear(
        HIDDEN, {"q": HEADS * d, "k": KV_HEADS * d, "v": KV_HEADS * d}, True, torch.float32
    )
    sharded = ColumnParallelLinear(HIDDEN, pieces, True, torch.float32)
    for i, name in enumerate("qkv"):
        rows = (HEADS if name == "q" else KV_HEADS) * d
        for layer in (whole, sharded):
            layer.load("weight", name, _checkpoint(rows, HIDDEN, seed=i), f"{name}.weight")
            layer.load("bias", name, _checkpoint(rows, seed=10 + i), f"{name}.bias")
    if pack:
        whole.pack()
        sharded.pack()
    x = _checkpoint(5, HIDDEN, seed=20)
    q, k, v = whole(x).split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
    take = {
        "q": q[:, part.q_start * d : (part.q_start + part.num_heads) * d],
        "k": k[:, part.kv_start * d : (part.kv_start + part.num_kv_heads) * d],
        "v": v[:, part.kv_start * d : (part.kv_start + part.num_kv_heads) * d],
    }
    return sharded(x), torch.cat([take["q"], take["k"], take["v"]], dim=-1)


def _row(tp: TPGroup, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-parallel with a bias: the sum over ranks of the partial products, bias added once."""
    whole = Linear(HEADS * HEAD_DIM, HIDDEN, True, torch.float32)
    sharded = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, True, torch.float32, tp)
    for layer in (whole, sharded):
        layer.load("weight", "", _checkpoint(HIDDEN, HEADS * HEAD_DIM, seed=30), "o.weight")
        layer.load("bias", "", _checkpoint(HIDDEN, seed=31), "o.bias")
        if pack:
            layer.pack()
    x = _checkpoint(5, HEADS * HEAD_DIM, seed=32)
    own = sharded.in_shard
    return sharded(x[:, own.start : own.start + own.size]), whole(x)


def _embedding(tp: TPGroup, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Vocab-parallel lookup of every id, the padded block's included, on every rank."""
    table = _checkpoint(VOCAB, HIDDEN, seed=40)
    sharded = VocabParallelEmbedding(VOCAB, HIDDEN, torch.float32, tp)
    sharded.load("weight", "", table, "embed.weight")
    ids = torch.tensor([0, 5, 6, 10, 3, 10, 7])
    return sharded(ids), F.embedding(ids, table)


def _lm_head(tp: TPGroup, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Vocab-parallel head: rank 0 gathers logits over the whole vocabulary."""
    weight = _checkpoint(VOCAB, HIDDEN, seed=50)
    head = ColumnParallelLinear(HIDDEN, Shard.padded(VOCAB, tp.rank, tp.size), False, torch.float32)
    head.load("weight", "", weight, "lm_head.weight")
    if pack:
        head.pack()
    hidden = _checkpoint(3, HIDDEN, seed=51)
    logits = gather_logits(tp, head(hidden), VOCAB)
    if not tp.is_leader:
        return logits, logits  # only rank 0's logits are used
    return logits, F.linear(hidden, weight)


def _broadcast(tp: TPGroup, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's messages reach every rank: a short one, and one longer than a collective."""
    long = list(range(20_000))  # pickles to ~60 KB, over BROADCAST_BYTES
    got = [
        tp.broadcast((7, "x") if tp.is_leader else None),
        tp.broadcast(long if tp.is_leader else None),
    ]
    return torch.tensor(got[1] + [got[0][0]]), torch.tensor(long + [7])


CHECKS: dict[str, Callable[[TPGroup, bool], tuple[torch.Tensor, torch.Tensor]]] = {
    "column_parallel_qkv": _qkv,
    "row_parallel": _row,
    "vocab_parallel_embedding": _embedding,
    "vocab_parallel_lm_head": _lm_head,
    "broadcast": _broadcast,
}


def _rank_main(rank: int, port: int, results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    store = connect_store(port, TP)
    tp = init_tp_group(store, rank, TP, torch.device("cpu"))
    try:
        for name, check in CHECKS.items():
            for pack in (False, True):
                try:
                    got, expected = check(tp, pack)
                    error = None
                    if got.shape != expected.shape:
                        error = f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
                    elif not torch.allclose(got, expected, atol=1e-5, rtol=1e-5):
                        error = f"max difference {float((got - expected).abs().max())}"
                except Exception:
                    error = traceback.format_exc()
                results.put((rank, name, pack, error))
    finally:
        destroy_tp_group()


@pytest.fixture(scope="module")
def rank_results() -> dict[tuple[str, bool], list[str | None]]:
    """{(check, packed): [rank 0's error or None, rank 1's]} from one run of both ranks."""
    store = open_store(TP + 1)  # kept by the test process; the ranks both connect to it
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=_rank_main, args=(r, store.port, results)) for r in range(TP)]
    for process in ranks:
        process.start()
    collected: dict[tuple[str, bool], list[str | None]] = {}
    try:
        for _ in range(TP * len(CHECKS) * 2):
            rank, name, pack, error = results.get(timeout=120)
            collected.setdefault((name, pack), [None] * TP)[rank] = error
    except queue.Empty:
        pytest.fail("the ranks did not report in time")
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
    return collected


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("check", list(CHECKS))
def test_sharded_layer_matches_the_whole_layer(
    rank_results: dict[tuple[str, bool], list[str | None]], check: str, pack: bool
) -> None:
    assert rank_results[(check, pack)] == [None] * TP


def test_a_group_of_one_communicates_nothing() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    assert SINGLE.all_reduce(x) is x
    assert SINGLE.gather_to_leader(x) is x
    assert SINGLE.broadcast({"a": 1}) == {"a": 1}
    assert SINGLE.min(7) == 7
