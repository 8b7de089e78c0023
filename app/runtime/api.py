"""The runtime's public surface: what the HTTP layer hands in (requests) and gets back (events, errors).

The server converts wire JSON into these plain objects and these events back into wire chunks; nothing here
knows about HTTP or JSON names. Requests carry token ids: templating and tokenization happen in the server
(tokenization is thread-safe and cheap), so the engine thread never touches text on the way in.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Literal

_ids = itertools.count(1)


class RuntimeError_(Exception):
    """Base class for errors the runtime reports to a client (the server maps each to an HTTP status)."""

    status = 500


class InvalidRequest(RuntimeError_):
    status = 400


class PromptTooLong(InvalidRequest):
    def __init__(self, n_prompt: int, n_ctx: int):
        super().__init__(
            f"the request exceeds the available context size: the prompt has {n_prompt} tokens and the "
            f"context per slot holds {n_ctx}; shorten the prompt or start the server with a larger -c"
        )
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


class QueueFull(RuntimeError_):
    status = 503

    def __init__(self, n_queued: int):
        super().__init__(f"the server is busy: {n_queued} requests are already waiting; retry shortly")
        self.retry_after_s = 1


class NotReady(RuntimeError_):
    status = 503

    def __init__(self, what: str = "the model is still loading"):
        super().__init__(what)
        self.retry_after_s = 1


class EngineFailed(RuntimeError_):
    status = 500


@dataclass
class SamplingParams:
    """Sampling settings of one request; defaults are llama-server's."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None = a fresh random seed per request
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias (-inf bans)
    grammar: str | None = None  # GBNF text
    json_schema: dict | None = None  # structured output (compiled by llguidance)
    n_probs: int = 0  # > 0: report this many top candidates per generated token
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass
class GenerationRequest:
    """One completion to run: already tokenized, already templated."""

    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1  # -1: until an end-of-generation token or the context is full
    stop: list[str] = field(default_factory=list)
    cache_prompt: bool = True
    id_slot: int = -1  # -1: the scheduler picks (longest common prefix)
    return_tokens: bool = False
    n_indent: int = 0
    user_starts: list[int] = field(default_factory=list)  # prompt positions where user messages begin
    # speculative decoding overrides (JSON speculative.n_max/n_min/p_min); None: the server's --spec-draft-*
    spec_n_max: int | None = None  # 0 turns speculation off for this request
    spec_n_min: int | None = None
    spec_p_min: float | None = None
    id: int = field(default_factory=lambda: next(_ids))


@dataclass
class EmbeddingRequest:
    prompt: list[int]
    normalize: bool = True
    id: int = field(default_factory=lambda: next(_ids))


@dataclass
class TopToken:
    token: int
    text: str
    logprob: float


@dataclass
class TokenProb:
    """Probability report for one generated token (when SamplingParams.n_probs > 0)."""

    token: int
    text: str
    logprob: float
    top: list[TopToken]


@dataclass
class TextDelta:
    """New output: text that is final (stop strings already ruled out) and the tokens that produced it."""

    text: str
    tokens: list[int]
    probs: list[TokenProb] | None = None


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-generation token or stop string
    LENGTH = "length"  # n_predict reached or context full
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Timings:
    n_prompt: int = 0  # prompt tokens processed now (excludes the cached prefix)
    n_cached: int = 0  # prompt tokens reused from the slot's cache
    n_predicted: int = 0
    t_prompt_ms: float = 0.0
    t_predicted_ms: float = 0.0
    n_draft: int | None = None  # speculative decoding: tokens drafted (None: the server does not speculate)
    n_draft_accepted: int | None = None


@dataclass
class Finished:
    """The last event of a request."""

    reason: FinishReason
    timings: Timings
    id_slot: int
    stopping_word: str = ""  # the stop string that ended it, if any
    stopped_eos: bool = False
    truncated: bool = False  # the context filled up
    n_prompt_tokens: int = 0  # full prompt length, for usage
    error: str | None = None


Event = TextDelta | Finished


@dataclass
class SlotInfo:
    id: int
    state: Literal["idle", "prefill", "generating"]
    n_ctx: int
    n_cached: int  # tokens held in this slot's KV
    id_task: int | None
    n_decoded: int


@dataclass
class ModelInfo:
    path: str
    alias: str
    arch: str
    n_ctx: int  # whole context
    n_ctx_slot: int  # per slot
    n_ctx_train: int
    n_vocab: int
    n_embd: int
    n_params: int
    size: int
    chat_template: str | None
    bos_text: str
    eos_text: str
    add_bos: bool
    n_slots: int
