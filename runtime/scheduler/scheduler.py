"""The scheduler loop: receive requests, pick the next batch, run it, process the results.

One thread owns everything here (the model, the KV pool, the radix tree); other components
talk to it only through messages. Each step runs every decoding request for one token plus as
much prefill as the budgets allow, packed into one forward.

Failures are per request wherever the work is per request: admitting, grammar compiling,
masking, sampling, draft handling, stop checking. An exception there fails that request alone
(a 4xx/5xx to its caller, its KV freed) and the loop goes on. Only what every request shares
(the forward, the KV pool, the radix tree) may raise out of ``step``; the process then reports
the crash and exits.

Overlap (the default; ``--disable-overlap-schedule`` turns it off): the forward runs on a
worker thread (torch releases the GIL inside its ops; on CUDA the thread queues the kernels)
while this thread does the step's work that does not need its logits: the grammar masks of the
rows it will sample and of the drafts it will verify, sending the previous step's outputs, and
handling new messages. Everything that decides what the next step computes (sampling, stop
checks, drafts, admission) still runs in the same order as without overlap, so outputs are
identical; while a forward runs nothing may touch the KV pool or the request-to-slot table, so
an abort of a running request is recorded then and carried out after the forward.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from radix_cache import KVSlotAllocator, RadixCache
from radix_cache.swa import HybridSlotAllocator
from runtime.api_keys import salt_tenant
from runtime.channels import Receiver, Sender, drain
from runtime.chat_templates import template_stop_ids
from runtime.cpu_features import cpu_flags
from runtime.dry_penalty import tokenizer_breakers
from runtime.forward_batch import ForwardBatch
from runtime.heap import frozen_objects
from runtime.heartbeat import Heartbeat
from runtime.ipc import (
    AbortRequest,
    ControlCommand,
    ControlReply,
    ControlRequest,
    FinishReason,
    GenerateRequest,
    PinPrefix,
    ProgramRelease,
    SchedulerFailed,
    SchedulerReady,
    TokenOutput,
    TokenOutputBatch,
)
from runtime.model_config import stored_dtype
from runtime.model_files import load_tokenizer, locate_model
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.sampler import SampleOutput, Sampler, take_rows
from runtime.scheduler.activity_log import ActivityLog
from runtime.scheduler.cache_view import CacheView
from runtime.scheduler.decode_manager import DecodeManager
from runtime.scheduler.disk_tier import NO_TIER_INFO, KVDiskTier, disk_tier_spec
from runtime.scheduler.grammar_manager import GrammarManager, needs_preparing
from runtime.scheduler.kv_manager import KVCacheManager
from runtime.scheduler.output_processor import OutputProcessor
from runtime.scheduler.prefill_admission import PrefillAdmission
from runtime.scheduler.program_admission import ProgramAdmission
from runtime.scheduler.req import Req, Status
from runtime.scheduler.schedule_policy import make_policy, with_starved_first
from runtime.scheduler.step_batch import StepBatch
from runtime.scheduler.stop_checker import StopChecker
from runtime.scheduler.token_ratio import NewTokenRatio
from runtime.server_args import ServerArgs
from runtime.speculative.drafts import JUMP, DraftManager, SpeculationConfig
from runtime.speculative.verify import DraftVerifier
from runtime.startup_phases import StartupPhases
from runtime.tp_runner import TensorParallelRunner, start_model_runner

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SchedulerStats:
    """Counters since the scheduler started (reported in ``server_info`` by these names)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    requests_finished: int = 0
    forward_steps: int = 0
    draft_tokens_proposed: int = 0  # jump-forward
    draft_tokens_accepted: int = 0
    spec_draft_tokens: int = 0  # speculative decoding
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    emit_steps: int = 0  # a request's forward steps that gave it tokens, summed
    # Prompt tokens looked up in the radix cache at first admission, and those found there
    # (both 0 with the cache off).
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        inbox: Receiver,
        to_detokenizer: Sender,
        to_tokenizer: Sender,
        replica: int = 0,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        """``replica``: this scheduler's index among a ``--dp`` server's replicas (its disk
        tier's subfolder). ``heartbeat``: where the loop proves it turns (/health reads it)."""
        self.inbox, self.to_detokenizer, self.to_tokenizer = inbox, to_detokenizer, to_tokenizer
        self.replica = replica
        self.heartbeat = heartbeat if heartbeat is not None else Heartbeat.local()
        # The device's defaults (auto dtypes, prefill budgets, ...), filled in once, here.
        stored = stored_dtype(locate_model(args.model_path).config())
        args = args.for_device(torch.cuda.is_available(), stored, cpu_flags())
        # With tp_size > 1, rank 0 of a tensor-parallel group: it starts the other ranks.
        self.runner = start_model_runner(args.tp_size, RunnerConfig.from_server_args(args))
        # How long each part of the start took (the server process logs them when ready).
        self.startup = StartupPhases()
        self.startup.extend(self.runner.startup_phases.phases)
        try:
            self._set_up(args)
        except BaseException:
            disk = getattr(self, "disk", None)
            if disk is not None:
                disk.close()
            self.runner.shutdown()
            raise

    def _set_up(self, args: ServerArgs) -> None:
        """Everything but the model runner (which must be shut down if this raises)."""
        config = self.runner.config
        with self.startup.phase("tokenizer"):
            self.tokenizer = load_tokenizer(
                args.model_path, args.tokenizer_path, args.chat_template
            )
        self.context_len = self.runner.context_len
        allocator = slot_allocator(self.runner, args.page_size)
        tree = None
        if not args.disable_radix_cache:
            tree = RadixCache(
                allocator,
                policy=args.eviction_policy,
                max_pinned_fraction=args.max_pinned_fraction,
                max_pin_s=args.max_pin_seconds,
                # Fair eviction between tenants; without tenants every request is one's.
                tenant_of=salt_tenant if args.api_keys_file is not None else None,
            )
        self.kv = KVCacheManager(
            allocator, tree, self.runner.req_to_token_pool, args.program_pin_timeout_s
        )
        self.disk: KVDiskTier | None = None
        if args.kv_disk_path is not None:
            spec = disk_tier_spec(args, self.runner.quantization, self.replica)
            tp = self.runner.tp if args.tp_size > 1 else None
            self.disk = spec.open(self.runner.kv_pool, self.runner.device.type, tp)
            if isinstance(self.runner, TensorParallelRunner):
                self.runner.run_on_workers("open", spec)  # each rank its own shard's tier
                self.disk.followers = self.runner.run_on_workers
            self.kv.attach_disk_tier(self.disk)
        # What observers (/cache_tree, the dashboard) see: snapshots and recent activity.
        self.cache_view = CacheView(tree)
        self.activity = ActivityLog()
        # The configuration as it runs, which server_info reports: what the model and the
        # memory left decided besides the device defaults.
        self.args = dataclasses.replace(
            args, context_length=self.context_len, max_total_tokens=self.kv.capacity
        )
        self.ratio = NewTokenRatio(args.schedule_conservativeness)
        self.policy = make_policy(args.schedule_policy, args.lpm_max_queue)
        self.admission = PrefillAdmission(args, self.runner.device.type, self.kv, self.ratio)
        self.decodes = DecodeManager(self.kv, self.ratio, not args.disable_program_scheduling)
        self.programs = ProgramAdmission(self.kv, self.ratio, not args.disable_program_scheduling)
        # The model's end tokens, and the turn end of a built-in --chat-template.
        eos_ids = tuple(dict.fromkeys(
            config.eos_token_ids + template_stop_ids(self.tokenizer, args.chat_template)
        ))  # fmt: skip
        with self.startup.phase("grammar backend"):  # the tokenizer's vocabulary, indexed
            self.grammar = GrammarManager(args, self.tokenizer, config.vocab_size, eos_ids)
        self.sampler = Sampler(
            config.vocab_size,
            eos_ids,
            grammar_mask=self.grammar.apply_masks,
            grammar_accept=self.grammar.backend.accept_tokens,
            dry_breakers=tokenizer_breakers(self.tokenizer, config.vocab_size),
        )
        self.outputs = OutputProcessor(StopChecker(self.tokenizer, eos_ids), args.stream_interval)
        speculation, draft_worker = _speculation(args, self.runner)
        self.drafts = DraftManager(
            DraftVerifier(self.sampler),
            tree,
            jump_forward=not args.disable_jump_forward,
            speculation=speculation,
            draft_worker=draft_worker,
            device_type=self.runner.device.type,
        )
        self.kv.release_hooks.append(self.drafts.release)
        self.rng = random.Random(args.random_seed)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self._started = time.monotonic()
        self._stopped = False
        # Overlap: the thread forwards run on, whether one is running now, and the outputs
        # waiting to be sent while the next forward runs.
        self.overlap = not args.disable_overlap_schedule
        self._forward_thread = (
            ThreadPoolExecutor(1, "forward", _forward_thread_setup, (self.runner.device,))
            if self.overlap
            else None
        )
        self._in_forward = False
        self._pending_outputs: list[TokenOutput] = []

    # ---- the loop ------------------------------------------------------------------------

    def event_loop(self) -> None:
        """Run until ``stop()``; report a crash to the tokenizer manager before re-raising."""
        try:
            self.heartbeat.beat()
            self.to_tokenizer.send(SchedulerReady(self.server_info()))
            while not self._stopped:
                idle = not self.waiting and not self.running
                # Bounded even when idle: the heartbeat must beat while nothing runs.
                wait = 0.002 if self.grammar.queue else 0.05
                for message in drain(self.inbox, timeout=wait if idle else 0):
                    self.handle(message)
                self.step()
                self.heartbeat.beat()
        except Exception as exc:
            logger.exception("scheduler crashed")
            self.to_tokenizer.send(SchedulerFailed(f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            self._flush_outputs()
            if self._forward_thread is not None:
                self._forward_thread.shutdown(wait=True)
            self._close_disk_tier()
            self.grammar.shutdown()
            self.runner.shutdown()

    def _close_disk_tier(self) -> None:
        """On a graceful stop, hand the disk tier what the tree still holds, then wait for the
        writes and release its folder (after a crash only the latter: the pool may be
        inconsistent)."""
        if self.disk is None:
            return
        try:
            if self._stopped and self.kv.tree is not None:
                self.disk.save_tree(self.kv.tree)
        except Exception:
            logger.exception("saving the cache to the disk tier failed")
        finally:
            self.disk.close()

    def stop(self) -> None:
        self._stopped = True

    def step(self) -> None:
        """One iteration: allocate decodes, admit prefill, run the forward, process results."""
        self.cache_view.note_clock()
        self.programs.on_step()
        if self.grammar.queue:
            compiled, failed_compiles = self.grammar.poll()
            for req in compiled:
                req.status = Status.WAITING
            self.waiting.extend(compiled)
            self._emit(failed_compiles)
        if not self.waiting and not self.running:
            return
        decodes, retracted, failed = self.decodes.allocate(self.running)
        for req in retracted + failed:
            self.running.remove(req)
        self.waiting.extend(retracted)
        ordered = self.programs.order(self.policy.order(self.waiting, self.kv))
        ordered = with_starved_first(ordered, self.args.starvation_timeout_s)
        prefill, admitted = self.admission.schedule(self.running, ordered)
        for req in admitted:
            self.waiting.remove(req)
            self.running.append(req)
            if req.status is Status.WAITING:  # its first admission
                req.admitted_at = time.monotonic()
                self.stats.prompt_tokens += len(req.input_ids)
                self.stats.cached_tokens += req.kv.cached_tokens
                if self.kv.tree is not None:
                    self.stats.prefix_cache_queries_tokens += len(req.input_ids)
                    self.stats.prefix_cache_hits_tokens += req.kv.cached_tokens
            req.status = Status.RUNNING
        self.programs.make_room(self.waiting, self.running)
        if prefill or decodes:
            self.activity.record_step(
                prefill, decodes, len(retracted), len(self.running), len(self.waiting)
            )
            self._run(StepBatch.from_parts(prefill, decodes))
        else:
            self._flush_outputs()  # no forward to send them behind
            # Nothing ran: pinned programs' KV may hold the pool (when nothing runs).
            self.programs.make_room(self.waiting, self.running, stuck=True)
            if len(self.running) > 1:
                # Nothing could run: partial prefills hold the memory each other needs.
                # Admission budgets make this unlikely; if it happens, free the cheapest one.
                victim = self.decodes.retract_cheapest(self.running)
                self.running.remove(victim)
                self.waiting.append(victim)
        self._finish_and_emit(failed)
        if not self.running:  # no forward follows to send the outputs behind
            self._flush_outputs()
        self.ratio.step()
        if self.args.debug_invariants:
            self.kv.check_invariants(self.running)
            self.drafts.check_invariants()
            self._check_statuses()

    def _check_statuses(self) -> None:
        """Raise unless every queued request has its queue's status (after a step)."""
        queues = [
            (self.grammar.queue, (Status.CONSTRAINING,)),
            (self.waiting, (Status.WAITING, Status.RETRACTED)),
            (self.running, (Status.RUNNING,)),
        ]
        for queue, statuses in queues:
            for req in queue:
                if req.status not in statuses:
                    raise AssertionError(f"{req} is queued with {[s.value for s in statuses]}")

    def _run(self, step: StepBatch) -> None:
        batch = step.to_forward_batch(self.runner)
        draft_masks: dict[int, torch.Tensor | Exception | None] = {}
        # Decode forwards (drafts included) time what a draft row costs; prefill chunks not.
        decode_rows = None
        if self.drafts.speculation is not None:
            if all(n == 1 or req.draft.tokens for req, n in step.work):
                decode_rows = step.num_tokens
        started = time.perf_counter()
        if self._forward_thread is None:
            logits = self._timed_forward(batch, decode_rows)
        else:
            forward = self._forward_thread.submit(self._timed_forward, batch, decode_rows)
            self._in_forward = True
            try:
                self._while_forward(step, draft_masks)
            finally:
                self._in_forward = False
                logits = forward.result()
        self.heartbeat.observe_step(time.perf_counter() - started)
        if self.disk is not None and step.num_tokens > 2 * len(step.work):  # mostly prefill
            self.disk.cost.observe_prefill(time.perf_counter() - started, step.num_tokens)
        # Slots lent between requests of this step are computed now: the tree takes them
        # before sampling can finish (and release) a lender.
        self.kv.settle_loans()
        sampled = self._sample(logits, step.sample_rows, step.sample_reqs)
        self.outputs.process(step, logits, sampled)
        for draft in step.drafts:
            self._verify(draft.req, logits[draft.row : draft.row + draft.req.step_len], draft_masks)
        self.stats.forward_steps += 1
        self.stats.generated_tokens += len(step.sample_reqs)
        self.stats.emit_steps += len(step.sample_reqs)
        drafted = {id(d.req) for d in step.drafts}
        for req, n in step.work:
            # Prefill progress goes into the tree now, so requests sharing it can reuse it.
            if n > 1 and id(req) not in drafted and not req.finished:
                self.kv.cache_prefix(req)
        self.drafts.propose([req for req, _ in step.work])

    def _verify(
        self, req: Req, rows: torch.Tensor, masks: dict[int, torch.Tensor | Exception | None]
    ) -> None:
        """Keep what the model agrees with of ``req``'s draft (``rows``: its positions'
        logits), drop the KV of the rest, and emit the kept tokens."""
        source, proposed = req.draft.source, len(req.draft.tokens)
        try:
            mask = masks[id(req)] if id(req) in masks else self.drafts.verifier.mask(req)
            verified = self.drafts.verify(req, rows, mask)
        except Exception as exc:
            req.draft.clear()
            req.fail_from(exc, "verifying the draft of")
            return
        if verified is None:
            return
        kept = len(verified.tokens)
        self.kv.truncate(req, req.kv.kv_len - (proposed + 1 - kept))
        self._count_draft(source, proposed, kept - 1, kept)
        constrained = req.constraint.matcher is not None  # it stands past the tokens already
        self.outputs.emit_tokens(req, verified.tokens, verified.logprobs, constrained)

    def _timed_forward(self, batch: ForwardBatch, tokens: int | None) -> torch.Tensor:
        """The forward; a speculating server's decode forward (``tokens``: its rows; None:
        not timed) feeds its time to the drafts' cost model (on CUDA timing waits for
        kernels)."""
        if tokens is None:
            return self.runner.forward(batch)
        started = time.perf_counter()
        logits = self.runner.forward(batch)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        self.drafts.cost.observe_forward(time.perf_counter() - started, tokens)
        return logits

    def _while_forward(
        self, step: StepBatch, draft_masks: dict[int, torch.Tensor | Exception | None]
    ) -> None:
        """The step's work that does not need its logits, done while the forward runs."""
        self._flush_outputs()
        try:
            self.grammar.prepare_masks(step.sample_reqs, self.runner.device)
        except Exception:  # sampling fills them again and fails the row that raises
            logger.exception("filling the grammar masks ahead failed")
        for draft in step.drafts:
            draft_masks[id(draft.req)] = self.drafts.verifier.mask(draft.req)
        for message in drain(self.inbox, timeout=0):
            self.handle(message)

    def _count_draft(self, source: str, proposed: int, accepted: int, emitted: int) -> None:
        self.stats.generated_tokens += emitted
        self.stats.emit_steps += 1
        if source == JUMP:
            self.stats.draft_tokens_proposed += proposed
            self.stats.draft_tokens_accepted += accepted
        else:
            self.stats.spec_draft_tokens += proposed
            self.stats.spec_accepted_tokens += accepted
            self.stats.spec_verify_steps += 1

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list[Req]) -> SampleOutput:
        """The tokens of ``reqs`` from their ``rows`` of the forward's logits; if sampling the
        batch raises, each row is sampled alone so the request that caused it fails (its row
        reported in ``failures``) and the rest go on."""
        try:
            # Indexing copies the rows, so the sampler may process them in place.
            return self.sampler.sample(take_rows(logits, rows), reqs, in_place=True)
        except Exception:
            logger.warning("sampling the batch failed; sampling its rows one by one")
        logits = take_rows(logits, rows)
        tokens: list[int] = []
        logprobs: list[Any] = []
        failures: dict[int, tuple[int, str]] = {}
        accepted: list[bool] = []
        for row, req in enumerate(reqs):
            try:
                one = self.sampler.sample(logits[row : row + 1], [req])
            except Exception as exc:
                req.fail_from(exc, "sampling")
                reason = req.finished_reason
                status = reason.status_code if reason and reason.status_code else 500
                failures[row] = (status, reason.message or "" if reason else "")
                tokens.append(0)
                logprobs.append(None)
                accepted.append(False)
                continue
            tokens += one.token_ids
            logprobs += one.logprobs
            accepted += one.grammar_accepted
            if one.failures:
                failures[row] = one.failures[0]
        return SampleOutput(tokens, logprobs, failures, accepted)

    def _finish_and_emit(self, failed: list[Req]) -> None:
        done = [r for r in self.running if r.finished]
        outputs = self.outputs.outputs_for(self.running + failed)
        for req in failed:
            self.activity.record_finished(req)
        for req in done:
            self.activity.record_finished(req)
            self.running.remove(req)
            aborted = req.aborted
            self.kv.release(req, keep_in_cache=not (req.failed or aborted), finished=True)
            if not aborted:
                self.stats.requests_finished += 1
        if not outputs:
            return
        if self.overlap:  # sent while the next forward runs, or at the end of an idle step
            self._pending_outputs += outputs
        else:
            self.to_detokenizer.send(TokenOutputBatch(outputs))

    def _flush_outputs(self) -> None:
        if self._pending_outputs:
            outputs, self._pending_outputs = self._pending_outputs, []
            self.to_detokenizer.send(TokenOutputBatch(outputs))

    def _emit(self, finished: list[Req]) -> None:
        """Send the final outputs of requests that finished outside a step."""
        if finished:
            for req in finished:
                self.activity.record_finished(req)
            self._flush_outputs()  # keep each request's outputs in order
            self.to_detokenizer.send(TokenOutputBatch(self.outputs.outputs_for(finished)))

    # ---- incoming messages ------------------------------------------------------------------

    def handle(self, message: Any) -> None:
        if isinstance(message, GenerateRequest):
            self._add_request(message)
        elif isinstance(message, AbortRequest):
            self._abort(message.rid)
        elif isinstance(message, ProgramRelease):
            self.kv.pins.release(message.program, message.branches)
        elif isinstance(message, PinPrefix):
            try:  # a hint: one that cannot be kept is dropped, never the scheduler's loop
                self.kv.pin_prefix(message)
            except Exception:
                logger.exception("pinning a tool-wait prefix failed; not pinned")
        elif isinstance(message, ControlRequest):
            try:
                reply = self._control(message)
            except Exception as exc:
                logger.exception("control command %r failed", message.command)
                reply = {"error": f"{message.command} failed: {type(exc).__name__}"}
            self.to_tokenizer.send(ControlReply(message.request_id, reply))
        else:
            logger.error("scheduler got an unknown message %r", type(message).__name__)

    def _add_request(self, msg: GenerateRequest) -> None:
        """Queue a new request, or fail it alone (400 for bad input, 500 for our bugs)."""
        params = msg.sampling_params
        seed = params.seed if params.seed is not None else self.rng.randrange(1 << 62)
        try:
            self._validate(msg)
            room = self.context_len - len(msg.input_ids)
            if params.max_new_tokens > room:
                msg.sampling_params = dataclasses.replace(params, max_new_tokens=room)
            req = Req(msg, seed, self.drafts.speculates(msg.sampling_params))
            if self.disk is not None:
                self.kv.read_ahead(req)
            if needs_preparing(req.sampling):
                req.status = Status.CONSTRAINING
                self.grammar.enqueue(req)
            else:
                self.waiting.append(req)
        except Exception as exc:
            failed = Req(msg, seed)
            failed.fail_from(exc, "admitting")
            self._emit([failed])

    def _validate(self, msg: GenerateRequest) -> None:
        ids = msg.input_ids
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_len}"
            )
        if len(ids) + 1 > self.kv.capacity:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the KV pool holds {self.kv.capacity}"
            )
        vocab = self.runner.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab})")
        msg.sampling_params.validate(vocab)
        if msg.return_logprob and msg.logprob_start_len >= len(ids):
            raise ValueError(f"logprob_start_len must be < the prompt length {len(ids)}")

    def _abort(self, rid: str) -> None:
        reason = FinishReason.aborted()
        queued = self.grammar.remove(rid)
        if queued is not None:
            queued.finish(reason)
            self._emit([queued])
            return
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish(reason)
                self._emit([req])
                return
        for req in self.running:
            if req.rid == rid:
                if self._in_forward:
                    # The forward reads its KV now: finish it, and let the step's end release
                    # it and send its output (its token from this step is dropped).
                    req.finish(reason)
                    return
                self.running.remove(req)
                req.finish(reason)
                self.kv.release(req, keep_in_cache=False)
                self._emit([req])
                return

    def _control(self, message: ControlRequest) -> dict[str, Any]:
        handler = _CONTROLS.get(message.command)
        if handler is None:
            return {"error": f"unknown command {message.command!r}"}
        return handler(self, message.args)

    def _flush_cache(self, args: dict[str, Any]) -> dict[str, Any]:
        """Drop the cache in memory, and with ``disk`` the disk tier's chunks too."""
        success = not self.running and self.kv.flush() and self.drafts.flush()
        if success and args.get("disk") and self.disk is not None:
            self.disk.clear()
        return {"success": success}

    def _cache_tree(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.cache_view.snapshot(int(args["max_nodes"]), self.activity.requests())

    def _dashboard(self, args: dict[str, Any]) -> dict[str, Any]:
        tree = self._cache_tree(args)
        return {
            "server_info": self.server_info(),
            "cache_tree": tree,
            "steps": self.activity.steps(),
        }

    def _node_prefix(self, args: dict[str, Any]) -> dict[str, Any]:
        prefix = self.cache_view.prefix(int(args["node"]))
        if isinstance(prefix, str):
            return {"missing": prefix}
        return {"token_ids": prefix[0], "node_tokens": prefix[1]}

    def _check_invariants(self, args: dict[str, Any]) -> dict[str, Any]:
        try:
            self.kv.check_invariants(self.running)
            self.drafts.check_invariants()
        except AssertionError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": True}

    def _window_info(self) -> dict[str, int]:
        hybrid = self.kv.hybrid
        if hybrid is None:
            return {"kv_window_slots": 0, "kv_window_free_tokens": 0, "kv_window_peak_tokens": 0}
        return {
            "kv_window_slots": hybrid.window_capacity,
            "kv_window_free_tokens": hybrid.window_available(),
            "kv_window_peak_tokens": hybrid.window_peak,
        }

    def _tenant_info(self) -> dict[str, dict[str, int]]:
        """The radix cache's cached and evicted tokens by tenant label, with tenants (the
        default tenant of requests without one left out); empty without."""
        stats = self.kv.tree.stats() if self.kv.tree is not None else None
        if stats is None or self.args.api_keys_file is None:
            return {}
        return {
            "tenant_kv_cached_tokens": {
                t: n for t, n in stats.tenant_tokens.items() if isinstance(t, str)
            },
            "tenant_kv_evicted_tokens": {
                t: n for t, n in stats.tenant_evicted_tokens.items() if isinstance(t, str)
            },
        }

    def server_info(self) -> dict[str, Any]:
        tree = self.kv.tree
        private = self.kv.private_slots(self.running).numel()
        protected = tree.protected_size() if tree else 0
        elapsed = max(time.monotonic() - self._started, 1e-9)
        prompt = self.stats.prompt_tokens
        return {
            **self.args.reported(),
            "vocab_size": self.runner.config.vocab_size,
            "tp_worker_pids": self.runner.worker_pids,
            "kv_used_tokens": protected + private,
            "kv_cached_tokens": tree.total_size() if tree else 0,
            "kv_free_tokens": self.kv.allocator.available(),
            # Cached tokens pinned by cache hints (docs/radix_cache.md, "Pins"), and the pins.
            "kv_pinned_tokens": tree.pinned_size() if tree else 0,
            "num_kv_pins": tree.stats().pins if tree else 0,
            # By tenant label (runtime.api_keys.salt_tenant): cached and evicted tokens.
            **self._tenant_info(),
            "kv_usage": (protected + private) / self.kv.capacity,
            # The pool's K/V bytes over its full slots (less than a token's K/V in every layer
            # with window KV memory), and that memory's window pool (0 slots: none).
            "kv_bytes_per_token": self.runner.kv_pool.bytes / self.runner.kv_slots,
            **self._window_info(),
            # What is not free: running requests and the radix cache's slots (evictable too).
            "kv_cache_utilization": 1.0 - self.kv.allocator.available() / self.kv.capacity,
            "cache_hit_rate": self.stats.cached_tokens / prompt if prompt else 0.0,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_grammar_queue_reqs": len(self.grammar.queue),
            "num_retracted_reqs": self.decodes.num_retracted,
            "num_pinned_programs": self.kv.pins.num_programs,
            "num_program_pins": self.kv.pins.num_pins,
            "num_program_pins_shed": self.programs.pins_shed + self.decodes.num_pins_shed,
            "program_pins_shed": self.programs.pins_shed,
            "new_token_ratio": self.ratio.value,
            "gen_throughput": self.stats.generated_tokens / elapsed,
            # Mean tokens a request gets from one forward (1.0 without drafts).
            "spec_accept_len": self.stats.generated_tokens / max(self.stats.emit_steps, 1),
            # Objects this process froze out of the garbage collector's passes (runtime/heap.py).
            "gc_frozen_objects": frozen_objects(),
            "startup_phases": self.startup.to_list(),
            "grammar_compile_seconds": self.grammar.compile_seconds.to_dict(),
            **dataclasses.asdict(self.stats),
            **self.drafts.info(),
            **(self.disk.info() if self.disk is not None else NO_TIER_INFO),
        }


# The scheduler's answer to each ControlCommand, given the request's args.
_CONTROLS: dict[ControlCommand, Callable[[Scheduler, dict[str, Any]], dict[str, Any]]] = {
    ControlCommand.FLUSH_CACHE: Scheduler._flush_cache,
    ControlCommand.SERVER_INFO: lambda scheduler, _: scheduler.server_info(),
    ControlCommand.CHECK_INVARIANTS: Scheduler._check_invariants,
    ControlCommand.CACHE_TREE: Scheduler._cache_tree,
    ControlCommand.DASHBOARD: Scheduler._dashboard,
    ControlCommand.NODE_PREFIX: Scheduler._node_prefix,
}


def _forward_thread_setup(device: torch.device) -> None:
    """The forward thread works on the scheduler's device (CUDA's current device is per
    thread; triton launches on it) with autograd off (also per thread)."""
    if device.type == "cuda":
        # set_device needs an index: a bare "cuda" means the device current where the
        # runner was made, which is the process default (0) in a thread that never set one.
        torch.cuda.set_device(device if device.index is not None else 0)
    torch.set_grad_enabled(False)


def _speculation(args: ServerArgs, runner: ModelRunner) -> tuple[SpeculationConfig | None, Any]:
    """The speculative decoding ``args`` ask for, and the draft model's worker if any."""
    if args.speculative_algorithm is None:
        return None, None
    config = SpeculationConfig(
        args.speculative_algorithm,
        args.speculative_num_draft_tokens,
        args.speculative_policy == "adaptive",
        args.speculative_ngram_min_match,
        args.speculative_ngram_max_match,
    )
    if args.speculative_algorithm != "draft":
        return config, None
    from runtime.speculative.draft_worker import DraftModelWorker

    assert args.speculative_draft_model_path is not None
    draft = RunnerConfig(
        args.speculative_draft_model_path,
        dtype=args.dtype,
        device=str(runner.device),
        kv_slots=runner.kv_slots,  # as many tokens as the target's pool: fewer layers' worth
        max_requests=args.max_running_requests,
        context_len=runner.context_len,
        deterministic=args.deterministic,  # the mode is the process's: keep the target's
    )
    worker = DraftModelWorker(draft)
    if worker.vocab_size > runner.config.vocab_size + 1024:  # padding aside, not the same
        raise ValueError(
            f"the draft model's vocabulary ({worker.vocab_size}) is not the target's "
            f"({runner.config.vocab_size}); speculation needs the same tokenizer"
        )
    return config, worker


def slot_allocator(runner: ModelRunner, page_size: int) -> KVSlotAllocator:
    """The KV slot allocator of ``runner``'s pool: with window KV memory, one that also hands
    out the window layers' slots (radix_cache/swa.py), their map shared with the pool."""
    if not runner.window:
        return KVSlotAllocator(runner.kv_slots, page_size)
    allocator = HybridSlotAllocator(runner.kv_slots, runner.window_slots, runner.window, page_size)
    runner.kv_pool.attach_window_map(allocator.window_page_map, page_size)
    return allocator
