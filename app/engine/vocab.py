"""Vocab (tokenize, detokenize, token pieces, special tokens) and TokenDecoder (UTF-8-safe streaming).

Thread contract: upstream's tokenizer API is thread-safe and a Vocab is read-only, so tokenize(),
detokenize() and piece() may be called from any thread concurrently (the HTTP layer tokenizes while the
engine thread decodes). A TokenDecoder holds per-stream state: one per stream, used by one thread.
A Vocab is valid while its Model is open; after Model.close() every call raises EngineError.
"""

from __future__ import annotations

import codecs
from typing import Iterable, Sequence

from .errors import EngineError

VOCAB_TYPES = ("none", "spm", "bpe", "wpm", "ugm", "rwkv", "plamo2", "test")
_INT32_MIN = -(2 ** 31)


class Vocab:
    """The tokenizer of a Model (obtained as `model.vocab`; not constructed directly)."""

    def __init__(self, model, ptr):
        self._model = model
        self._ptr = ptr
        self._ffi, self._lib = model._ffi, model._lib
        lib = self._lib
        # Immutable facts, read once: these are hot in the serving loop (is_eog on every token).
        self.n_tokens = int(lib.llama_vocab_n_tokens(ptr))
        self.bos = int(lib.llama_vocab_bos(ptr))
        self.eos = int(lib.llama_vocab_eos(ptr))
        self.eot = int(lib.llama_vocab_eot(ptr))
        self.sep = int(lib.llama_vocab_sep(ptr))
        self.nl = int(lib.llama_vocab_nl(ptr))
        self.pad = int(lib.llama_vocab_pad(ptr))
        self.add_bos = bool(lib.llama_vocab_get_add_bos(ptr))
        self.add_eos = bool(lib.llama_vocab_get_add_eos(ptr))
        t = int(lib.llama_vocab_type(ptr))
        self.type = VOCAB_TYPES[t] if 0 <= t < len(VOCAB_TYPES) else str(t)

    def _handle(self):
        if self._model.closed:
            raise EngineError("vocab used after its model was closed")
        return self._ptr

    @property
    def model(self):
        return self._model

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, and any other end-of-generation token of this vocab)."""
        return bool(self._lib.llama_vocab_is_eog(self._handle(), token))

    def is_control(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_control(self._handle(), token))

    def text(self, token: int) -> str:
        """The token's raw vocabulary text (e.g. '▁the' for SPM); use piece() for output bytes."""
        self._check_token(token)
        p = self._lib.llama_vocab_get_text(self._handle(), token)
        return self._ffi.string(p).decode("utf-8", "replace")

    def _check_token(self, token: int) -> None:
        if not 0 <= token < self.n_tokens:
            raise EngineError(f"token id {token} out of range [0, {self.n_tokens})")

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> token ids. add_special adds BOS/EOS as the model is configured to; parse_special
        turns special-token text such as '<|im_start|>' into those tokens instead of plain text."""
        ffi, lib, h = self._ffi, self._lib, self._handle()
        data = text.encode("utf-8")
        cap = len(data) + 2 + (2 if add_special else 0)  # a token covers at least one byte
        for _ in range(2):
            buf = ffi.new("llama_token[]", cap)
            n = lib.llama_tokenize(h, data, len(data), buf, cap, add_special, parse_special)
            if n == _INT32_MIN:
                raise EngineError("tokenization overflow: text too long")
            if n >= 0:
                return ffi.unpack(buf, n)
            cap = -n
        raise EngineError("tokenizer returned an inconsistent token count")

    def detokenize(self, tokens: Sequence[int], remove_special: bool = False,
                   unparse_special: bool = False) -> str:
        """Token ids -> text. Invalid UTF-8 (a sequence cut inside a character) becomes U+FFFD."""
        ffi, lib, h = self._ffi, self._lib, self._handle()
        toks = ffi.new("llama_token[]", list(tokens))
        n_tok = len(toks)
        cap = max(16, n_tok * 8)
        for _ in range(2):
            buf = ffi.new("char[]", cap)
            n = lib.llama_detokenize(h, toks, n_tok, buf, cap, remove_special, unparse_special)
            if n >= 0:
                return ffi.unpack(buf, n).decode("utf-8", "replace")
            cap = -n
        raise EngineError("detokenizer returned an inconsistent length")

    def piece(self, token: int, special: bool = False) -> bytes:
        """Raw bytes of one token as it appears in output; may be part of a multi-byte UTF-8 character
        (byte-fallback tokens). special=True renders control tokens (e.g. '</s>') instead of b''."""
        self._check_token(token)
        ffi, lib, h = self._ffi, self._lib, self._handle()
        cap = 32
        for _ in range(2):
            buf = ffi.new("char[]", cap)
            n = lib.llama_token_to_piece(h, token, buf, cap, 0, special)
            if n >= 0:
                return ffi.unpack(buf, n)
            cap = -n
        raise EngineError("token_to_piece returned an inconsistent length")

    def __repr__(self) -> str:
        return f"<Vocab {self.type} n_tokens={self.n_tokens}>"


class TokenDecoder:
    """Incremental detokenizer for streaming: feed() returns only complete UTF-8 characters.

    Bytes of a character split across tokens are held back until the character is complete; flush()
    returns whatever is left (an incomplete tail becomes U+FFFD). Token pieces are concatenated as-is,
    so a leading space of the first generated token is kept (it is a continuation of the prompt).
    """

    def __init__(self, vocab: Vocab, special: bool = False):
        self.vocab = vocab
        self.special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._dec.decode(self.vocab.piece(token, self.special))

    def feed_many(self, tokens: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in tokens)

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    def reset(self) -> None:
        self._dec.reset()
