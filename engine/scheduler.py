"""Scheduler: token budget, chunked prefill, continuous batching, preemption, finishing; schedule() /
update_from_output().

One loop, no prefill/decode phases (vLLM v1's idea): each step every request is granted
``min(num_tokens - num_computed_tokens, budget)`` tokens. Running requests go first (one-token decodes, then
prefill chunks), then waiting requests join in (priority, arrival) order while the budget and seats last.

Protocol, per step:  out = schedule();  run the model on out;  finished = update_from_output(out, new_tokens).
Call update_from_output for every output, even an empty one: it also returns the requests that schedule()
finished with FINISHED_ERROR. Every request ends here (``Request.finish``): length, EOS, stop ids, stop strings
(the request's detokenizer sees each output token as it is appended), errors and aborts.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledRequest, SchedulerOutput


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rank(req: Request) -> tuple[int, float]:
    """Lower runs first; the largest rank is preempted first."""
    return req.priority, req.arrival_time


@dataclass
class _Step:
    """One schedule() call as it goes: the token budget left, the grants so far and who was preempted."""
    budget: int
    now: float
    granted: dict[str, ScheduledRequest] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Decides, each step, which requests compute which tokens.

    Invariants:
        * ``requests`` holds exactly the unfinished requests; each is in ``running`` or the waiting heap.
        * a running request holds KV blocks for its ``num_computed_tokens`` (advanced at schedule time).
        * a waiting request holds no blocks (a preempted one has num_computed_tokens = 0, outputs kept).
    """

    def __init__(self, engine_config: EngineConfig, num_blocks: int, max_model_len: int,
                 speculator=None) -> None:
        self.config = engine_config
        self.block_size = engine_config.block_size
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, engine_config.block_size,
                                               engine_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[int, float, int, Request]] = []   # heap; aborted entries skipped lazily
        self._num_waiting = 0
        self._seq = itertools.count()
        self._new_errors: list[Request] = []    # finished with error, not yet listed in a SchedulerOutput
        self._step_errors: list[Request] = []   # listed in the last output, returned by update_from_output
        self._stats: dict[str, int] = {}
        self.speculator = speculator            # engine.spec_decode.speculator.Speculator, or None

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request. One that can never fit is finished at once with FINISHED_ERROR and reported by
        the next schedule() / update_from_output()."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        error = req.error or self._never_fits(req)     # req.error: e.g. a grammar that does not compile
        if error is not None:
            req.error = error
            req.finish(RequestStatus.FINISHED_ERROR)
            self._new_errors.append(req)
            return
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def _never_fits(self, req: Request) -> str | None:
        n = req.num_prompt_tokens
        if n == 0:
            return f"request {req.request_id}: empty prompt"
        if n > self.max_model_len:
            return (f"request {req.request_id}: prompt has {n} tokens, more than max_model_len="
                    f"{self.max_model_len}")
        need = _cdiv(n + 1, self.block_size)
        if need > self.num_blocks:
            return (f"request {req.request_id}: prompt of {n} tokens needs {need} KV blocks of "
                    f"{self.block_size} tokens but the pool has only {self.num_blocks}; "
                    f"give the KV cache more memory or shorten the prompt")
        return None

    def abort_request(self, req_id: str) -> Request | None:
        """Finish a request with FINISHED_ABORTED and free its blocks (no-op for unknown / finished ids). Returns it."""
        req = self.requests.get(req_id)
        if req is not None:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def _finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        if req.status == RequestStatus.RUNNING:
            self._remove_running(req)
            self.kv_cache_manager.free(req)
        else:
            self._num_waiting -= 1      # its heap entry is skipped lazily
        req.finish(status, stop_reason)
        del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._new_errors or self._step_errors)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def pin_prefix(self, token_ids: list[int]) -> int | None:
        return self.kv_cache_manager.pin_prefix(token_ids)

    def unpin(self, pin_id: int) -> None:
        self.kv_cache_manager.unpin(pin_id)

    def _push_waiting(self, req: Request) -> None:
        heapq.heappush(self._waiting, (req.priority, req.arrival_time, next(self._seq), req))
        self._num_waiting += 1

    def _peek_waiting(self) -> Request | None:
        while self._waiting:
            req = self._waiting[0][3]
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                return req
            heapq.heappop(self._waiting)    # finished while waiting
        return None

    def _pop_waiting(self) -> Request:
        self._num_waiting -= 1
        return heapq.heappop(self._waiting)[3]

    # ---- schedule -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Grant tokens for one step.

        Returns:
            the requests to compute, each with its token ids, start position and whole block table.
        Side effects: num_computed_tokens advanced by the granted count; preempted requests back in waiting.
        """
        step = _Step(budget=self.max_num_batched_tokens, now=time.monotonic())
        self._schedule_running(step)
        if not step.preempted:          # waiting requests never join after a preemption: the pool is full
            self._schedule_waiting(step)
        return self._make_output(step)

    def _schedule_running(self, step: _Step) -> None:
        """Running requests: one-token decodes first (with their drafts when speculating), then prefill chunks.
        A request whose blocks do not fit preempts the lowest-ranked running one, itself included."""
        kv = self.kv_cache_manager
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        chunks = [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        # Speculation: a decoding request may also compute draft tokens (never during a chunked prefill).
        drafts = self.speculator.drafts(decodes, step.budget) if self.speculator is not None and decodes else {}
        for req in decodes + chunks:
            if step.budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue                    # preempted earlier in this step
            draft = drafts.get(req.request_id, [])[:max(step.budget - 1, 0)]
            num_new = min(req.num_tokens - req.num_computed_tokens, step.budget) + len(draft)
            allocated = bool(draft) and kv.allocate_slots(req, num_new) is not None
            if draft and not allocated:
                num_new -= len(draft)           # drafts never cost a preemption: drop them when the pool is full
                draft = []
            if not allocated:
                self._allocate_or_preempt(req, num_new, step)
            if req.status != RequestStatus.RUNNING:
                if req.status == RequestStatus.PREEMPTED:
                    break                   # lowest priority itself: stop scheduling running ones
                continue
            step.granted[req.request_id] = self._grant(req, num_new, step.now, draft)
            step.budget -= num_new

    def _allocate_or_preempt(self, req: Request, num_new: int, step: _Step) -> None:
        """Allocate ``num_new`` slots for ``req``, preempting the lowest-ranked running request until they fit
        (a victim granted earlier in this step gives its tokens back). Ends with ``req`` preempted itself, or
        finished with an error when nothing is left to preempt."""
        while self.kv_cache_manager.allocate_slots(req, num_new) is None:
            if len(self.running) == 1:
                # NOTE: nothing left to preempt; only pinned blocks can be in the way. Never spin.
                self._finish_stuck(req)
                return
            victim = max(self.running, key=_rank)
            undone = step.granted.pop(victim.request_id, None)
            if undone is not None:
                step.budget += undone.num_tokens
                victim.num_computed_tokens = undone.start_pos   # its chunk will not run
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is req:
                return

    def _schedule_waiting(self, step: _Step) -> None:
        """Waiting requests join in (priority, arrival) order while the budget, the seats and the pool last;
        a prefix-cache hit starts a request past its cached tokens."""
        kv = self.kv_cache_manager
        while step.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._peek_waiting()
            if req is None:
                break
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, step.budget)
            if kv.allocate_slots(req, num_new, hit_blocks) is None:
                if not self.running:
                    self._finish_stuck(req)     # its heap entry is skipped lazily
                    continue
                break
            self._pop_waiting()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens is None:       # first scheduling (a preempted request keeps its count)
                req.num_cached_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = step.now
            step.granted[req.request_id] = self._grant(req, num_new, step.now)
            step.budget -= num_new

    def _make_output(self, step: _Step) -> SchedulerOutput:
        """The step's SchedulerOutput: what was granted, who was preempted, and the errors not yet reported."""
        out = SchedulerOutput(scheduled=list(step.granted.values()),
                              preempted=[r.request_id for r in step.preempted])
        for sr in out.scheduled:
            if sr.is_prefill:
                out.num_prefill_tokens += sr.num_tokens
            else:
                out.num_decode_tokens += sr.num_tokens
        self._step_errors, self._new_errors = self._step_errors + self._new_errors, []
        out.finished_errors = [r.request_id for r in self._step_errors]
        self._record_stats(out)
        return out

    def _grant(self, req: Request, num_new: int, now: float, draft: list[int] = ()) -> ScheduledRequest:
        """``num_new`` includes the drafts (their KV slots are allocated like any token's; after verification
        ``num_computed_tokens`` steps back over the rejected ones, whose slots are overwritten later)."""
        start = req.num_computed_tokens
        if req.prefill_start_time is None:
            req.prefill_start_time = now
        req.num_computed_tokens = start + num_new
        real = num_new - len(draft)
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:start + real] + list(draft),
            start_pos=start,
            block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
            sample=start + real == req.num_tokens,
            is_prefill=start < req.num_prompt_tokens or real > 1,
            draft_token_ids=list(draft),
        )

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks and send it back to waiting; it recomputes prompt + outputs later."""
        self._remove_running(req)
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._push_waiting(req)

    def _remove_running(self, req: Request) -> None:
        # NOTE: by identity; Request is a dataclass, so list.remove would compare all fields.
        for i, r in enumerate(self.running):
            if r is req:
                del self.running[i]
                return

    def _finish_stuck(self, req: Request) -> None:
        """The request cannot get blocks even with nothing else running (pins hold the rest): error, never spin."""
        kv = self.kv_cache_manager
        pinned = kv.num_pinned_blocks()
        req.error = (f"request {req.request_id}: cannot get KV blocks for {req.num_tokens} tokens with nothing "
                     f"else running ({pinned} of {kv.num_blocks} blocks pinned by prefix pins)")
        self._finish(req, RequestStatus.FINISHED_ERROR)
        self._new_errors.append(req)

    # ---- update -------------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, new_tokens: dict[str, int | list[int]],
                           forced: dict[str, list[int]] | None = None) -> list[Request]:
        """Append the sampled tokens and finish the requests that stop (nano-vllm's postprocess).

        Args:
            scheduler_output: the output of the last schedule().
            new_tokens: request id -> token id (or, for a request that speculated, the verified tokens: the
                accepted drafts and one more), for every scheduled request with ``sample=True``. Tokens are
                appended one by one; stop strings, EOS, stop ids and the length limits are checked after each
                (``_check_stop``), so nothing after a stop is appended.
            forced: request id -> tokens a grammar forces after the sampled ones (structured outputs): appended
                the same way, uncomputed, so the next step computes them as one prefill chunk.
        Returns:
            the requests finished by this step (including the errors listed in ``finished_errors``).
        """
        now = time.monotonic()
        finished = self._step_errors
        self._step_errors = []
        num_emitted = num_accepted = 0                # this step's, over all requests
        for sr in scheduler_output.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue                    # aborted while the step ran
            if req.prefill_end_time is None and req.num_computed_tokens >= req.num_prompt_tokens:
                req.prefill_end_time = now
            if not sr.sample:
                continue
            if sr.request_id not in new_tokens:
                raise KeyError(f"no sampled token for request {sr.request_id!r} (sample=True)")
            if req.error is not None:           # e.g. its grammar failed mid-way: this request only
                self._finish(req, RequestStatus.FINISHED_ERROR)
                finished.append(req)
                continue
            toks = new_tokens[sr.request_id]
            toks = [toks] if isinstance(toks, int) else list(toks)
            if sr.draft_token_ids:
                accepted = len(toks) - 1
                req.num_draft_tokens += len(sr.draft_token_ids)
                req.num_accepted_tokens += accepted
                req.num_spec_steps += 1
                if self.speculator is not None:
                    self.speculator.record(len(sr.draft_token_ids), accepted)
                # KV is valid for the last known token and the accepted drafts; rejected slots get rewritten
                req.num_computed_tokens = sr.start_pos + 1 + accepted
            elif self.speculator is not None:
                self.speculator.observe(sr.request_id, toks[0])
            stop = None
            run = toks + list((forced or {}).get(sr.request_id, ()))
            for j, t in enumerate(run):
                req.append_output_token(int(t), now)
                req.num_forced_tokens += j >= len(toks)
                num_emitted += 1
                num_accepted += bool(sr.draft_token_ids) and j < len(toks) - 1
                stop = self._check_stop(req)
                if stop is not None:
                    if (stop[0] == RequestStatus.FINISHED_LENGTH and req.grammar is not None and j + 1 < len(run)
                            and run[j + 1] in req.eos_token_ids):
                        stop = (RequestStatus.FINISHED_STOPPED, None)    # the grammar ended right at the limit
                    break
            if stop is not None:
                self._finish(req, *stop)
                finished.append(req)
        self._stats.update(num_emitted_tokens=num_emitted, num_accepted_tokens=num_accepted)
        return finished

    def _check_stop(self, req: Request) -> tuple[RequestStatus, int | str | None] | None:
        """Whether the output token just appended ends ``req``: (finished status, stop reason), else None.

        The detokenizer sees every output token; a stop string it completes wins over what else the token ends."""
        params = req.sampling_params
        token = req.output_token_ids[-1]
        if req.detokenizer is not None and req.detokenizer.append(token):
            return RequestStatus.FINISHED_STOPPED, req.detokenizer.stop_reason
        if req.grammar is not None and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None   # a grammar allows EOS only where it accepts: it ends there
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        if req.num_tokens > self.num_blocks * self.block_size:
            return RequestStatus.FINISHED_LENGTH, None    # the next step could not hold its KV in the whole pool
        return None

    # ---- stats --------------------------------------------------------------------------------------
    def _record_stats(self, out: SchedulerOutput) -> None:
        kv = self.kv_cache_manager
        queries, hits = kv.take_prefix_cache_stats()
        self._stats = {
            "num_prefill_tokens": out.num_prefill_tokens,
            "num_decode_tokens": out.num_decode_tokens,
            "num_prefill_seqs": sum(1 for s in out.scheduled if s.is_prefill),
            "num_decode_seqs": sum(1 for s in out.scheduled if not s.is_prefill),
            "num_running": len(self.running),
            "num_waiting": self._num_waiting,
            "kv_blocks_used": kv.num_used_blocks,
            "kv_blocks_total": kv.num_blocks,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "num_preemptions": len(out.preempted),
            "num_sampled": sum(1 + len(s.draft_token_ids) for s in out.scheduled if s.sample),
            "num_draft_tokens": sum(len(s.draft_token_ids) for s in out.scheduled),
            "num_accepted_tokens": 0,       # known after the step: update_from_output
            "num_emitted_tokens": 0,
        }

    def last_step_stats(self) -> dict[str, int]:
        """Counters of the last step, keyed like engine.outputs.StepStats fields: what schedule() granted, and
        after update_from_output the tokens it emitted and the drafts among them that were accepted."""
        return self._stats
