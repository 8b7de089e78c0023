"""Sampler chains for a request, and where they run: on the device (backend sampling) or on the host.

Device sampling keeps full logits rows off the host: the engine samples inside the graph and the host reads
one token id per slot. A request falls back to the host only when it needs what the device chain can't do:
probabilities for the client, a grammar or JSON schema, or typical-p. The chain order follows llama.cpp's
default sampler sequence (penalties, top-k, typical, top-p, min-p, temperature, then the final pick), so a
request samples the same distribution on either path.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from app.engine import Sampler, Vocab
from app.runtime.api import SamplingParams, TokenProb, TopToken


def needs_host(p: SamplingParams) -> bool:
    """True when this request must see logits on the host."""
    return p.n_probs > 0 or p.grammar is not None or p.json_schema is not None or p.typical_p < 1.0


def stateless_key(p: SamplingParams) -> tuple | None:
    """A key under which this request's device chain can be reused by a later request, or None.

    Greedy chains with at most a fixed logit bias keep no state between tokens (no RNG, no penalty history),
    so two requests with the same key may share one chain; everything else gets a fresh chain.
    """
    no_penalty = p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    if not p.greedy or not no_penalty or needs_host(p):
        return None
    return tuple(sorted(p.logit_bias.items())), p.ignore_eos


def build_chain(p: SamplingParams, vocab: Vocab, *, for_device: bool) -> Sampler:
    """The sampler chain for one request (a fresh chain; the caller owns and closes it)."""
    stages = []
    if p.grammar is not None and not for_device:
        # The grammar masks first, so every later stage only sees tokens the grammar allows.
        stages.append(Sampler.grammar(vocab, p.grammar))
    if p.logit_bias:
        stages.append(Sampler.logit_bias(vocab.n_tokens, p.logit_bias))
    if p.ignore_eos:
        eog = {t: float("-inf") for t in (vocab.eos, vocab.eot) if t is not None and t >= 0}
        stages.append(Sampler.logit_bias(vocab.n_tokens, eog))
    if p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        last_n = p.repeat_last_n if p.repeat_last_n >= 0 else 4096
        stages.append(Sampler.penalties(last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty,
                                        n_vocab=vocab.n_tokens))
    if p.greedy:
        stages.append(Sampler.greedy())
        return Sampler.chain(stages)
    if p.top_k > 0:
        stages.append(Sampler.top_k(p.top_k))
    if p.typical_p < 1.0 and not for_device:
        stages.append(Sampler.typical(p.typical_p))
    if p.top_p < 1.0:
        stages.append(Sampler.top_p(p.top_p))
    if p.min_p > 0.0:
        stages.append(Sampler.min_p(p.min_p))
    stages.append(Sampler.temp(p.temperature))
    seed = p.seed if p.seed is not None and p.seed >= 0 else random.getrandbits(32)
    stages.append(Sampler.dist(seed & 0xFFFFFFFF))
    return Sampler.chain(stages)


@dataclass
class ProbReporter:
    """Log-probabilities of the chosen token and the top candidates, from one host logits row."""

    n_probs: int
    vocab: Vocab

    def report(self, logits: np.ndarray, token: int) -> TokenProb:
        row = logits.astype(np.float64, copy=False)
        m = row.max()
        logz = m + np.log(np.exp(row - m).sum())
        k = min(self.n_probs, row.shape[0])
        top = np.argpartition(-row, k - 1)[:k]
        top = top[np.argsort(-row[top], kind="stable")]
        return TokenProb(
            token=token,
            text=self._text(token),
            logprob=float(row[token] - logz),
            top=[TopToken(int(t), self._text(int(t)), float(row[t] - logz)) for t in top],
        )

    def _text(self, tok: int) -> str:
        return self.vocab.piece(tok).decode("utf-8", errors="replace")
