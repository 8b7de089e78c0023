"""Speculative decoding drafters: propose the next tokens of many slots at once, for the scheduler to verify.

The scheduler owns the verify loop (app/runtime/scheduler.py): before each step it asks the drafter for
drafts for every generating slot at once (`Drafter.draft(jobs)`), puts [pending, draft_1..draft_k] of each
slot in the same batch as everyone else's decode tokens and prompt chunks, and after the decode accepts the
longest prefix the target itself samples. A drafter only proposes; it never decides what is emitted, so a
bad draft costs verify compute, never correctness.

Drafters:
  * `NgramDrafter` (`ngram-simple`): prompt lookup. The last n tokens (pending included) are searched for
    earlier in the slot's own context, most recent occurrence first, n from `n_hi` down to `n_lo` (3..1 by
    default: longer matches predict better, a 1-gram still finds copies of rare tokens); the tokens that
    followed the match are the draft. No model, no state.
  * `DraftModelDrafter` (`draft-simple`): a smaller model with the same vocabulary in its own context, one
    sequence per slot. Its KV is kept in sync with each slot's accepted tokens by common prefix, and the
    catch-up of newly accepted tokens is folded into the first draft decode (one call for all slots); then it
    drafts greedily, one batched decode per draft position across all drafting slots.

Thread contract: drafters run on the engine thread only (they own a llama_context, like the scheduler).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from app.engine import Batch, Context, DecodeError, Model

log = logging.getLogger("app.runtime")

SPEC_TYPES = ("none", "draft-simple", "draft-mtp", "ngram-simple")
SPEC_ALIASES = {"mtp": "draft-mtp"}
VOCAB_MAX_SIZE_DIFFERENCE = 128  # as upstream: a draft vocab may add or lack a few trailing special tokens


class SpecUnsupported(ValueError):
    """A speculative setting the server can't run (said at startup, never mid-request)."""


@dataclass
class DraftJob:
    """One slot's request for drafts this step. `context` is what the target's KV holds for the slot (read
    only: the scheduler's list), `last` the sampled token about to be decoded after it."""

    seq: int
    context: list[int]
    last: int
    n_max: int  # already capped by the request's remaining budget
    n_min: int = 0
    p_min: float = 0.0
    drafts: list[int] = field(default_factory=list)


class Drafter(Protocol):
    name: str

    def draft(self, jobs: list[DraftJob]) -> None:
        """Fill each job's `drafts` (at most n_max tokens; may stay empty)."""

    def close(self) -> None: ...


# ---- n-gram (prompt lookup) ------------------------------------------------------------------------------------


class NgramDrafter:
    name = "ngram-simple"

    def __init__(self, n_hi: int = 3, n_lo: int = 1):
        if not 1 <= n_lo <= n_hi:
            raise ValueError("NgramDrafter needs 1 <= n_lo <= n_hi")
        self.n_hi, self.n_lo = n_hi, n_lo

    def draft(self, jobs: list[DraftJob]) -> None:
        for job in jobs:
            if job.n_max > 0:
                job.drafts = lookup(job.context, job.last, job.n_max, self.n_hi, self.n_lo)

    def close(self) -> None:
        pass


