"""A deterministic stand-in for app.runtime.service.Runtime, for testing the HTTP layer without an engine.

Tokens are UTF-8 bytes (id = byte value); 256 is BOS and 257 EOS. Every request "generates" the bytes of a
scripted text (default SCRIPT), in deltas of `chunk` tokens, honouring n_predict, stop strings (held back and
cut like the real runtime), per-token probabilities, cancellation, the queue limit and a slot's context size.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

from app.runtime.api import (
    EmbeddingRequest,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    ModelInfo,
    NotReady,
    PromptTooLong,
    QueueFull,
    SlotInfo,
    TextDelta,
    Timings,
    TokenProb,
    TopToken,
)

SCRIPT = "Hello from the fake runtime. It says the same thing every time."
BOS, EOS = 256, 257
N_VOCAB = 258
GEMMA_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = m['role'] %}{% endif %}<start_of_turn>{{ role }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _piece(tok: int) -> bytes:
    if tok == BOS:
        return b"<s>"
    if tok == EOS:
        return b"</s>"
    return bytes([tok])


@dataclass
class FakeHandle:
    req: GenerationRequest
    runtime: "FakeRuntime"
    id_slot: int = 0
    cancelled: bool = False
    _events: Any = None

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.runtime.cancelled.append(self.req.id)

    def __aiter__(self) -> "FakeHandle":
        self._events = self._run()
        return self

    async def __anext__(self):
        return await self._events.__anext__()

    async def _run(self):
        rt, req = self.runtime, self.req
        rt.active += 1
        busy = True
        try:
            async for ev in self._generate(rt, req):
                if isinstance(ev, Finished):  # the slot is free once the last event is out
                    rt.active -= 1
                    busy = False
                yield ev
        finally:
            if busy:
                rt.active -= 1

    async def _generate(self, rt: "FakeRuntime", req: GenerationRequest):
        text = rt.script.encode()
        limit = len(text) if req.n_predict < 0 else min(req.n_predict, len(text))
        n_ctx_left = rt.n_ctx_slot - len(req.prompt)
        truncated = limit > n_ctx_left
        limit = min(limit, n_ctx_left)
        out, word = _apply_stop(text[:limit], req.stop)
        tokens = list(out)
        hit_eos = word is None and limit == len(text) and not req.sampling.ignore_eos
        for i in range(0, len(tokens), rt.chunk):
            if rt.delay:
                await asyncio.sleep(rt.delay)
            else:
                await asyncio.sleep(0)
            if self.cancelled:
                return
            part = tokens[i:i + rt.chunk]
            probs = [_prob(t, req.sampling.n_probs) for t in part] if req.sampling.n_probs else None
            yield TextDelta(bytes(part).decode("utf-8", errors="replace"), part, probs)
        if rt.fail_with:
            yield Finished(FinishReason.ERROR, Timings(), id_slot=self.id_slot, error=rt.fail_with)
            return
        n_gen = len(tokens) + (1 if hit_eos else 0)
        reason = FinishReason.STOP if (word is not None or hit_eos) else FinishReason.LENGTH
        yield Finished(reason, Timings(n_prompt=len(req.prompt), n_cached=0, n_predicted=n_gen, t_prompt_ms=2.0,
                                       t_predicted_ms=float(n_gen)),
                       id_slot=self.id_slot, stopping_word=word or "", stopped_eos=hit_eos,
                       truncated=truncated, n_prompt_tokens=len(req.prompt))


def _apply_stop(text: bytes, stops: list[str]) -> tuple[bytes, str | None]:
    best, word = len(text), None
    for s in stops:
        i = text.find(s.encode())
        if i != -1 and i < best:
            best, word = i, s
    return text[:best], word


def _prob(tok: int, n: int) -> TokenProb:
    top = [TopToken(t % 256, bytes([t % 256]).decode("latin-1"), -0.1 * (k + 1)) for k, t in enumerate(
        range(tok, tok + n))]
    return TokenProb(tok, bytes([tok]).decode("latin-1"), -0.1, top)


@dataclass
class FakeRuntime:
    """Implements the Runtime interface; knobs are plain attributes a test may change."""

    settings: Any = None
    script: str = SCRIPT
    chunk: int = 3
    delay: float = 0.0
    n_ctx_slot: int = 512
    n_slots: int = 2
    queue_limit: int = 1000
    hold_loading: bool = False  # True: start() waits until release() is called
    fail_loading: str | None = None
    fail_with: str | None = None  # make every generation end with this engine error
    chat_template: str | None = GEMMA_LIKE_TEMPLATE
    add_bos: bool = True
    ready: bool = False
    load_error: str | None = None
    info: ModelInfo | None = None
    active: int = 0
    cancelled: list = field(default_factory=list)
    submitted: list = field(default_factory=list)
    embedded: list = field(default_factory=list)
    closed: bool = False
    _release: asyncio.Event | None = None

    def release(self) -> None:
        if self._release is not None:
            self._release.set()

    async def start(self) -> None:
        if self.hold_loading:
            self._release = asyncio.Event()
            await self._release.wait()
        if self.fail_loading:
            self.load_error = self.fail_loading
            raise RuntimeError(self.fail_loading)
        alias = getattr(getattr(self.settings, "model", None), "alias", "") or "fake.gguf"
        self.info = ModelInfo(
            path="fake.gguf", alias=alias, arch="fake", n_ctx=self.n_ctx_slot * self.n_slots,
            n_ctx_slot=self.n_ctx_slot, n_ctx_train=4096, n_vocab=N_VOCAB, n_embd=8, n_params=1000, size=4000,
            chat_template=self.chat_template, bos_text="<s>", eos_text="</s>", add_bos=self.add_bos,
            n_slots=self.n_slots,
        )
        self.ready = True

    def _require_ready(self) -> None:
        if not self.ready:
            raise NotReady()

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._require_ready()
        toks: list[int] = [BOS] if add_special and self.add_bos else []
        if parse_special:
            text = text.replace("<s>", "\x00BOS\x00")
            for i, part in enumerate(text.split("\x00BOS\x00")):
                if i:
                    toks.append(BOS)
                toks.extend(part.encode())
            return toks
        return toks + list(text.encode())

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def token_piece(self, token: int) -> str:
        return _piece(token).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return _piece(token)

    def submit(self, req: GenerationRequest) -> FakeHandle:
        self._require_ready()
        if not req.prompt:
            raise InvalidRequest("the prompt is empty: at least one token is needed")
        if len(req.prompt) >= self.n_ctx_slot:
            raise PromptTooLong(len(req.prompt), self.n_ctx_slot)
        if any(not 0 <= t < N_VOCAB for t in req.prompt):
            raise InvalidRequest(f"the prompt has token ids outside the vocabulary (0..{N_VOCAB - 1})")
        if self.active >= self.queue_limit:
            raise QueueFull(self.active)
        self.submitted.append(req)
        return FakeHandle(req, self, id_slot=len(self.submitted) % self.n_slots)

    async def embed(self, req: EmbeddingRequest) -> list[float]:
        self._require_ready()
        self.embedded.append(req)
        v = [float(len(req.prompt)), float(sum(req.prompt) % 7), 1.0]
        n = math.sqrt(sum(x * x for x in v))
        return [x / n for x in v] if req.normalize else v

    def slots(self) -> list[SlotInfo]:
        return [SlotInfo(id=i, state="generating" if i < self.active else "idle", n_ctx=self.n_ctx_slot,
                         n_cached=0, id_task=None, n_decoded=0) for i in range(self.n_slots)]

    def stats(self) -> dict:
        n = len(self.submitted)
        return {"prompt_tokens_total": 10 * n, "prompt_seconds_total": 0.01 * n, "tokens_predicted_total": 5 * n,
                "tokens_predicted_seconds_total": 0.05 * n, "n_decode_total": 7 * n,
                "requests_processing": self.active, "requests_deferred": 0}

    async def close(self) -> None:
        self.closed = True
        self.ready = False


async def serve_fake(aiohttp_client: Any, argv: list[str] | tuple[str, ...] = (), env: dict | None = None,
                     **fake_kw: Any) -> tuple[Any, FakeRuntime]:
    """An in-process server on a FakeRuntime: (aiohttp test client, the fake). Waits for "loaded" unless the
    fake holds its loading."""
    from app.config import load_settings
    from app.server.app import create_app

    settings = load_settings(["-m", "fake.gguf", *argv], env or {})
    fake = FakeRuntime(**fake_kw)

    def factory(rs: Any) -> FakeRuntime:
        fake.settings = rs
        return fake

    client = await aiohttp_client(create_app(settings, factory))
    if not fake.hold_loading and not fake.fail_loading:
        await wait_ready(client)
    return client, fake


async def wait_ready(client: Any, timeout_s: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        r = await client.get("/health")
        if r.status == 200:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the fake server did not become ready")
