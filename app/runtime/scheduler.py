"""The engine thread: owns the llama_context and runs one batched step at a time over all slots.

Each step is schedule -> execute -> update:
  1. take new requests and cancellations, give waiting requests idle slots (longest common prefix first);
  2. build ONE batch: every generating slot's pending token first (so inter-token latency stays flat), then
     prompt chunks, oldest request first, until n_batch tokens are used (the prefill rule: first come, first
     served, each step's prompt work bounded by n_batch);
  3. decode (the GIL is released), sample every output (on the device where the request allows it), and hand
     the new token ids to the requests' handles in one call onto the event loop.
Text work (detokenizing, stop strings, JSON, SSE) happens on the event loop while the next step runs here.

Thread contract: every method whose name does not start with `submit`/`cancel`/`stop` runs on this thread only.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from app.engine import Batch, Context, DecodeError, Model, Sampler
from app.runtime.api import FinishReason, GenerationRequest, InvalidRequest, Timings
from app.runtime.memory import SlotMemory
from app.runtime.sampling import ProbReporter, build_chain, needs_host, stateless_key
from app.runtime.slots import Slot, SlotState, Task, pick_slot
from app.runtime.speculative import DraftJob, Drafter

log = logging.getLogger("app.runtime")

# Messages from this thread to a request handle (tuples keep the per-token cost low):
#   ("tokens", [token, ...], [TokenProb, ...] | None)
#   ("prompt", n_prompt_processed, n_cached, t_prompt_ms, id_slot)
#   ("embedding", [float, ...])
#   ("done", FinishReason, Timings, id_slot, stopped_eos, truncated, error_message | None)
Message = tuple


class Scheduler:
    """Slot scheduler over one context. Created and run on the engine thread."""

    def __init__(self, model: Model, ctx: Context, n_slots: int, *, device_sampling: bool,
                 cache_prompt: bool, structured: Callable[[Any], Any] | None = None,
                 greedy_chains: dict[int, Any] | None = None, memory: SlotMemory,
                 drafter: Drafter | None = None, spec: Any = None):
        self.model = model
        self.ctx = ctx
        self.vocab = model.vocab
        self.n_batch = ctx.n_batch
        n_ctx_slot = ctx.n_ctx // n_slots
        # Greedy chains the context was created with, one per slot, attached for the context's lifetime.
        # Per slot: (key, chain) of the stateless greedy chain attached to its sequence; at first the plain
        # greedy chains the context was created with.
        self.resident: dict[int, tuple[tuple, Any]] = {i: (((), False), c) for i, c in (greedy_chains or {}).items()}
        self.slots = [Slot(i, n_ctx_slot, backend=c) for i, (_, c) in self.resident.items()] or \
            [Slot(i, n_ctx_slot) for i in range(n_slots)]
        self.device_sampling = device_sampling
        self.cache_prompt = cache_prompt
        self.make_matcher = structured
        self.memory = memory
        self.batch = Batch(self.n_batch, n_seq_max=1)
        self.waiting: collections.deque[Task] = collections.deque()
        self.outbox: list[tuple[Callable, Message]] = []
        self.n_steps = 0
        self.n_tokens_decoded = 0
        self.n_prompt_cached_total = 0  # prompt tokens reused (slot prefix, prompt cache or checkpoint)
        self.t_step_total = 0.0  # seconds in steps that decoded something
        self.t_engine_total = 0.0  # of which inside llama_decode and the wait for the device
        self.n_prompt_total = 0
        self.n_gen_total = 0
        self.t_prompt_total = 0.0
        self.t_gen_total = 0.0
        # Speculative decoding (app/runtime/speculative.py): the drafter and the server's --spec-draft-* values.
        self.drafter = drafter
        self.spec = spec
        self.n_draft_total = 0
        self.n_draft_accepted_total = 0
        self.n_verify_total = 0  # steps in which a slot verified drafts

    # ---- admission ------------------------------------------------------------------------------------

    def admit(self, task: "Task | Control") -> None:
        if isinstance(task, Control):
            # Slot save/restore/erase run between steps, on this thread, with the scheduler at rest.
            try:
                self.outbox.append((task.post, ("result", task.fn(self))))
            except Exception as e:  # noqa: BLE001 - reported to the caller, the engine carries on
                self.outbox.append((task.post, ("error", e)))
            return
        self.waiting.append(task)

    def idle_slot(self, id_slot: int) -> Slot:
        """The slot for a slot action; it must exist and not be serving a request."""
        if not 0 <= id_slot < len(self.slots):
            raise InvalidRequest(f"Invalid slot ID: {id_slot} (this server has {len(self.slots)} slots)")
        slot = self.slots[id_slot]
        if not slot.idle:
            raise InvalidRequest(f"slot {id_slot} is processing a request; retry when it is idle")
        return slot

    def _drop_cancelled(self) -> None:
        if any(t.cancelled for t in self.waiting):
            self.waiting = collections.deque(t for t in self.waiting if not t.cancelled)
        for slot in self.slots:
            if slot.task is not None and slot.task.cancelled:
                self._release(slot)

    def _assign(self) -> None:
        deferred = []
        while self.waiting:
            task = self.waiting.popleft()
            use_cache = self.cache_prompt and task.req.cache_prompt
            picked = pick_slot(self.slots, task.prompt, task.req.id_slot, use_cache)
            if picked is None:
                deferred.append(task)
                if task.req.id_slot < 0:
                    break  # no idle slot at all: the rest waits too
                continue
            slot, n_keep = picked
            try:
                self._start(slot, task, n_keep)
            except Exception as e:  # noqa: BLE001 - a bad request (e.g. its schema) must not stop the engine
                slot.task = task
                self._finish(slot, FinishReason.ERROR, time.perf_counter(), error=f"invalid request: {e}")
        self.waiting.extendleft(reversed(deferred))

    def _start(self, slot: Slot, task: Task, n_keep: int) -> None:
        # At least one prompt token must be decoded to get logits for the first sampled token.
        n_keep = min(n_keep, len(task.prompt) - 1)
        if task.embedding:
            n_keep = 0
        use_cache = self.cache_prompt and task.req.cache_prompt and not task.embedding
        n_keep = self.memory.prepare(slot, task.prompt, n_keep if use_cache else 0, use_cache)
        task.n_past_prompt = task.n_cached = n_keep
        task.t_start = time.perf_counter()
        if not task.embedding:
            self._setup_sampling(slot, task)
        slot.task = task
        slot.state = SlotState.PREFILL

    def _setup_sampling(self, slot: Slot, task: Task) -> None:
        p = task.req.sampling
        on_device = self.device_sampling and not needs_host(p)
        key = stateless_key(p) if on_device else None
        if key is not None:
            # Attaching a new chain makes the engine rebuild its graph (+6 ms on the first decode here on CPU,
            # more where CUDA graphs are re-captured); stateless greedy chains stay attached and are reused.
            task.device_sampler, task.owns_device_sampler = self._resident(slot, key, p), False
        elif on_device:
            task.device_sampler = build_chain(p, self.vocab, for_device=True)
        else:
            task.host_sampler = build_chain(p, self.vocab, for_device=False)
            self._attach(slot, None)
        if task.device_sampler is not None and not self._attach(slot, task.device_sampler):
            log.debug("slot %d: backend sampler refused, sampling on the host", slot.id)
            if task.owns_device_sampler:
                task.host_sampler = task.device_sampler
            else:
                task.host_sampler = build_chain(p, self.vocab, for_device=False)
            task.device_sampler = None
        if p.n_probs > 0:
            task.probs = ProbReporter(p.n_probs, self.vocab)
        if p.json_schema is not None and self.make_matcher is not None:
            task.structured = self.make_matcher(p.json_schema)

    # ---- one step ---------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not s.idle for s in self.slots)

    def step(self) -> list[tuple[Callable, Message]]:
        """Run one engine step; return the messages for the event loop."""
        t0 = time.perf_counter()
        self._drop_cancelled()
        self._assign()
        outputs = self._build_batch()
        if self.batch.n_tokens:
            try:
                t1 = time.perf_counter()
                self.ctx.decode(self.batch)
                # Waiting here instead of in the first read of a result costs nothing and splits the step's
                # time cleanly into engine (graph build + device) and host (Python) parts.
                self.ctx.synchronize()
                self.t_engine_total += time.perf_counter() - t1
            except DecodeError as e:
                self._fail_batch(outputs, str(e))
            else:
                self.n_steps += 1
                self.n_tokens_decoded += self.batch.n_tokens
                self._after_decode(outputs)
            self.t_step_total += time.perf_counter() - t0
        out, self.outbox = self.outbox, []
        return out

    def _build_batch(self) -> list[tuple[Slot, int]]:
        b = self.batch
        b.clear()
        outputs: list[tuple[Slot, int]] = []
        gen = [s for s in self.slots
               if s.state is SlotState.GENERATING and s.task is not None and s.task.pending is not None]
        drafts = self._draft(gen) if self.drafter is not None and gen else {}
        for slot in gen:
            task = slot.task
            outputs.append((slot, b.n_tokens))
            b.add(task.pending, len(slot.tokens), slot.id, True)
            slot.tokens.append(task.pending)
            task.pending = None
            # Drafts follow the pending token in the same sequence, each with logits: _verify samples them all.
            task.drafts = drafts.get(slot.id)
            for t in task.drafts or ():
                b.add(t, len(slot.tokens), slot.id, True)
                slot.tokens.append(t)
        budget = self.n_batch - b.n_tokens
        prefill = sorted((s for s in self.slots if s.state is SlotState.PREFILL), key=lambda s: s.task.t_arrival)
        for slot in prefill:
            if budget <= 0:
                break
            task = slot.task
            chunk = task.prompt[task.n_past_prompt : self.memory.chunk_end(slot, task, budget)]
            last = task.n_past_prompt + len(chunk) == len(task.prompt)
            b.add_many(chunk, len(slot.tokens), slot.id, logits_last=last)
            if last:
                outputs.append((slot, b.n_tokens - 1))
            slot.tokens.extend(chunk)
            task.n_past_prompt += len(chunk)
            budget -= len(chunk)
        return outputs

    def _after_decode(self, outputs: list[tuple[Slot, int]]) -> None:
        now = time.perf_counter()
        for slot, i in outputs:
            task = slot.task
            if slot.state is SlotState.PREFILL:
                task.t_first = now
                n_new = len(task.prompt) - task.n_cached
                self.n_prompt_cached_total += task.n_cached
                self.n_prompt_total += n_new
                self.t_prompt_total += now - task.t_start
                self._post(task, ("prompt", n_new, task.n_cached, (now - task.t_start) * 1e3, slot.id))
                if task.embedding:
                    self._emit_embedding(slot, task, i, now)
                    continue
                slot.state = SlotState.GENERATING
            if task.drafts:
                self._verify(slot, task, i, now)
                continue
            token, prob = self._sample(slot, task, i)
            self._on_token(slot, task, token, prob, now)

    # ---- speculative decoding -----------------------------------------------------------------------------

    def _draft(self, gen: list[Slot]) -> dict[int, list[int]]:
        """Drafts for all generating slots in one drafter call; each slot's length is capped before drafting by
        its remaining budget and by the batch room left after every generating slot's own token."""
        room = self.n_batch - len(gen)
        jobs = []
        for slot in gen:
            task, req = slot.task, slot.task.req
            n = min(self._draft_budget(slot, task), room)
            if n <= 0:
                continue
            room -= n
            jobs.append(DraftJob(
                slot.id, slot.tokens, task.pending, n,
                n_min=self.spec.n_min if req.spec_n_min is None else req.spec_n_min,
                p_min=self.spec.p_min if req.spec_p_min is None else req.spec_p_min,
            ))
        if not jobs:
            return {}
        self.drafter.draft(jobs)
        return {j.seq: j.drafts[:j.n_max] for j in jobs if j.drafts}

    def _draft_budget(self, slot: Slot, task: Task) -> int:
        req = task.req
        # A request may lower n_max, not raise it: the context's outputs per sequence were sized for the server's.
        n = self.spec.n_max if req.spec_n_max is None else min(req.spec_n_max, self.spec.n_max)
        if req.n_predict >= 0:  # the step yields one token of the target's own beyond the accepted drafts
            n = min(n, req.n_predict - task.n_generated - 1)
        # The pending token goes at position len(slot.tokens), the drafts after it: all must fit in the slot,
        # one short of the point where the request ends as truncated anyway.
        return min(n, slot.n_ctx - 2 - len(slot.tokens))

    def _verify(self, slot: Slot, task: Task, i: int, now: float) -> None:
        """Accept the longest prefix of the drafts the target samples itself, plus one token of its own.

        Output i is the pending token's, output i+j the j-th draft's. Position j is sampled, with the request's
        own chain, only when drafts 1..j all matched, so the context behind it equals what a run without drafts
        would have had: every token sampled here is the token that run would sample (greedy and seeded alike;
        the chain's state advances by exactly the tokens kept). The first mismatch ends the step.
        """
        drafts, task.drafts = task.drafts, None
        n_kv = len(slot.tokens)  # the KV holds the pending token and every draft now
        del slot.tokens[n_kv - len(drafts):]  # drafts come back one by one as they are accepted
        tokens: list[int] = []
        probs: list[Any] = []
        stop = None
        for j in range(len(drafts) + 1):
            token, prob = self._sample(slot, task, i + j)
            tokens.append(token)
            probs.append(prob)
            stop = self._stop_reason(slot, task, token)
            if stop is not None or j == len(drafts) or token != drafts[j]:
                break
            slot.tokens.append(token)  # accepted: its KV is already in place
        n_accepted = sum(1 for t, d in zip(tokens, drafts) if t == d)
        if len(slot.tokens) < n_kv:
            self.ctx.seq_rm(slot.id, len(slot.tokens), -1)  # roll back the rejected drafts
        task.n_draft += len(drafts)
        task.n_draft_accepted += n_accepted
        self.n_draft_total += len(drafts)
        self.n_draft_accepted_total += n_accepted
        self.n_verify_total += 1
        self._deliver(slot, task, tokens, probs, stop, now)

    def _emit_embedding(self, slot: Slot, task: Task, i: int, now: float) -> None:
        vec = self.ctx.embeddings_seq(slot.id)
        if vec is None:  # no pooling: the last token's state stands for the input
            vec = self.ctx.embeddings_ith(i)
        self._post(task, ("embedding", [float(x) for x in vec]))
        # Embedding inputs are not cached: the next request starts this sequence afresh.
        self.ctx.seq_rm(slot.id, 0, -1)
        self.memory.wipe(slot)
        self._finish(slot, FinishReason.STOP, now)

    def _sample(self, slot: Slot, task: Task, i: int) -> tuple[int, Any]:
        if task.device_sampler is not None:
            token = self.ctx.sampled_token_ith(i)
            if token < 0:
                # Only a prefix of the chain ran on the device (e.g. penalties refuse several outputs per
                # sequence, which speculation needs): the engine finishes the chain on the host and accepts.
                return task.device_sampler.sample(self.ctx, i), None
            task.device_sampler.accept(token)
            return token, None
        logits = self.ctx.logits_ith(i)
        prob_logits = logits.copy() if task.probs is not None else None
        if task.structured is not None:
            task.structured.mask(logits)
        token = task.host_sampler.sample(self.ctx, i)
        if task.structured is not None:
            task.structured.accept(token)
        prob = task.probs.report(prob_logits, token) if task.probs is not None else None
        return token, prob

    def _on_token(self, slot: Slot, task: Task, token: int, prob: Any, now: float) -> None:
        self._deliver(slot, task, [token], [prob], self._stop_reason(slot, task, token), now)

    def _stop_reason(self, slot: Slot, task: Task, token: int) -> tuple[FinishReason, bool, bool] | None:
        """Count a sampled token; (reason, stopped_eos, truncated) if the request ends with it, else None.
        `slot.tokens` must be what the KV holds when the token is sampled (the same rule with or without drafts)."""
        req = task.req
        task.n_generated += 1
        if self.vocab.is_eog(token) and not req.sampling.ignore_eos:
            return FinishReason.STOP, True, False
        if req.n_predict >= 0 and task.n_generated >= req.n_predict:
            return FinishReason.LENGTH, False, False
        if len(slot.tokens) + 1 >= slot.n_ctx:
            return FinishReason.LENGTH, False, True
        if task.structured is not None and task.structured.done():
            return FinishReason.STOP, False, False
        return None

    def _deliver(self, slot: Slot, task: Task, tokens: list[int], probs: list[Any],
                 stop: tuple[FinishReason, bool, bool] | None, now: float) -> None:
        """Send a step's tokens in one message; then end the request or keep the last token for the next step."""
        if stop is not None and stop[1]:  # the end-of-generation token is not part of the output
            tokens, probs = tokens[:-1], probs[:-1]
        if tokens:
            self._post(task, ("tokens", tokens, probs if task.probs is not None else None))
        if stop is None:
            task.pending = tokens[-1]
        else:
            self._finish(slot, stop[0], now, stopped_eos=stop[1], truncated=stop[2])

    # ---- finishing ------------------------------------------------------------------------------------

    def _finish(self, slot: Slot, reason: FinishReason, now: float, *, stopped_eos: bool = False,
                truncated: bool = False, error: str | None = None) -> None:
        task = slot.task
        t_gen = (now - task.t_first) if task.t_first else 0.0
        self.n_gen_total += task.n_generated
        self.t_gen_total += t_gen
        timings = Timings(
            n_prompt=len(task.prompt) - task.n_cached,
            n_cached=task.n_cached,
            n_predicted=task.n_generated,
            t_prompt_ms=((task.t_first or now) - task.t_start) * 1e3,
            t_predicted_ms=t_gen * 1e3,
            n_draft=task.n_draft if self.drafter is not None else None,
            n_draft_accepted=task.n_draft_accepted if self.drafter is not None else None,
        )
        self._post(task, ("done", reason, timings, slot.id, stopped_eos, truncated, error))
        self._release(slot)

    def _release(self, slot: Slot) -> None:
        task = slot.task
        if task is not None:
            task.pending = None
            if task.device_sampler is not None and task.owns_device_sampler:
                # The context holds the chain's pointer: detach before the chain is freed.
                self._attach(slot, None)
            task.close()
        slot.task = None
        slot.state = SlotState.IDLE
        slot.t_last_used = time.perf_counter()

    def _resident(self, slot: Slot, key: tuple, p: Any) -> Any:
        """The slot's long-lived chain for stateless greedy requests with this key.

        The engine initialises a chain once, when first attached; a resident chain that was replaced or
        detached since (another kind of request ran in between) is freed and a fresh one made.
        """
        old_key, chain = self.resident.get(slot.id, (None, None))
        if chain is not None and old_key == key and slot.backend is chain:
            return chain
        if chain is not None and slot.backend is not chain:
            chain.close()
        elif chain is not None:
            self._attach(slot, None)  # detach the old resident chain before freeing it
            chain.close()
        chain = build_chain(p, self.vocab, for_device=True)
        self.resident[slot.id] = (key, chain)
        return chain

    def _attach(self, slot: Slot, sampler: Any) -> bool:
        """Make `sampler` (or none) the slot's backend sampler; a no-op when it already is."""
        if not self.device_sampling or slot.backend is sampler:
            return True
        ok = self.ctx.set_backend_sampler(slot.id, sampler)
        slot.backend = sampler if ok else None
        return ok

    def _fail_batch(self, outputs: list[tuple[Slot, int]], message: str) -> None:
        # A failed decode leaves the KV of the batch's sequences undefined: drop them and their caches.
        now = time.perf_counter()
        log.error("decode failed: %s", message)
        for slot in self.slots:
            if slot.task is not None and slot.state is not SlotState.IDLE:
                self.ctx.seq_rm(slot.id, 0, -1)
                self.memory.wipe(slot)
                self._finish(slot, FinishReason.ERROR, now, error=f"the engine failed to decode: {message}")

    def fail_all(self, message: str) -> list[tuple[Callable, Message]]:
        now = time.perf_counter()
        for slot in self.slots:
            if slot.task is not None:
                self._finish(slot, FinishReason.ERROR, now, error=message)
        for task in self.waiting:
            self._post(task, ("done", FinishReason.ERROR, Timings(), -1, False, False, message))
        self.waiting.clear()
        out, self.outbox = self.outbox, []
        return out

    def _post(self, task: Task, msg: Message) -> None:
        self.outbox.append((task.post, msg))


