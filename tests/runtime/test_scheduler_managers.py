"""PrefillAdmission and DecodeManager on a CPU KV cache without a model: budgets, chunking,
in-step prefix sharing (loans), retraction order and the out-of-memory failure, with the slot
accounting checked after every plan."""

from __future__ import annotations

import torch

from radix_cache import KVSlotAllocator, RadixCache
from runtime.forward_batch import ForwardBatch
from runtime.ipc import GenerateRequest
from runtime.memory_pool import KVPool, ReqToTokenPool
from runtime.sampling_params import SamplingParams
from runtime.scheduler.decode_manager import DecodeManager
from runtime.scheduler.kv_manager import KVCacheManager
from runtime.scheduler.prefill_admission import IN_BATCH_SHARING_THRESHOLD, PrefillAdmission
from runtime.scheduler.req import Req, Status
from runtime.scheduler.token_ratio import NewTokenRatio
from runtime.server_args import ServerArgs


def _kv(slots: int, rows: int = 8) -> KVCacheManager:
    allocator = KVSlotAllocator(slots)
    return KVCacheManager(
        allocator, RadixCache(allocator), ReqToTokenPool(rows, 512, torch.device("cpu"))
    )


def _req(rid: str, ids: list[int], max_new_tokens: int = 4, salt: str | None = None) -> Req:
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return Req(GenerateRequest(rid, ids, params, cache_salt=salt), seed=0)


def _admission(kv: KVCacheManager, step: int, chunk: int, running: int = 8) -> PrefillAdmission:
    args = ServerArgs(
        "unused", max_prefill_tokens=step, chunked_prefill_size=chunk, max_running_requests=running
    )
    return PrefillAdmission(args, "cpu", kv, NewTokenRatio())


def test_step_budget_and_chunks_split_long_prompts():
    kv = _kv(1024)
    admission = _admission(kv, step=16, chunk=8)
    waiting = [_req("a", list(range(10))), _req("b", list(range(100, 110)))]
    chunks, admitted = admission.schedule([], waiting)
    assert [(r.rid, n) for r, n in chunks] == [("a", 8), ("b", 8)]
    assert admitted == waiting
    assert all(r.kv.kv_len == 8 and r.pending_len == 2 for r in admitted)
    kv.check_invariants(admitted)
    # Next step: the running partial prefills continue first.
    chunks, admitted = admission.schedule(waiting, [_req("c", list(range(200, 210)))])
    assert [(r.rid, n) for r, n in chunks][:2] == [("a", 2), ("b", 2)]
    kv.check_invariants(waiting + admitted)


def test_max_running_requests_caps_admission():
    kv = _kv(1024)
    admission = _admission(kv, step=1024, chunk=1024, running=2)
    waiting = [_req(str(i), [i] * 5 + list(range(50, 55))) for i in range(4)]
    _, admitted = admission.schedule([], waiting)
    assert [r.rid for r in admitted] == ["0", "1"]
    kv.check_invariants(admitted)


def test_kv_budget_keeps_room_for_running_decodes():
    kv = _kv(64)
    admission = _admission(kv, step=1024, chunk=1024)
    first = _req("first", list(range(30)), max_new_tokens=16)
    _, admitted = admission.schedule([], [first])
    assert admitted == [first]
    # 30 + 16 * ratio reserved for it; a second long prompt no longer fits and waits, unheld.
    second = _req("second", list(range(100, 130)), max_new_tokens=16)
    _, more = admission.schedule([first], [second])
    assert more == [] and second.kv.row is None and second.kv.kv_len == 0
    kv.check_invariants([first])


def _kv_paged(slots: int, page: int, rows: int = 8) -> KVCacheManager:
    allocator = KVSlotAllocator(slots, page_size=page)
    return KVCacheManager(
        allocator, RadixCache(allocator), ReqToTokenPool(rows, 512, torch.device("cpu"))
    )


def _row(kv: KVCacheManager, req: Req, end: int) -> list[int]:
    assert req.kv.row is not None
    return kv.req_to_token_pool.host[req.kv.row, :end].tolist()