def lookup(context: list[int], last: int, n_max: int, n_hi: int = 3, n_lo: int = 1) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the sequence's last n-gram (longest n first).

    The search runs on the int32 bytes with bytes.rfind (C speed) and keeps only 4-byte-aligned hits, so a
    long context costs one array conversion per step, not a Python loop per token.
    """
    seq = np.empty(len(context) + 1, dtype=np.int32)
    seq[:-1] = context
    seq[-1] = last
    n_seq = len(seq)
    raw = seq.tobytes()
    for n in range(min(n_hi, n_seq - 1), n_lo - 1, -1):
        pattern = raw[(n_seq - n) * 4:]
        end = (n_seq - 1) * 4  # a match must end before the last token, so at least one token follows it
        while True:
            at = raw.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return seq[start:start + n_max].tolist()
            end = at + len(pattern) - 1  # misaligned hit inside a token: search further left
    return []


# ---- draft model -----------------------------------------------------------------------------------------------


def check_vocab_compatible(target: Any, draft: Any) -> None:
    """Refuse a draft whose token ids mean something else than the target's (drafts would never be accepted,
    or worse, accepted as different text)."""
    if target.type != draft.type:
        raise SpecUnsupported(f"the draft model's vocabulary type ({draft.type}) differs from the target's "
                              f"({target.type}); speculative decoding needs the same tokenizer")
    diff = abs(target.n_tokens - draft.n_tokens)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        raise SpecUnsupported(f"the draft model's vocabulary has {draft.n_tokens} tokens and the target's "
                              f"{target.n_tokens} (more than {VOCAB_MAX_SIZE_DIFFERENCE} apart); use a draft "
                              "from the same model family")
    if (target.bos, target.eos) != (draft.bos, draft.eos) or target.add_bos != draft.add_bos:
        raise SpecUnsupported("the draft model's BOS/EOS tokens differ from the target's; speculative decoding "
                              "needs the same tokenizer")
    for t in range(min(target.n_tokens, draft.n_tokens)):
        if target.text(t) != draft.text(t):
            raise SpecUnsupported(f"token {t} is {draft.text(t)!r} in the draft model and {target.text(t)!r} in "
                                  "the target; speculative decoding needs the same tokenizer")


class DraftModelDrafter:
    """Greedy drafts from a second model; one context sequence per slot. Owns model and context."""

    name = "draft-simple"

    def __init__(self, model: Model, ctx: Context, n_vocab_target: int):
        self.model, self.ctx = model, ctx
        self.n_vocab_target = n_vocab_target
        self.vocab = model.vocab
        self.batch = Batch(ctx.n_batch, n_seq_max=1)
        self.tokens: dict[int, list[int]] = {}  # per sequence: the tokens whose KV the draft context holds
        self.n_decodes = 0

    @classmethod
    def load(cls, path: str, target: Model, *, n_ctx: int, n_slots: int, n_batch: int, n_ubatch: int,
             n_gpu_layers: int = -1, devices: Any = None, type_k: str = "f16", type_v: str = "f16",
             **ctx_kw: Any) -> "DraftModelDrafter":
        model = Model(path, n_gpu_layers=n_gpu_layers, devices=devices)
        try:
            check_vocab_compatible(target.vocab, model.vocab)
            ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_slots,
                          type_k=type_k, type_v=type_v, **ctx_kw)
        except BaseException:
            model.close()
            raise
        return cls(model, ctx, target.vocab.n_tokens)

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()

    def draft(self, jobs: list[DraftJob]) -> None:
        jobs = [j for j in jobs if j.n_max > 0]
        if not jobs:
            return
        try:
            heads = self._catch_up(jobs)
            self._extend(jobs, heads)
        except DecodeError as e:
            # The draft context's state for these sequences is unknown now: start them afresh next time.
            log.warning("draft model decode failed, no drafts this step: %s", e)
            for j in jobs:
                j.drafts = []
                self._reset(j.seq)

    def _reset(self, seq: int) -> None:
        self.ctx.seq_rm(seq, 0, -1)
        self.tokens[seq] = []

    def _catch_up(self, jobs: list[DraftJob]) -> dict[int, tuple[int, float]]:
        """Bring every job's sequence to context + [last] and return its first draft (token, prob).

        Only tokens the draft context lacks are decoded (usually the accepted tokens of the last step plus
        the pending one), all slots in the same batch; a new request's prompt goes in n_batch chunks.
        """
        todo: list[tuple[DraftJob, int, list[int]]] = []
        for j in jobs:
            want = j.context + [j.last]
            have = self.tokens.setdefault(j.seq, [])
            n = _common_prefix(have, want)
            n = min(n, len(want) - 1)  # the last token is always decoded: its logits give draft 1
            if not self.ctx.seq_rm(j.seq, n, -1):
                self.ctx.seq_rm(j.seq, 0, -1)  # recurrent draft: can't cut here, rebuild the sequence
                n = 0
            del have[n:]
            todo.append((j, n, want[n:]))
        heads: dict[int, tuple[int, float]] = {}
        b = self.batch
        while todo:
            b.clear()
            finishing: list[tuple[DraftJob, int]] = []
            rest = []
            for j, pos, toks in todo:
                room = b.n_tokens_max - b.n_tokens
                if room <= 0:
                    rest.append((j, pos, toks))
                    continue
                chunk = toks[:room]
                last = len(chunk) == len(toks)
                b.add_many(chunk, pos, j.seq, logits_last=last)
                self.tokens[j.seq].extend(chunk)
                if last:
                    finishing.append((j, b.n_tokens - 1))
                else:
                    rest.append((j, pos + len(chunk), toks[len(chunk):]))
            self._decode()
            for j, i in finishing:
                heads[j.seq] = self._pick(i, j.p_min > 0)
            todo = rest
        return heads

    def _extend(self, jobs: list[DraftJob], heads: dict[int, tuple[int, float]]) -> None:
        """Greedy drafting, one batched decode per position for all still-drafting jobs."""
        active = list(jobs)
        b = self.batch
        while active:
            b.clear()
            going = []
            for j in active:
                tok, p = heads[j.seq]
                if tok >= self.n_vocab_target or (len(j.drafts) >= j.n_min and p < j.p_min):
                    continue
                j.drafts.append(tok)
                if len(j.drafts) >= j.n_max or self.vocab.is_eog(tok):
                    continue
                b.add(tok, len(self.tokens[j.seq]), j.seq, True)
                self.tokens[j.seq].append(tok)
                going.append((j, b.n_tokens - 1))
            if not going:
                return
            self._decode()
            for j, i in going:
                heads[j.seq] = self._pick(i, j.p_min > 0)
            active = [j for j, _ in going]

    def _decode(self) -> None:
        self.ctx.decode(self.batch)
        self.n_decodes += 1

    def _pick(self, i: int, want_prob: bool) -> tuple[int, float]:
        row = self.ctx.logits_ith(i)
        tok = int(np.argmax(row))
        if not want_prob:
            return tok, 1.0
        m = row[tok]
        return tok, float(1.0 / np.exp(row.astype(np.float64) - m).sum())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i + 256 <= n and a[i:i + 256] == b[i:i + 256]:
        i += 256
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ---- construction from settings --------------------------------------------------------------------------------


def make_drafter(spec: Any, target: Model, *, n_ctx: int, n_slots: int, n_batch: int, n_ubatch: int,
                 target_devices: tuple[str, ...] = (), ctx_kw: dict | None = None) -> Drafter | None:
    """The drafter the settings ask for (None: no speculation). Raises SpecUnsupported with a clear reason."""
    kind = SPEC_ALIASES.get(spec.type, spec.type) if spec is not None else "none"
    if kind == "none":
        return None
    if kind == "ngram-simple":
        return NgramDrafter()
    if kind == "draft-mtp":
        raise SpecUnsupported("--spec-type draft-mtp (MTP) is not supported yet; use draft-simple with -md, or "
                              "ngram-simple")
    if kind == "draft-simple":
        if not spec.draft_model:
            raise SpecUnsupported("--spec-type draft-simple needs a draft model: -md/--model-draft FNAME")
        devices = tuple(spec.draft_devices) or tuple(target_devices)  # -devd defaults to the target's -dev
        cpu = devices == ("none",)
        return DraftModelDrafter.load(
            spec.draft_model, target, n_ctx=n_ctx, n_slots=n_slots, n_batch=n_batch, n_ubatch=n_ubatch,
            n_gpu_layers=0 if cpu else spec.draft_n_gpu_layers, devices=None if cpu or not devices else list(devices),
            type_k=spec.draft_type_k, type_v=spec.draft_type_v, **(ctx_kw or {}))
    raise SpecUnsupported(f"unknown --spec-type {spec.type!r} (expected one of {', '.join(SPEC_TYPES)})")
