"""Batch (a llama_batch whose arrays are numpy-owned) and BatchExt (upstream's llama_batch_ext).

Batch allocates its token/pos/seq/logits arrays with numpy and points a llama_batch at them, instead of
llama_batch_init: add_many() then fills a whole prompt chunk with a few vectorised numpy writes straight
into the memory llama_decode reads, and all sequence ids live in one (n_tokens_max, n_seq_max) array.

Thread contract: a batch belongs to the engine thread that owns the context it is decoded on. Nothing in
here calls into native code except BatchExt (which needs a context to size itself).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from . import _ffi
from .errors import EngineError


class Batch:
    """Up to `n_tokens_max` input tokens, each in up to `n_seq_max` sequences."""

    def __init__(self, n_tokens_max: int, n_seq_max: int = 1):
        if n_tokens_max < 1 or n_seq_max < 1:
            raise ValueError("Batch needs n_tokens_max >= 1 and n_seq_max >= 1")
        ffi, _ = _ffi.load()
        self.n_tokens_max = int(n_tokens_max)
        self.n_seq_max = int(n_seq_max)
        self.n_tokens = 0
        n = self.n_tokens_max
        self.tokens = np.zeros(n, np.int32)
        self.pos = np.zeros(n, np.int32)
        self.n_seq_id = np.zeros(n, np.int32)
        self.seq_id = np.zeros((n, self.n_seq_max), np.int32)
        self.logits = np.zeros(n, np.int8)
        # llama_batch.seq_id is llama_seq_id**: one pointer per token, into rows of self.seq_id
        self._seq_ptrs = (self.seq_id.ctypes.data + np.arange(n, dtype=np.uintp) * self.seq_id.strides[0]).astype(np.uintp)
        c = ffi.new("struct llama_batch *")
        c.token = ffi.cast("llama_token *", self.tokens.ctypes.data)
        c.embd = ffi.NULL
        c.pos = ffi.cast("llama_pos *", self.pos.ctypes.data)
        c.n_seq_id = ffi.cast("int32_t *", self.n_seq_id.ctypes.data)
        c.seq_id = ffi.cast("llama_seq_id **", self._seq_ptrs.ctypes.data)
        c.logits = ffi.cast("int8_t *", self.logits.ctypes.data)
        self._c = c
        self._closed = False

    def clear(self) -> None:
        """Empty the batch (arrays are reused; nothing is freed)."""
        self.n_tokens = 0

    def _check_room(self, k: int) -> int:
        if self._closed:
            raise EngineError("batch is closed")
        i = self.n_tokens
        if i + k > self.n_tokens_max:
            raise EngineError(f"batch is full: {i} + {k} tokens > n_tokens_max={self.n_tokens_max}")
        return i

    def add(self, token: int, pos: int, seq_ids: int | Sequence[int], logits: bool) -> int:
        """Append one token at position `pos` in the given sequence(s); return its index in the batch
        (the index to pass to logits_ith/sample when logits=True)."""
        i = self._check_room(1)
        self.tokens[i] = token
        self.pos[i] = pos
        if isinstance(seq_ids, (int, np.integer)):
            self.seq_id[i, 0] = seq_ids
            self.n_seq_id[i] = 1
        else:
            k = len(seq_ids)
            if not 1 <= k <= self.n_seq_max:
                raise EngineError(f"a token needs 1..{self.n_seq_max} sequence ids, got {k}")
            self.seq_id[i, :k] = seq_ids
            self.n_seq_id[i] = k
        self.logits[i] = 1 if logits else 0
        self.n_tokens = i + 1
        return i

    def add_many(self, tokens: Sequence[int] | np.ndarray, pos0: int, seq_id: int,
                 logits_last: bool = True) -> int:
        """Append consecutive tokens of one sequence at positions pos0, pos0+1, ...; only the last one
        requests logits when logits_last. Returns the batch index of the last token."""
        toks = np.asarray(tokens, dtype=np.int32)
        k = int(toks.shape[0])
        if k == 0:
            raise EngineError("add_many needs at least one token")
        i = self._check_room(k)
        j = i + k
        self.tokens[i:j] = toks
        self.pos[i:j] = np.arange(pos0, pos0 + k, dtype=np.int32)
        self.seq_id[i:j, 0] = seq_id
        self.n_seq_id[i:j] = 1
        self.logits[i:j] = 0
        if logits_last:
            self.logits[j - 1] = 1
        self.n_tokens = j
        return j - 1

    def set_logits(self, i: int, value: bool) -> None:
        if not 0 <= i < self.n_tokens:
            raise IndexError(f"batch index {i} out of range [0, {self.n_tokens})")
        self.logits[i] = 1 if value else 0

    @property
    def n_outputs(self) -> int:
        """Number of tokens that request logits/embeddings (rows of ctx.logits() after decode)."""
        return int(np.count_nonzero(self.logits[: self.n_tokens]))

    def _as_c(self):
        """The llama_batch struct to pass by value to llama_decode/llama_encode."""
        if self._closed:
            raise EngineError("batch is closed")
        if self.n_tokens == 0:
            raise EngineError("cannot decode an empty batch")
        self._c.n_tokens = self.n_tokens
        return self._c[0]

    def close(self) -> None:
        """Release the arrays. Idempotent; a closed batch raises EngineError when used."""
        self._closed = True
        self.n_tokens = 0

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.n_tokens


class BatchExt:
    """Upstream's extended batch (llama_batch_ext), processed with ctx.process(batch, "decode").

    Sized by its context (n_batch tokens, n_seq_max sequences). Embedding rows passed to add_embd() are
    copied by upstream, so the caller's arrays may be reused right away. Owned by the context's thread;
    closed automatically when the context closes.
    """

    def __init__(self, ctx):
        ffi, lib = _ffi.load()
        if not _ffi.has("llama_batch_ext_init"):
            raise EngineError("this engine build has no llama_batch_ext API")
        self._ffi, self._lib = ffi, lib
        self._ctx = ctx
        self._ptr = lib.llama_batch_ext_init(ctx._handle())
        if self._ptr == ffi.NULL:
            raise EngineError("llama_batch_ext_init failed")
        self._pos = ffi.new("llama_pos[4]")  # up to GGML_MROPE_SECTIONS positions per entry
        self.n_tokens = 0
        self._outputs: set[int] = set()  # upstream has no getter for output flags
        ctx._batches.add(self)

    def _handle(self):
        if self._ptr is None:
            raise EngineError("batch is closed")
        return self._ptr

    def clear(self) -> None:
        self._lib.llama_batch_ext_clear(self._handle())
        self.n_tokens = 0
        self._outputs.clear()

    _ADD_ERRORS = {-1: "batch is full", -2: "invalid token or embedding", -3: "invalid sequence id"}

    def _finish_add(self, idx: int, pos: int | Sequence[int], seq_ids, logits: bool) -> int:
        lib, h = self._lib, self._ptr
        if idx < 0:
            raise EngineError(f"llama_batch_ext add failed: {self._ADD_ERRORS.get(idx, idx)}")
        extra = [] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)[1:]
        for s in extra:
            if not lib.llama_batch_ext_add_seq(h, idx, s):
                raise EngineError(f"cannot add sequence {s} to batch entry {idx}")
        positions = [pos] if isinstance(pos, (int, np.integer)) else list(pos)
        for k, p in enumerate(positions[:4]):
            self._pos[k] = p
        lib.llama_batch_ext_set_pos(h, idx, self._pos)
        if logits:
            lib.llama_batch_ext_set_output_logits(h, idx, True)
            self._outputs.add(idx)
        self.n_tokens = idx + 1
        return idx

    @staticmethod
    def _first_seq(seq_ids) -> int:
        return int(seq_ids) if isinstance(seq_ids, (int, np.integer)) else int(seq_ids[0])

    def add(self, token: int, pos: int, seq_ids: int | Sequence[int], logits: bool) -> int:
        idx = self._lib.llama_batch_ext_add_token(self._handle(), self._first_seq(seq_ids), token)
        return self._finish_add(idx, pos, seq_ids, logits)

    def add_embd(self, embd: np.ndarray, pos: int | Sequence[int], seq_ids: int | Sequence[int],
                 logits: bool) -> int:
        """Append an input embedding row (float32, n_embd wide; M-RoPE models take several positions)."""
        row = np.ascontiguousarray(embd, dtype=np.float32)
        e = self._ffi.new("struct llama_embd *")
        e.data = self._ffi.cast("float *", row.ctypes.data)
        e.n_rows = 1 if row.ndim == 1 else row.shape[0]
        e.n_embd = row.shape[-1]
        idx = self._lib.llama_batch_ext_add_embd(self._handle(), self._first_seq(seq_ids), e[0])
        return self._finish_add(idx, pos, seq_ids, logits)

    def add_many(self, tokens: Sequence[int], pos0: int, seq_id: int, logits_last: bool = True) -> int:
        last = -1
        for k, t in enumerate(tokens):
            last = self.add(int(t), pos0 + k, seq_id, logits_last and k == len(tokens) - 1)
        return last

    def set_logits(self, i: int, value: bool) -> None:
        if not self._lib.llama_batch_ext_set_output_logits(self._handle(), i, bool(value)):
            raise IndexError(f"batch index {i} out of range")
        if value:
            self._outputs.add(i)
        else:
            self._outputs.discard(i)

    @property
    def n_outputs(self) -> int:
        return len(self._outputs)

    def close(self) -> None:
        if self._ptr is not None:
            ptr, self._ptr = self._ptr, None
            self._lib.llama_batch_ext_free(ptr)

    def __enter__(self) -> "BatchExt":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __len__(self) -> int:
        return self.n_tokens