def test_requests_sharing_an_uncached_prefix_borrow_its_slots_in_the_same_step():
    kv = _kv(1024)
    admission = _admission(kv, step=1024, chunk=1024)
    prefix = list(range(IN_BATCH_SHARING_THRESHOLD + 8))
    a, b, c = (_req(x, prefix + [900 + i]) for i, x in enumerate("abc"))
    chunks, admitted = admission.schedule([], [a, b, c])
    assert admitted == [a, b, c]
    # a computes the prefix; b and c read its slots and compute only their own last token.
    assert [(r.rid, n) for r, n in chunks] == [("a", len(prefix) + 1), ("b", 1), ("c", 1)]
    assert b.kv.cached_len == c.kv.cached_len == len(prefix) and b.kv.cached_tokens == len(prefix)
    assert _row(kv, b, len(prefix)) == _row(kv, c, len(prefix)) == _row(kv, a, len(prefix))
    kv.check_invariants(admitted)  # each lent slot is a's alone until the forward is done
    kv.settle_loans()
    kv.check_invariants(admitted)
    assert a.kv.cached_len == len(prefix) + 1 and a.kv.lends is False and b.kv.loan_start is None
    assert kv.tree is not None and kv.tree.match_prefix(prefix).length == len(prefix)
    # The lender finishing first (even aborted, keeping nothing) leaves the borrowers whole.
    kv.release(a, keep_in_cache=False, finished=True)
    kv.check_invariants([b, c])
    for req in (b, c):
        kv.release(req, keep_in_cache=True, finished=True)
    kv.check_invariants([])
    assert kv.tree.match_prefix(prefix + [901]).length == len(prefix) + 1


def test_requests_of_different_cache_salts_share_no_kv_in_step_or_cached():
    kv = _kv(1024)
    admission = _admission(kv, step=1024, chunk=1024)
    prefix = list(range(IN_BATCH_SHARING_THRESHOLD + 8))
    salts = {"a": "x", "b": "y", "c": None, "d": "x"}
    reqs = [_req(rid, prefix + [900 + i], salt=salt) for i, (rid, salt) in enumerate(salts.items())]
    chunks, admitted = admission.schedule([], reqs)
    assert admitted == reqs
    # One request per salt computes the prefix; only d, with a's salt, reads a's slots.
    whole = len(prefix) + 1
    assert [(r.rid, n) for r, n in chunks] == [("a", whole), ("b", whole), ("c", whole), ("d", 1)]
    assert [r.kv.cached_tokens for r in reqs] == [0, 0, 0, len(prefix)]
    kv.settle_loans()
    for req in reqs:
        kv.release(req, keep_in_cache=True, finished=True)
    kv.check_invariants([])
    assert kv.tree is not None
    for salt in ("x", "y", None):  # three copies, one per salt
        assert kv.tree.match_prefix(prefix, salt).length == len(prefix)
    assert kv.tree.match_prefix(prefix, "z").length == 0
    later = _req("e", prefix + [7], salt="y")
    assert kv.cached_prefix_len(later) == len(prefix)
    assert kv.cached_prefix_len(_req("f", prefix + [7], salt="z")) == 0


def test_a_short_shared_tail_is_borrowed_not_recomputed():
    kv = _kv(1024)
    admission = _admission(kv, step=1024, chunk=1024)
    a = _req("a", list(range(20)))
    chunks, _ = admission.schedule([], [a])
    kv.settle_loans()
    kv.cache_prefix(a)
    # Two continuations of a's text sharing a 5-token tail it has not seen.
    tail = [500, 501, 502, 503, 504]
    b, c = _req("b", list(range(20)) + tail + [7]), _req("c", list(range(20)) + tail + [8])
    chunks, admitted = admission.schedule([a], [b, c])
    assert [(r.rid, n) for r, n in chunks] == [("b", 6), ("c", 1)]
    assert c.kv.cached_len == 25 and c.kv.cached_tokens == 25
    kv.settle_loans()
    kv.check_invariants([a, b, c])


