"""Structured output (response_format json_object / json_schema) through llguidance.

llguidance compiles a JSON schema into a token-level matcher over our vocabulary; each step its mask bans the
tokens that would break the schema, on the host logits row of that request, before the request's ordinary
sampler chain picks a token. The tokenizer view llguidance needs (every token's bytes) is built once per
model, on first use, on the engine thread (about a second for a 256k vocabulary).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

import numpy as np

log = logging.getLogger("app.runtime")

ANY_JSON_OBJECT = {"type": "object"}


class _VocabView:
    """The tokenizer interface llguidance's TokenizerWrapper reads."""

    def __init__(self, vocab: Any):
        self._vocab = vocab
        self.eos_token_id = vocab.eos
        self.bos_token_id = vocab.bos if vocab.bos >= 0 else None
        toks = []
        special = []
        for t in range(vocab.n_tokens):
            if vocab.is_control(t):
                # llguidance marks special tokens by a 0xff prefix so text can never spell them.
                toks.append(b"\xff" + vocab.piece(t, special=True))
                special.append(t)
            else:
                toks.append(vocab.piece(t))
        self.tokens = toks
        self.special_token_ids = special

    def __call__(self, text: bytes) -> list[int]:
        return self._vocab.tokenize(text.decode("utf-8", errors="replace"), add_special=False, parse_special=False)


class JsonMatcher:
    """One request's schema state."""

    def __init__(self, llg: Any, tokenizer: Any, schema: dict, n_vocab: int):
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self._m = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise ValueError(f"invalid JSON schema: {self._m.get_error()}")
        self._n_vocab = n_vocab

    def mask(self, logits: np.ndarray) -> None:
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = bits[: self._n_vocab].astype(bool)
        logits[: allowed.shape[0]][~allowed] = -np.inf

    def accept(self, token: int) -> None:
        self._m.consume_token(token)

    def done(self) -> bool:
        return self._m.is_stopped()


def matcher_factory(vocab: Any) -> Callable[[dict], JsonMatcher] | None:
    """A constructor of per-request matchers, or None when llguidance is not installed."""
    try:
        import llguidance as llg
    except ImportError:
        return None
    state: dict[str, Any] = {}

    def make(schema: dict) -> JsonMatcher:
        if "tok" not in state:
            wrapper = llg.TokenizerWrapper(_VocabView(vocab))
            state["tok"] = llg.LLTokenizer(wrapper, n_vocab=vocab.n_tokens)
        return JsonMatcher(llg, state["tok"], schema or ANY_JSON_OBJECT, vocab.n_tokens)

    return make
