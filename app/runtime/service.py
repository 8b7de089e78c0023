"""Runtime facade used by the HTTP layer: start the engine thread, submit requests, stream their events.

    rt = Runtime(settings)                 # settings: app.config.RuntimeSettings; cheap, loads nothing
    await rt.start()                       # loads model + context in the engine thread; rt.ready turns True
    rt.info -> ModelInfo                   # valid once ready
    rt.tokenize(text, add_special=True, parse_special=True) -> list[int]      # any thread, no await
    handle = rt.submit(GenerationRequest)  # raises NotReady, QueueFull, PromptTooLong, InvalidRequest
    async for ev in handle: ...            # TextDelta ... then exactly one Finished
    handle.cancel()                        # client went away: the slot is free at the next engine step
    await rt.embed(EmbeddingRequest) -> list[float]   # with --embedding
    rt.slots() -> list[SlotInfo]; rt.stats() -> dict; await rt.close()

Thread contract: all methods run on the event loop; the engine thread is reached only through the Inbox and
comes back only through one `call_soon_threadsafe` per engine step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from app.engine import Context, Model, Sampler, backend_init
from app.runtime.api import (
    EmbeddingRequest,
    EngineFailed,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    ModelInfo,
    NotReady,
    PromptTooLong,
    QueueFull,
    SlotInfo,
)
from app.runtime.handle import EmbeddingHandle, RequestHandle, TokenText
from app.runtime.memory import SlotMemory
from app.runtime.scheduler import Control, Inbox, Scheduler, run_engine_thread
from app.runtime.slots import Task
from app.runtime.speculative import SpecUnsupported, make_drafter

log = logging.getLogger("app.runtime")


class Runtime:
    def __init__(self, settings: Any):
        self.settings = settings
        self.ready = False
        self.load_error: str | None = None
        self.info: ModelInfo | None = None
        self._inbox = Inbox()
        self._thread: threading.Thread | None = None
        self._sched: Scheduler | None = None
        self._model: Model | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._text: TokenText | None = None
        self._started: asyncio.Future | None = None
        self._stopped = threading.Event()
        self._structured_factory: Any = None

    # ---- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model on the engine thread; returns once it is serving (or raises why it is not)."""
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._thread = threading.Thread(
            target=run_engine_thread,
            args=(self._build, self._inbox, self._deliver_threadsafe, self._on_ready_threadsafe),
            name="engine",
            daemon=True,
        )
        self._thread.start()
        await self._started

    def _build(self) -> Scheduler:
        """Engine thread: load model and context (the slow part) and build the scheduler."""
        s = self.settings
        backend_init()
        ms = s.model
        # -dev none keeps everything on the CPU; no -dev means every device the engine finds.
        cpu_only = tuple(ms.devices or ()) == ("none",)
        model = Model(
            ms.path,
            n_gpu_layers=0 if cpu_only else ms.n_gpu_layers,
            split_mode=ms.split_mode,
            main_gpu=ms.main_gpu,
            tensor_split=ms.tensor_split,
            tensor_buft_overrides=ms.tensor_buft_overrides,
            devices=list(ms.devices) if ms.devices and not cpu_only else None,
            load_mtp=ms.load_mtp,
        )
        try:
            n_slots = s.n_parallel
            n_ctx = s.n_ctx if s.n_ctx > 0 else model.n_ctx_train
            use_device = s.backend_sampling and not s.embeddings
            samplers = {i: Sampler.chain([Sampler.greedy()]) for i in range(n_slots)} if use_device else None
            ctx = Context(
                model, n_ctx=n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch, n_seq_max=n_slots,
                n_threads=s.n_threads, n_threads_batch=s.n_threads_batch, flash_attn=s.flash_attn,
                type_k=s.type_k, type_v=s.type_v, kv_unified=s.kv_unified, swa_full=s.swa_full,
                embeddings=s.embeddings, backend_samplers=samplers,
                # a speculating slot verifies its pending token and up to n_max drafts in one batch
                n_outputs_max_per_seq=1 + _spec_n_max(s),
            )
            try:
                drafter = self._make_drafter(model, n_ctx, n_slots)
            except BaseException:
                ctx.close()
                raise
        except BaseException:
            model.close()
            raise
        self._drafter = drafter
        self._model = model
        from app.runtime.structured import matcher_factory

        return Scheduler(
            model, ctx, n_slots, device_sampling=bool(use_device), cache_prompt=s.cache_prompt,
            structured=matcher_factory(model.vocab), greedy_chains=samplers,
            memory=SlotMemory(ctx, model, n_slots, cache_ram_mib=s.cache_ram_mib, ctx_checkpoints=s.ctx_checkpoints,
                              checkpoint_min_step=s.checkpoint_min_step, swa_full=s.swa_full),
            drafter=drafter, spec=getattr(s, "spec", None),
        )

    def _make_drafter(self, model: Model, n_ctx: int, n_slots: int) -> Any:
        """Engine thread: the speculative drafter the settings ask for (docs/speculative.md), or None."""
        s = self.settings
        spec = getattr(s, "spec", None)
        if spec is None or spec.type == "none":
            return None
        if model.is_recurrent or model.is_hybrid:
            # Rejected drafts are rolled back with seq_rm, which recurrent state can't do without snapshots.
            raise SpecUnsupported(f"speculative decoding is not supported yet for recurrent/hybrid models "
                                  f"({model.arch}); start without --spec-type")
        return make_drafter(spec, model, n_ctx=n_ctx, n_slots=n_slots, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                            target_devices=tuple(s.model.devices or ()),
                            ctx_kw=dict(n_threads=s.n_threads, n_threads_batch=s.n_threads_batch,
                                        flash_attn=s.flash_attn, kv_unified=s.kv_unified))

    def _on_ready_threadsafe(self, sched: Scheduler | None, err: BaseException | None) -> None:
        if isinstance(err, StopIteration):
            self._stopped.set()
            if sched is not None:
                if sched.drafter is not None:
                    sched.drafter.close()
                sched.ctx.close()
                if self._model is not None:
                    self._model.close()
            return
        self._loop.call_soon_threadsafe(self._on_ready, sched, err)

    def _on_ready(self, sched: Scheduler | None, err: BaseException | None) -> None:
        if err is not None:
            self.load_error = str(err)
            log.error("model failed to load: %s", err)
            self._started.set_exception(err)
            return
        self._sched = sched
        self._text = TokenText(self._model.vocab)
        self.info = self._model_info(sched)
        self.ready = True
        self._started.set_result(None)

    def _model_info(self, sched: Scheduler) -> ModelInfo:
        m, v, s = self._model, self._model.vocab, self.settings
        return ModelInfo(
            path=s.model.path, alias=s.model.alias or str(s.model.path), arch=m.arch,
            n_ctx=sched.ctx.n_ctx, n_ctx_slot=sched.slots[0].n_ctx, n_ctx_train=m.n_ctx_train,
            n_vocab=v.n_tokens, n_embd=m.n_embd, n_params=m.n_params, size=m.size,
            chat_template=m.chat_template(), bos_text=self._piece_text(v.bos), eos_text=self._piece_text(v.eos),
            add_bos=v.add_bos, n_slots=len(sched.slots),
        )

    def _piece_text(self, tok: int) -> str:
        if tok is None or tok < 0:
            return ""
        return self._model.vocab.piece(tok, special=True).decode("utf-8", errors="replace")

    async def close(self) -> None:
        self._inbox.close()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.ready = False

    # ---- text helpers (any thread) ------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._require_ready()
        return self._model.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        self._require_ready()
        return self._model.vocab.detokenize(tokens)

    def token_bytes(self, token: int) -> bytes:
        self._require_ready()
        return self._text.piece(token)

    def token_piece(self, token: int) -> str:
        self._require_ready()
        return self._text.piece(token).decode("utf-8", errors="replace")

    def _require_ready(self) -> None:
        if not self.ready:
            raise NotReady(self.load_error or "the model is still loading")

    # ---- requests ----------------------------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> RequestHandle:
        self._check(req.prompt, req.id_slot)
        if req.sampling.json_schema is not None and self._sched.make_matcher is None:
            raise InvalidRequest("response_format json_schema needs the llguidance package (pip install llguidance)")
        handle = RequestHandle(req, self._text, self._inbox)
        self._enqueue(Task(req=req, post=handle.on_message), handle)
        return handle

    async def embed(self, req: EmbeddingRequest) -> list[float]:
        if not self.settings.embeddings:
            raise InvalidRequest("this server was not started with --embedding")
        self._check(req.prompt, -1)
        if len(req.prompt) > self._sched.ctx.n_ubatch:
            raise InvalidRequest(
                f"the input has {len(req.prompt)} tokens, more than the physical batch size "
                f"{self._sched.ctx.n_ubatch} (-ub) an embedding must fit in"
            )
        handle = EmbeddingHandle(req)
        gen = GenerationRequest(prompt=req.prompt, n_predict=0, cache_prompt=False)
        self._enqueue(Task(req=gen, post=handle.on_message, embedding=True), handle)
        return await handle.result(normalize=req.normalize)

    def _check(self, prompt: list[int], id_slot: int) -> None:
        self._require_ready()
        if not prompt:
            raise InvalidRequest("the prompt is empty: at least one token is needed")
        n_ctx = self.info.n_ctx_slot
        if len(prompt) >= n_ctx:
            raise PromptTooLong(len(prompt), n_ctx)
        if id_slot >= self.info.n_slots:
            raise InvalidRequest(f"id_slot {id_slot} does not exist: this server has {self.info.n_slots} slots")
        n_vocab = self.info.n_vocab
        if any(t < 0 or t >= n_vocab for t in prompt):
            raise InvalidRequest(f"the prompt has token ids outside the vocabulary (0..{n_vocab - 1})")

    def _enqueue(self, task: Task, handle: Any) -> None:
        n_queued = len(self._sched.waiting) + self._inbox.n_pending
        if n_queued >= self.settings.queue_size:
            raise QueueFull(n_queued)
        if self._stopped.is_set():
            raise EngineFailed("the engine thread has stopped")
        handle.attach(task)
        self._inbox.put(task)

    @property
    def needs_checkpoints(self) -> bool:
        """The model's memory can't be cut at any position (recurrent, hybrid, SWA): the server then tells the
        runtime where user messages begin, so checkpoints land on turn boundaries."""
        return self._sched is not None and self._sched.memory.needs_ckpt

    def slot_actions(self) -> Any:
        """Save/restore/erase of slots (needs --slot-save-path)."""
        if getattr(self, "_slot_actions", None) is None:
            from app.runtime.slot_actions import SlotActions

            self._slot_actions = SlotActions(self, self.settings.slot_save_path)
        return self._slot_actions

    async def on_engine(self, fn: Any) -> Any:
        """Run fn(scheduler) on the engine thread between steps; return its result or raise its error."""
        self._require_ready()
        fut = self._loop.create_future()

        def post(msg: tuple) -> None:
            if not fut.done():
                (fut.set_result if msg[0] == "result" else fut.set_exception)(msg[1])

        self._inbox.put(Control(fn, post))
        return await fut

    # ---- engine -> loop -----------------------------------------------------------------------------------

    def _deliver_threadsafe(self, msgs: list) -> None:
        self._loop.call_soon_threadsafe(_deliver, msgs)

    # ---- introspection ------------------------------------------------------------------------------------

    def slots(self) -> list[SlotInfo]:
        if self._sched is None:
            return []
        out = []
        for s in self._sched.slots:
            t = s.task
            out.append(SlotInfo(id=s.id, state=s.state.value, n_ctx=s.n_ctx, n_cached=len(s.tokens),
                                id_task=t.req.id if t else None, n_decoded=t.n_generated if t else 0))
        return out

    def stats(self) -> dict:
        s = self._sched
        if s is None:
            return {}
        busy = sum(1 for x in s.slots if not x.idle)
        return {
            "prompt_tokens_total": s.n_prompt_total,
            "prompt_seconds_total": s.t_prompt_total,
            "tokens_predicted_total": s.n_gen_total,
            "tokens_predicted_seconds_total": s.t_gen_total,
            "n_decode_total": s.n_steps,
            "n_tokens_decoded_total": s.n_tokens_decoded,
            "prompt_tokens_cached_total": s.n_prompt_cached_total,
            **_memory_stats(s.memory),
            "step_seconds_total": s.t_step_total,
            "step_engine_seconds_total": s.t_engine_total,
            "requests_processing": busy,
            "requests_deferred": len(s.waiting) + self._inbox.n_pending,
            "n_slots": len(s.slots),
            # speculative decoding, under the names /metrics reads (and the short names of the runtime's API)
            "spec_decode_num_draft_tokens_total": s.n_draft_total,
            "spec_decode_num_accepted_tokens_total": s.n_draft_accepted_total,
            "spec_decode_num_drafts_total": s.n_verify_total,
            "spec_decode_draft_total": s.n_draft_total,
            "spec_decode_accepted_total": s.n_draft_accepted_total,
        }


def _spec_n_max(s: Any) -> int:
    spec = getattr(s, "spec", None)
    return spec.n_max if spec is not None and spec.type != "none" else 0


def _memory_stats(memory) -> dict:
    """Prompt cache, checkpoint and buffer pool figures, named for /metrics."""
    c = memory.cache.stats()
    p = memory.pool.stats()
    return {
        "prompt_cache_hits_total": c["n_hits"], "prompt_cache_misses_total": c["n_misses"],
        "prompt_cache_tokens_restored_total": c["n_tokens_restored"], "prompt_cache_entries": c["n_entries"],
        "prompt_cache_bytes": c["bytes_used"], "checkpoints_held": sum(len(k) for k in memory.ckpts),
        "checkpoints_bytes": sum(k.nbytes for k in memory.ckpts), "buffer_pool_bytes": p.bytes_total,
        "buffer_pool_free_bytes": p.bytes_free,
    }


def _deliver(msgs: list) -> None:
    for post, msg in msgs:
        post(msg)


__all__ = ["Runtime", "RequestHandle", "FinishReason"]