def test_a_borrower_computes_the_positions_whose_logits_it_needs():
    kv = _kv(1024)
    admission = _admission(kv, step=1024, chunk=1024)
    prefix = list(range(40))
    a = _req("a", prefix + [900])
    b = Req(
        GenerateRequest(
            "b", prefix + [901], SamplingParams(max_new_tokens=0), return_logprob=True,
            logprob_start_len=30,
        ),
        seed=0,
    )  # fmt: skip
    chunks, admitted = admission.schedule([], [a, b])
    assert admitted == [a, b]
    assert b.kv.cached_len == 29  # logits from position 29 on are b's to compute
    assert dict((r.rid, n) for r, n in chunks)["b"] == 41 - 29
    kv.settle_loans()
    kv.check_invariants(admitted)


def test_a_shared_prefix_computed_in_a_later_chunk_waits_a_round():
    kv = _kv(1024)
    admission = _admission(kv, step=1024, chunk=16)
    prefix = list(range(IN_BATCH_SHARING_THRESHOLD + 24))
    a, b = _req("a", prefix + [900]), _req("b", prefix + [901])
    chunks, admitted = admission.schedule([], [a, b])
    # a computes 16 of the shared tokens now, the rest (40) in later chunks: b waits for them.
    assert admitted == [a] and b.kv.row is None
    kv.check_invariants([a])


def test_loans_are_whole_pages():
    kv = _kv_paged(1024, page=16)
    admission = _admission(kv, step=1024, chunk=1024)
    prefix = list(range(40))
    a, b = _req("a", prefix + [900]), _req("b", prefix + [901])
    chunks, admitted = admission.schedule([], [a, b])
    assert admitted == [a, b] and b.kv.cached_len == 32  # two pages; the third is b's own
    assert [(r.rid, n) for r, n in chunks] == [("a", 41), ("b", 9)]
    assert _row(kv, b, 32) == _row(kv, a, 32)
    assert kv.req_to_token_pool.host[b.kv.row, 32].item() % 16 == 0  # its own page starts there
    kv.check_invariants(admitted)
    kv.settle_loans()
    kv.check_invariants(admitted)
    for req in admitted:
        kv.release(req, keep_in_cache=True, finished=True)
    kv.check_invariants([])


def test_without_a_tree_nothing_is_lent_or_held_back():
    allocator = KVSlotAllocator(1024)
    kv = KVCacheManager(allocator, None, ReqToTokenPool(8, 512, torch.device("cpu")))
    admission = _admission(kv, step=1024, chunk=1024)
    prefix = list(range(IN_BATCH_SHARING_THRESHOLD + 8))
    a, b = _req("a", prefix + [900]), _req("b", prefix + [901])
    chunks, admitted = admission.schedule([], [a, b])
    assert admitted == [a, b] and [n for _, n in chunks] == [len(prefix) + 1] * 2
    kv.check_invariants(admitted)


def _decoding(kv: KVCacheManager, reqs: list[Req]) -> None:
    """Admit and fully 'prefill' ``reqs``, then give each a sampled token to decode next."""
    for req in reqs:
        assert kv.admit(req) and kv.alloc_extend(req, req.pending_len)
        req.append_output(7)
        assert req.pending_len == 1


def test_decode_gives_each_request_its_slot():
    kv = _kv(256)
    reqs = [_req(str(i), list(range(i * 20, i * 20 + 10 + i))) for i in range(3)]
    _decoding(kv, reqs)
    free = kv.available_tokens()
    ready, retracted, failed = DecodeManager(kv, NewTokenRatio()).allocate(reqs)
    assert sorted(r.rid for r in ready) == ["0", "1", "2"] and not retracted and not failed
    assert kv.available_tokens() == free - 3
    kv.check_invariants(reqs)


def _fill_pool_but(kv: KVCacheManager, keep: int) -> Req:
    """Another admitted request holding all free slots but ``keep`` (no tree to evict)."""
    filler = _req("filler", list(range(1000, 1000 + kv.allocator.available() - keep)))
    assert kv.admit(filler) and kv.alloc_extend(filler, filler.pending_len)
    return filler


