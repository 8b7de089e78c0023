"""Context: owner of a native llama_context (KV/recurrent memory, compute buffers, outputs).

Thread contract: a Context, the batches decoded on it and the samplers sampling from it belong to ONE
thread, the engine thread; llama_context is not thread-safe. The long calls (decode, encode, process,
state_seq_get/set, synchronize, construction) release the GIL, so the asyncio loop and other Python
threads keep running meanwhile.

Output views: logits_ith(), logits(), embeddings_*() and sampled_*() return numpy arrays that *view*
the context's own output buffers without copying. They are valid until the next decode/encode/process
or close() on this context; copy (arr.copy()) anything that must live longer.
"""

from __future__ import annotations

import os
import weakref
from typing import Mapping

import numpy as np

from . import _ffi, log
from .errors import ContextError, DecodeError, EngineError, StateError

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
POOLING = {"unspecified": -1, "none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
CTX_TYPES = {"default": 0, "mtp": 1}
PROCESS_TYPES = {"encode": 0, "decode": 1}  # enum llama_process_type
STATE_SEQ_FLAGS_ON_DEVICE = 2
_STATE_MAGIC = 0xAF143CD8  # first u32 of a sequence state (llama-context.cpp io_magic)
_UINT32_MAX = 2 ** 32 - 1

_DECODE_MESSAGES = {
    1: "no KV cache slot for the batch: the context is full (free sequences with seq_rm, use a larger "
       "n_ctx, or decode a smaller batch)",
    2: "aborted by the abort callback (ubatches already processed stay in the memory)",
    -1: "invalid input batch",
}


def ggml_type(lib, name: str | int) -> int:
    """'f16', 'q8_0', 'q4_0', 'bf16', ... -> enum ggml_type value."""
    if isinstance(name, int):
        return name
    try:
        return int(getattr(lib, "GGML_TYPE_" + name.upper()))
    except AttributeError:
        raise ValueError(f"unknown ggml type {name!r} (expected e.g. 'f16', 'q8_0', 'q4_0')") from None


def _default_threads() -> int:
    """Physical cores: decode is memory-bound and hyper-threads slow ggml's CPU kernels down."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:
        n = None
    return max(1, n or os.cpu_count() or 1)


def _choice(table: dict, value, what: str) -> int:
    if value is True:
        value = "on"
    elif value is False:
        value = "off"
    if value not in table:
        raise ValueError(f"{what} must be one of {sorted(k for k in table)}, not {value!r}")
    return table[value]


def _context_params(lib, *, n_ctx, n_batch, n_ubatch, n_seq_max, n_threads, n_threads_batch, flash_attn,
                    type_k, type_v, kv_unified, swa_full, n_rs_seq, embeddings, pooling, ctx_type,
                    n_outputs_max, no_perf, offload_kqv, op_offload, n_outputs_max_per_seq=1):
    """llama_context_params from Context's keyword arguments, validated (ContextError / ValueError)."""
    for name, v in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_ubatch", n_ubatch), ("n_seq_max", n_seq_max),
                    ("n_rs_seq", n_rs_seq), ("n_outputs_max", n_outputs_max),
                    ("n_outputs_max_per_seq", n_outputs_max_per_seq)):
        if not 0 <= int(v) <= _UINT32_MAX:
            raise ContextError(f"{name}={v} is out of range [0, {_UINT32_MAX}]")
    max_seq = int(lib.llama_max_parallel_sequences())
    if n_seq_max > max_seq:
        raise ContextError(f"n_seq_max={n_seq_max} exceeds this build's maximum of {max_seq}")
    n_threads = n_threads or _default_threads()
    p = lib.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = int(n_ctx), int(n_batch), int(n_ubatch), int(n_seq_max)
    p.n_rs_seq, p.n_outputs_max = int(n_rs_seq), int(n_outputs_max)
    # outputs one sequence may have in a batch when it has a backend sampler (speculative verify needs 1 + drafts)
    p.n_outputs_max_per_seq = int(n_outputs_max_per_seq)
    p.n_threads, p.n_threads_batch = int(n_threads), int(n_threads_batch or n_threads)
    p.flash_attn_type = _choice(FLASH_ATTN, flash_attn, "flash_attn")
    p.type_k, p.type_v = ggml_type(lib, type_k), ggml_type(lib, type_v)
    p.kv_unified, p.swa_full, p.embeddings = bool(kv_unified), bool(swa_full), bool(embeddings)
    p.pooling_type = _choice(POOLING, "unspecified" if pooling is None else pooling, "pooling")
    p.ctx_type = _choice(CTX_TYPES, ctx_type, "ctx_type")
    p.no_perf, p.offload_kqv, p.op_offload = bool(no_perf), bool(offload_kqv), bool(op_offload)
    return p


