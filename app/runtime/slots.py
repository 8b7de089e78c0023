"""Slots and tasks: the engine thread's bookkeeping for each sequence of the shared context.

A slot is one sequence id of the llama_context and keeps the tokens whose KV it holds, so a later request with
the same prefix prefills only the rest. A task is one running request as the engine thread sees it. Only the
engine thread touches these objects, except `Task.cancelled`, which the event loop may set (a plain bool store,
read once per step).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from app.runtime.api import GenerationRequest


class SlotState(enum.Enum):
    IDLE = "idle"
    PREFILL = "prefill"  # prompt tokens still to decode
    GENERATING = "generating"  # one sampled token waits to be decoded each step


@dataclass
class Task:
    req: GenerationRequest
    post: Callable[[Any], None]  # the request handle's receiver; the engine thread queues calls to it for the loop
    embedding: bool = False  # compute an embedding instead of generating
    host_sampler: Any = None  # engine Sampler when sampling on the host
    device_sampler: Any = None  # engine Sampler set as the slot's backend sampler
    owns_device_sampler: bool = True  # False for the slot's resident greedy chain
    structured: Any = None  # structured-output matcher (host path)
    probs: Any = None  # ProbReporter when the client asked for n_probs
    n_past_prompt: int = 0  # prompt tokens already in the KV
    n_cached: int = 0  # of which reused from the slot's previous request
    n_generated: int = 0
    pending: int | None = None  # sampled, sent, not yet decoded
    drafts: list[int] | None = None  # speculative tokens in this step's batch after `pending`, to verify
    n_draft: int = 0  # speculative: tokens drafted for this request
    n_draft_accepted: int = 0
    cancelled: bool = False
    t_arrival: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0
    t_first: float = 0.0

    @property
    def prompt(self) -> list[int]:
        return self.req.prompt

    def close(self) -> None:
        if self.host_sampler is not None:
            self.host_sampler.close()
        if self.device_sampler is not None and self.owns_device_sampler:
            self.device_sampler.close()
        self.host_sampler = self.device_sampler = None


@dataclass
class Slot:
    id: int
    n_ctx: int
    state: SlotState = SlotState.IDLE
    tokens: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds, positions 0..n-1
    task: Task | None = None
    t_last_used: float = 0.0
    backend: Any = None  # the sampler chain attached to this sequence in the context, if any

    @property
    def idle(self) -> bool:
        return self.state is SlotState.IDLE


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: prompts share long prefixes and a Python loop per token is slow.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pick_slot(slots: list[Slot], prompt: list[int], want: int, use_cache: bool) -> tuple[Slot, int] | None:
    """An idle slot for this prompt and how many of its cached tokens can be kept.

    Rule: the requested slot if given and idle; else the idle slot sharing the longest prefix with the prompt
    (when prompt caching is on), ties and misses going to the least recently used slot.
    """
    idle = [s for s in slots if s.idle]
    if not idle:
        return None
    if want >= 0:
        chosen = next((s for s in idle if s.id == want), None)
        if chosen is None:
            return None
        return chosen, common_prefix(chosen.tokens, prompt) if use_cache else 0
    best, best_n = None, -1
    for s in sorted(idle, key=lambda s: s.t_last_used):
        n = common_prefix(s.tokens, prompt) if use_cache else 0
        if n > best_n:
            best, best_n = s, n
    assert best is not None
    return best, best_n