def test_decode_under_pressure_drops_drafts_then_retracts_the_cheapest():
    kv = _kv(64)
    big, small = _req("big", list(range(20))), _req("small", list(range(100, 110)))
    _decoding(kv, [big, small])
    big.draft.tokens = [1, 2, 3]  # needs 4 slots with its draft, 1 without
    filler = _fill_pool_but(kv, keep=1)
    decodes = DecodeManager(kv, NewTokenRatio())
    ready, retracted, failed = decodes.allocate([big, small])
    assert ready == [big] and big.draft.tokens == []  # the draft went first
    assert retracted == [small] and not failed  # then the request with the least KV
    assert small.kv.row is None and small.kv.kv_len == 0
    assert small.status is Status.RETRACTED
    assert small.output_ids == [7]  # its output so far is kept
    assert decodes.num_retracted == 1
    kv.check_invariants([big, filler])


def test_a_decode_that_cannot_progress_even_alone_fails_with_a_400():
    kv = _kv(64)
    req = _req("huge", list(range(20)))
    _decoding(kv, [req])
    filler = _fill_pool_but(kv, keep=0)
    ready, retracted, failed = DecodeManager(kv, NewTokenRatio()).allocate([req])
    assert failed == [req] and not ready and not retracted
    reason = req.finished_reason
    assert reason is not None and reason.status_code == 400
    assert "max_total_tokens" in (reason.message or "")
    kv.check_invariants([filler])


def test_the_scheduler_reads_the_slot_table_on_its_host_copy_only():
    """On a GPU the slot table lives on the device, with a host copy the scheduler reads (a
    read of the device table waits for the forward in flight). A table on the meta device has
    no data to read: admission, a page continued (its last slot looked up), the forward batch,
    release into the cache and a later hit all run from the host copy, which holds the slots."""
    allocator = KVSlotAllocator(256, page_size=4)
    pool = ReqToTokenPool(8, 512, torch.device("meta"))
    assert pool.host.device.type == "cpu" and pool.host is not pool.req_to_token
    kv = KVCacheManager(allocator, RadixCache(allocator), pool)
    a = _req("a", list(range(10)))
    assert kv.admit(a) and kv.alloc_extend(a, a.pending_len)
    assert kv.alloc_extend(a, 1)  # position 10 continues the page holding 8 and 9
    held = pool.host[a.kv.row, :11].clone()
    assert int(held[10]) == int(held[9]) + 1 and int(held[8]) % 4 == 0
    kv_pool = KVPool(256, 1, 1, 4, torch.float32, torch.device("meta"))
    batch = ForwardBatch.build([a.kv.row], [0], [list(range(11))], kv_pool, pool)
    assert batch.out_cache_loc.device.type == "meta" and batch.out_cache_loc.shape == (11,)
    a.token_ids.append(10)
    kv.release(a, keep_in_cache=True, finished=True)
    b = _req("b", list(range(11)) + [99])
    assert kv.admit(b) and b.kv.cached_len == 8
    assert torch.equal(pool.host[b.kv.row, :8], held[:8])
    kv.check_invariants([b])


def test_program_admission_unpins_only_when_pinned_kv_keeps_requests_out():
    from runtime.scheduler.program_admission import ProgramAdmission

    kv = _kv(64)
    programs = ProgramAdmission(kv, NewTokenRatio(), ordering=True)
    prefix = list(range(40))
    kv.tree.insert(prefix, kv.allocator.alloc(40))
    kv.pins.pin("p1", "main", kv.tree.match_prefix(prefix).node, 40)
    room = kv.capacity - 40  # the pinned 40 are neither free nor evictable
    assert kv.available_tokens() == room < 30
    small, large = _req("small", list(range(100, 110))), _req("large", list(range(200, 230)))
    assert not programs.make_room([small], [])  # 10 fits: the pin stays
    assert not programs.make_room([large], [small], stuck=True)  # something runs: not stuck
    assert kv.pins.num_programs == 1 and programs.pins_shed == 0
    assert programs.make_room([large], [])  # 30 does not fit: the program yields its KV
    assert kv.pins.num_programs == 0 and programs.pins_shed == 1
    assert kv.available_tokens() == kv.capacity
    assert not programs.make_room([large], [])  # nothing left to unpin