class Context:
    """An inference context on a Model. See the module doc for the thread contract and view lifetimes."""

    def __init__(self, model, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512,
                 n_seq_max: int = 1, n_threads: int | None = None, n_threads_batch: int | None = None,
                 flash_attn: str | bool = "auto", type_k: str = "f16", type_v: str = "f16",
                 kv_unified: bool = False, swa_full: bool = False, n_rs_seq: int = 0,
                 embeddings: bool = False, pooling: str | None = None, ctx_type: str = "default",
                 ctx_other: "Context | None" = None, backend_samplers: Mapping[int, object] | None = None,
                 n_outputs_max: int = 0, n_outputs_max_per_seq: int = 1, no_perf: bool = False,
                 offload_kqv: bool = True, op_offload: bool = True):
        self._ptr = None
        ffi, lib = _ffi.load()
        self._ffi, self._lib, self.model = ffi, lib, model
        mhandle = model._handle()
        if model.vocab_only:
            raise ContextError("cannot create a context on a vocab_only model")
        p = _context_params(lib, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                            n_threads=n_threads, n_threads_batch=n_threads_batch, flash_attn=flash_attn,
                            type_k=type_k, type_v=type_v, kv_unified=kv_unified, swa_full=swa_full,
                            n_rs_seq=n_rs_seq, embeddings=embeddings, pooling=pooling, ctx_type=ctx_type,
                            n_outputs_max=n_outputs_max, n_outputs_max_per_seq=n_outputs_max_per_seq,
                            no_perf=no_perf, offload_kqv=offload_kqv, op_offload=op_offload)
        if ctx_other is not None:
            p.ctx_other = ctx_other._handle()
        self._backend_samplers: dict[int, object] = {}
        self._n_vocab = model.vocab.n_tokens
        self._n_embd_out = model.n_embd_out
        self._n_outputs = 0
        self._device_states: set[int] = set()
        self._batches: weakref.WeakSet = weakref.WeakSet()
        self._dependents: weakref.WeakSet = weakref.WeakSet()
        self._other = ctx_other
        keep = self._sampler_configs(p, backend_samplers or {})
        mark = log.mark()
        ptr = lib.llama_init_from_model(mhandle, p)  # GIL released: allocating buffers can take a while
        del keep
        if ptr == ffi.NULL:
            self._backend_samplers.clear()
            reason = log.reason_since(mark, "upstream gave no reason (see the app.engine.llama log)")
            if "alloc" in reason:
                reason += (" -- not enough memory for the KV cache and compute buffers at this size: lower "
                           "n_ctx, n_ubatch or n_seq_max, or use a quantized type_k/type_v")
            raise ContextError(f"failed to create context (n_ctx={n_ctx}, n_batch={n_batch}, "
                               f"n_ubatch={n_ubatch}, n_seq_max={n_seq_max}, type_k={type_k}, "
                               f"type_v={type_v}): {reason}")
        self._ptr = ptr
        for s in self._backend_samplers.values():
            s._attached.add(self)
        if ctx_other is not None:
            ctx_other._dependents.add(self)
        model._contexts.add(self)

    def _sampler_configs(self, p, samplers: Mapping[int, object]):
        """Fill params.samplers; returns the C arrays that must outlive llama_init_from_model."""
        if not samplers:
            return None
        arr = self._ffi.new("struct llama_sampler_seq_config[]", len(samplers))
        for i, (seq, s) in enumerate(samplers.items()):
            self._check_backend_sampler(s)
            arr[i].seq_id, arr[i].sampler = int(seq), s._handle()
            self._backend_samplers[int(seq)] = s
        p.samplers, p.n_samplers = arr, len(samplers)
        return arr

    @staticmethod
    def _check_backend_sampler(s) -> None:
        if not s.is_chain:
            raise EngineError("a backend sampler must be a chain (Sampler.chain([...]))")
        if not s.backend_ok:
            raise EngineError("this chain cannot run as a backend sampler (penalties need n_vocab=...)")

    # -- lifetime ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def _handle(self):
        if self._ptr is None:
            raise EngineError("context is closed")
        return self._ptr

    def close(self) -> None:
        """Free the context (first any context created with ctx_other=self and any BatchExt). Backend
        samplers are detached, not freed: they belong to the caller. Idempotent."""
        if self._ptr is None:
            return
        for dep in list(self._dependents):
            dep.close()
        for b in list(self._batches):
            b.close()
        ptr, self._ptr = self._ptr, None
        self._lib.llama_free(ptr)
        for s in self._backend_samplers.values():
            s._attached.discard(self)
        self._backend_samplers.clear()
        self.model._contexts.discard(self)

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- sizes ---------------------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return int(self._lib.llama_n_ctx(self._handle()))

    @property
    def n_ctx_seq(self) -> int:
        return int(self._lib.llama_n_ctx_seq(self._handle()))

    @property
    def n_batch(self) -> int:
        return int(self._lib.llama_n_batch(self._handle()))

    @property
    def n_ubatch(self) -> int:
        return int(self._lib.llama_n_ubatch(self._handle()))

    @property
    def n_seq_max(self) -> int:
        return int(self._lib.llama_n_seq_max(self._handle()))

    @property
    def n_outputs(self) -> int:
        """Outputs (rows of logits()) produced by the last decode."""
        return self._n_outputs

    def set_n_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        self._lib.llama_set_n_threads(self._handle(), n_threads, n_threads_batch or n_threads)

    def set_embeddings(self, value: bool) -> None:
        self._lib.llama_set_embeddings(self._handle(), bool(value))

    def set_causal_attn(self, value: bool) -> None:
        self._lib.llama_set_causal_attn(self._handle(), bool(value))

    # -- compute -------------------------------------------------------------------------------------

    def _raise_decode(self, what: str, rc: int, mark: int, n_tokens: int) -> None:
        base = _DECODE_MESSAGES.get(rc, "fatal error" if rc < 0 else "warning")
        reason = log.reason_since(mark, "")
        msg = f"{what} of {n_tokens} tokens failed with code {rc}: {base}" + (f" ({reason})" if reason else "")
        raise DecodeError(rc, msg)

    def decode(self, batch) -> None:
        """Run the model on `batch` (GIL released). Raises DecodeError(code, message) for codes != 0."""
        c = batch._as_c()
        mark = log.mark()
        rc = self._lib.llama_decode(self._handle(), c)
        if rc != 0:
            self._n_outputs = 0
            self._raise_decode("decode", rc, mark, batch.n_tokens)
        self._n_outputs = batch.n_outputs

    def encode(self, batch) -> None:
        """Run the encoder of an encoder-decoder model on `batch` (GIL released)."""
        c = batch._as_c()
        mark = log.mark()
        rc = self._lib.llama_encode(self._handle(), c)
        if rc != 0:
            self._raise_decode("encode", rc, mark, batch.n_tokens)
        self._n_outputs = batch.n_outputs

    def process(self, batch, kind: str = "decode") -> None:
        """llama_process over a BatchExt: kind "decode" or "encode" (GIL released)."""
        if not _ffi.has("llama_process"):
            raise EngineError("this engine build has no llama_process")
        t = _choice(PROCESS_TYPES, kind, "kind")
        mark = log.mark()
        rc = self._lib.llama_process(self._handle(), t, batch._handle())
        if rc != 0:
            self._n_outputs = 0
            self._raise_decode(kind, rc, mark, batch.n_tokens)
        self._n_outputs = batch.n_outputs

    def synchronize(self) -> None:
        """Wait for queued backend work (GIL released)."""
        self._lib.llama_synchronize(self._handle())

    # -- outputs (views, see module doc) -------------------------------------------------------------

    def _view(self, ptr, n: int, dtype=np.float32) -> np.ndarray:
        return np.frombuffer(self._ffi.buffer(ptr, n * np.dtype(dtype).itemsize), dtype=dtype)

    def logits_ith(self, i: int) -> np.ndarray:
        """float32 (n_vocab,) view of the logits of batch output `i` (negative counts from the end)."""
        p = self._lib.llama_get_logits_ith(self._handle(), i)
        if p == self._ffi.NULL:
            raise EngineError(f"no logits for batch index {i} (did the last decode request logits for it?)")
        return self._view(p, self._n_vocab)

    def logits(self) -> np.ndarray:
        """float32 (n_outputs, n_vocab) view of all logits of the last decode, in batch order."""
        p = self._lib.llama_get_logits(self._handle())
        if p == self._ffi.NULL or self._n_outputs == 0:
            raise EngineError("the last decode produced no logits")
        return self._view(p, self._n_outputs * self._n_vocab).reshape(self._n_outputs, self._n_vocab)

    def embeddings_ith(self, i: int) -> np.ndarray:
        """float32 (n_embd_out,) view of the output embedding of batch index `i` (embeddings=True)."""
        p = self._lib.llama_get_embeddings_ith(self._handle(), i)
        if p == self._ffi.NULL:
            raise EngineError(f"no embeddings for batch index {i} (context needs embeddings=True)")
        return self._view(p, self._n_embd_out)

    def embeddings_seq(self, seq_id: int) -> np.ndarray | None:
        """Pooled embedding of a sequence (float32 n_embd_out; n_cls_out scores for pooling="rank"), or
        None when the context does not pool (pooling "none": use embeddings_ith)."""
        h, lib = self._handle(), self._lib
        p = lib.llama_get_embeddings_seq(h, seq_id)
        if p == self._ffi.NULL:
            return None
        rank = int(lib.llama_pooling_type(h)) == POOLING["rank"]
        n = int(lib.llama_model_n_cls_out(self.model._handle())) if rank else self._n_embd_out
        return self._view(p, n)

    def sampled_token_ith(self, i: int) -> int:
        """Token chosen by the backend sampler for output `i`, or -1 if none was sampled."""
        return int(self._lib.llama_get_sampled_token_ith(self._handle(), i))

    def _sampled(self, getter: str, counter: str, i: int, dtype) -> np.ndarray | None:
        h, lib = self._handle(), self._lib
        p = getattr(lib, getter)(h, i)
        if p == self._ffi.NULL:
            return None
        return self._view(p, int(getattr(lib, counter)(h, i)), dtype)

    def sampled_probs_ith(self, i: int) -> np.ndarray | None:
        return self._sampled("llama_get_sampled_probs_ith", "llama_get_sampled_probs_count_ith", i, np.float32)

    def sampled_logits_ith(self, i: int) -> np.ndarray | None:
        return self._sampled("llama_get_sampled_logits_ith", "llama_get_sampled_logits_count_ith", i, np.float32)

    def sampled_candidates_ith(self, i: int) -> np.ndarray | None:
        """Token ids matching the indices of sampled_probs_ith / sampled_logits_ith."""
        return self._sampled("llama_get_sampled_candidates_ith", "llama_get_sampled_candidates_count_ith",
                             i, np.int32)

    def set_backend_sampler(self, seq_id: int, sampler) -> bool:
        """Attach a sampler chain to run on the backend for `seq_id` (None detaches). Returns False when
        it cannot run there (upstream refused, or a stage the backend path cannot take): sample on the
        host then. The context keeps a reference; the chain cannot be closed while attached."""
        h = self._handle()
        if sampler is not None:
            if not sampler.is_chain:
                raise EngineError("a backend sampler must be a chain (Sampler.chain([...]))")
            if not sampler.backend_ok:
                return False
        ok = bool(self._lib.llama_set_sampler(h, seq_id, sampler._handle() if sampler else self._ffi.NULL))
        if ok:
            old = self._backend_samplers.pop(int(seq_id), None)
            if sampler is not None:
                self._backend_samplers[int(seq_id)] = sampler
                sampler._attached.add(self)
            if old is not None and old not in self._backend_samplers.values():
                old._attached.discard(self)
        return ok

    # -- memory (KV cache / recurrent state) ---------------------------------------------------------

    def _mem(self):
        return self._lib.llama_get_memory(self._handle())

    def memory_clear(self, data: bool = True) -> None:
        self._lib.llama_memory_clear(self._mem(), bool(data))

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of a sequence (-1 = open end); False if not possible. Removing a whole
        sequence always works. On recurrent/hybrid models a partial removal is only possible as a
        rollback of at most n_rs_seq trailing tokens of the last batch decoded for that sequence
        (speculative verify -> reject drafts); anything else returns False or, if rolled back past that
        batch, leaves a wrong state: restore a saved state (state_seq_set) instead."""
        return bool(self._lib.llama_memory_seq_rm(self._mem(), seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._lib.llama_memory_seq_cp(self._mem(), src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self._lib.llama_memory_seq_keep(self._mem(), seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self._lib.llama_memory_seq_add(self._mem(), seq_id, p0, p1, delta)

    def seq_pos_min(self, seq_id: int) -> int:
        return int(self._lib.llama_memory_seq_pos_min(self._mem(), seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position stored for the sequence, -1 if empty."""
        return int(self._lib.llama_memory_seq_pos_max(self._mem(), seq_id))

    def can_shift(self) -> bool:
        return bool(self._lib.llama_memory_can_shift(self._mem()))

    # -- sequence state ------------------------------------------------------------------------------

    def state_seq_size(self, seq_id: int, flags: int = 0) -> int:
        """Bytes needed by state_seq_get for this sequence now (computed by a dry run: not free)."""
        return int(self._lib.llama_state_seq_get_size_ext(self._handle(), seq_id, flags))

    def state_seq_get(self, seq_id: int, flags: int = 0) -> np.ndarray:
        """The sequence's state as a new uint8 array (GIL released while copying)."""
        buf = np.empty(self.state_seq_size(seq_id, flags), dtype=np.uint8)
        n = self.state_seq_get_into(buf, seq_id, flags)
        return buf[:n]

    def state_seq_get_into(self, buf, seq_id: int, flags: int = 0) -> int:
        """Write the sequence's state into a caller-owned writable buffer (bytearray, numpy uint8, ...);
        return the bytes written. StateError when the buffer is too small."""
        h = self._handle()
        cbuf = self._ffi.from_buffer("uint8_t[]", buf, require_writable=True)
        mark = log.mark()
        n = int(self._lib.llama_state_seq_get_data_ext(h, cbuf, len(cbuf), seq_id, flags))
        if n == 0:
            raise StateError(f"saving the state of sequence {seq_id} into {len(cbuf)} bytes failed: "
                             + log.reason_since(mark, "buffer too small?"))
        if flags & STATE_SEQ_FLAGS_ON_DEVICE:
            self._device_states.add(int(seq_id))
        return n

    def state_seq_set(self, buf, seq_id: int, flags: int = 0) -> int:
        """Restore a state produced by state_seq_get[_into] into `seq_id`; return bytes read (GIL
        released). StateError if upstream rejects it (wrong model/context shape, corrupt data)."""
        h = self._handle()
        cbuf = self._ffi.from_buffer("uint8_t[]", buf)
        if flags & STATE_SEQ_FLAGS_ON_DEVICE:
            self._check_device_state(bytes(cbuf[0:8]) if len(cbuf) >= 8 else b"")
        mark = log.mark()
        n = int(self._lib.llama_state_seq_set_data_ext(h, cbuf, len(cbuf), seq_id, flags))
        if n == 0:
            raise StateError(f"restoring a {len(cbuf)}-byte state into sequence {seq_id} failed: "
                             + log.reason_since(mark, "incompatible or corrupt state"))
        return n

    def _check_device_state(self, head: bytes) -> None:
        """Upstream's ON_DEVICE restore throws through the C API (terminating the process) on a bad magic
        and asserts that the device copy exists: reject those cases here instead."""
        if len(head) < 8 or int.from_bytes(head[:4], "little") != _STATE_MAGIC:
            raise StateError("not a sequence state (bad magic)")
        src = int.from_bytes(head[4:8], "little", signed=True)
        if src not in self._device_states:
            raise StateError(f"no on-device state was saved for sequence {src} on this context")

    # -- perf ----------------------------------------------------------------------------------------

    def perf(self) -> dict:
        """Upstream's counters: t_start_ms, t_load_ms, t_p_eval_ms, t_eval_ms, n_p_eval, n_eval, n_reused
        (upstream reports n_p_eval and n_eval as at least 1, also right after perf_reset())."""
        d = self._lib.llama_perf_context(self._handle())
        return {"t_start_ms": d.t_start_ms, "t_load_ms": d.t_load_ms, "t_p_eval_ms": d.t_p_eval_ms,
                "t_eval_ms": d.t_eval_ms, "n_p_eval": int(d.n_p_eval), "n_eval": int(d.n_eval),
                "n_reused": int(d.n_reused)}

    def perf_reset(self) -> None:
        self._lib.llama_perf_context_reset(self._handle())

    def __repr__(self) -> str:
        return "<Context closed>" if self.closed else f"<Context n_ctx={self.n_ctx} n_seq_max={self.n_seq_max}>"