def run_engine_thread(sched_factory: Callable[[], Scheduler], inbox: "Inbox",
                      deliver: Callable[[list], None], on_ready: Callable[[Any, BaseException | None], None]) -> None:
    """Body of the engine thread: build the scheduler (model load), then loop until stopped."""
    try:
        sched = sched_factory()
    except BaseException as e:  # noqa: BLE001 - reported to the loop, which shows it to clients
        on_ready(None, e)
        return
    on_ready(sched, None)
    try:
        while True:
            tasks = inbox.take(block=not sched.has_work())
            if tasks is None:
                break
            for t in tasks:
                sched.admit(t)
            msgs = sched.step()
            if msgs:
                deliver(msgs)
    except BaseException as e:  # noqa: BLE001
        log.exception("engine thread failed")
        deliver(sched.fail_all(f"the engine thread failed: {e}"))
    finally:
        on_ready(sched, StopIteration())


class Control:
    """A function to run on the engine thread between steps; its result goes to `post` on the loop."""

    def __init__(self, fn: Callable[[Scheduler], Any], post: Callable[[tuple], None]):
        self.fn = fn
        self.post = post
        self.cancelled = False


class Inbox:
    """Hand-over of new tasks from the event loop to the engine thread (and wake-ups for cancels)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[Task] = []
        self._closed = False
        self.n_pending = 0

    def put(self, task: Task) -> None:
        with self._cond:
            self._items.append(task)
            self.n_pending = len(self._items)
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def take(self, block: bool) -> list[Task] | None:
        with self._cond:
            if block:
                while not self._items and not self._closed:
                    self._cond.wait()
            if self._closed:
                return None
            items, self._items = self._items, []
            self.n_pending = 0
            return items
