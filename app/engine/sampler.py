"""Sampler: owner of a native llama_sampler (a single stage or a chain of stages).

Ownership follows upstream: `Sampler.chain([...])` moves each stage into the chain (llama_sampler_chain_add
takes ownership), so a stage object is "consumed" and must not be used or freed on its own afterwards;
closing the chain frees its stages. A chain attached to a context as a backend sampler stays referenced
by the context and cannot be closed until it is detached (ctx.set_backend_sampler(seq, None)) or the
context is closed.

Thread contract: a sampler belongs to the engine thread (it mutates state on sample/accept). Building
one (including parsing a grammar) may happen on any thread.
"""

from __future__ import annotations

import weakref
from typing import Mapping, Sequence

from . import _ffi, log
from .errors import EngineError, GrammarError

# Stages that pick the token (set `selected`); a chain without one cannot be sampled from.
_SELECTORS = frozenset({"greedy", "dist", "mirostat", "mirostat_v2", "adaptive_p"})
DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed


class Sampler:
    """A sampler stage or chain. Build with the class-method constructors, never directly."""

    def __init__(self, ptr, kind: str, *, selects: bool = False, is_chain: bool = False,
                 models: Sequence = ()):
        ffi, lib = _ffi.load()
        self._ffi, self._lib = ffi, lib
        if ptr == ffi.NULL:
            raise EngineError(f"failed to create {kind} sampler")
        self._ptr = ptr
        self.kind = kind
        self.selects = selects
        self.is_chain = is_chain
        self.backend_ok = True  # False when a stage would abort upstream's backend-sampling path
        self._consumed_by: Sampler | None = None
        self._attached: weakref.WeakSet = weakref.WeakSet()  # contexts using this as a backend sampler
        self._models = list(models)  # models whose vocab this sampler points into
        for m in self._models:
            m._dependents.add(self)

    # -- lifetime ------------------------------------------------------------------------------------

    def _handle(self):
        if self._ptr is None:
            if self._consumed_by is not None:
                raise EngineError(f"{self.kind} sampler was moved into a chain; use the chain")
            raise EngineError(f"{self.kind} sampler is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        """Free the sampler (a chain frees its stages). Idempotent; a no-op for a consumed stage."""
        if self._ptr is None:
            return
        live = [c for c in self._attached if not c.closed]
        if live:
            raise EngineError("sampler is attached to a context as a backend sampler; detach it with "
                              "ctx.set_backend_sampler(seq_id, None) or close the context first")
        ptr, self._ptr = self._ptr, None
        self._lib.llama_sampler_free(ptr)

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<Sampler {self.kind}{' (closed)' if self._ptr is None else ''}>"

    # -- use -----------------------------------------------------------------------------------------

    def sample(self, ctx, idx: int) -> int:
        """Sample a token from output `idx` of the last decode and accept it into this sampler's state
        (upstream llama_sampler_sample semantics: do not accept() the returned token again). If a backend
        sampler already chose a token for that output, that token is returned and accepted."""
        h, c, lib, ffi = self._handle(), ctx._handle(), self._lib, self._ffi
        if not self.selects:
            raise EngineError(f"{self.kind} sampler cannot pick a token: end the chain with greedy, dist "
                              "or mirostat")
        # llama_sampler_sample aborts the process on an invalid index; check it here first.
        if (lib.llama_get_sampled_token_ith(c, idx) == -1
                and lib.llama_get_logits_ith(c, idx) == ffi.NULL
                and lib.llama_get_sampled_logits_ith(c, idx) == ffi.NULL
                and lib.llama_get_sampled_probs_ith(c, idx) == ffi.NULL):
            raise EngineError(f"no output {idx} in the last decode (was logits=True set for it?)")
        return int(lib.llama_sampler_sample(h, c, idx))

    def accept(self, token: int) -> None:
        """Feed a token into the sampler state (penalties, grammar) without sampling it, e.g. prompt
        tokens or tokens chosen elsewhere."""
        self._lib.llama_sampler_accept(self._handle(), token)

    def reset(self) -> None:
        self._lib.llama_sampler_reset(self._handle())

    def clone(self) -> "Sampler":
        """An independent copy with the same configuration and current state."""
        ptr = self._lib.llama_sampler_clone(self._handle())
        s = Sampler(ptr, self.kind, selects=self.selects, is_chain=self.is_chain, models=self._models)
        s.backend_ok = self.backend_ok
        return s

    @property
    def name(self) -> str:
        return self._ffi.string(self._lib.llama_sampler_name(self._handle())).decode()

    @property
    def n_stages(self) -> int:
        return int(self._lib.llama_sampler_chain_n(self._handle())) if self.is_chain else 1

    def perf(self) -> dict:
        """Chain timing: {"t_sample_ms", "n_sample"} (zeros when the chain was built with no_perf)."""
        if not self.is_chain:
            raise EngineError("perf() is only available on chains")
        d = self._lib.llama_perf_sampler(self._handle())
        return {"t_sample_ms": float(d.t_sample_ms), "n_sample": int(d.n_sample)}

    # -- constructors --------------------------------------------------------------------------------

    @classmethod
    def chain(cls, stages: Sequence["Sampler"], no_perf: bool = True) -> "Sampler":
        """A chain applying `stages` in order; the stages are moved into it (see module doc)."""
        ffi, lib = _ffi.load()
        for s in stages:
            s._handle()  # fail before creating anything if a stage is closed or already consumed
        params = lib.llama_sampler_chain_default_params()
        params.no_perf = bool(no_perf)
        models = [m for s in stages for m in s._models]
        chain = cls(lib.llama_sampler_chain_init(params), "chain", is_chain=True, models=models)
        for s in stages:
            lib.llama_sampler_chain_add(chain._ptr, s._ptr)
            s._ptr, s._consumed_by = None, chain
            for m in s._models:
                m._dependents.discard(s)
        chain.selects = any(s.selects for s in stages)
        chain.backend_ok = all(s.backend_ok for s in stages)
        chain.kind = "chain(" + ",".join(s.kind for s in stages) + ")"
        return chain

    @classmethod
    def _stage(cls, kind: str, fn: str, *args, models: Sequence = ()) -> "Sampler":
        _, lib = _ffi.load()
        return cls(getattr(lib, fn)(*args), kind, selects=kind in _SELECTORS, models=models)

    @classmethod
    def greedy(cls) -> "Sampler":
        return cls._stage("greedy", "llama_sampler_init_greedy")

    @classmethod
    def dist(cls, seed: int = DEFAULT_SEED) -> "Sampler":
        return cls._stage("dist", "llama_sampler_init_dist", seed & 0xFFFFFFFF)

    @classmethod
    def top_k(cls, k: int) -> "Sampler":
        return cls._stage("top_k", "llama_sampler_init_top_k", int(k))

    @classmethod
    def top_p(cls, p: float, min_keep: int = 1) -> "Sampler":
        return cls._stage("top_p", "llama_sampler_init_top_p", float(p), int(min_keep))

    @classmethod
    def min_p(cls, p: float, min_keep: int = 1) -> "Sampler":
        return cls._stage("min_p", "llama_sampler_init_min_p", float(p), int(min_keep))

    @classmethod
    def typical(cls, p: float, min_keep: int = 1) -> "Sampler":
        return cls._stage("typical", "llama_sampler_init_typical", float(p), int(min_keep))

    @classmethod
    def temp(cls, t: float) -> "Sampler":
        return cls._stage("temp", "llama_sampler_init_temp", float(t))

    @classmethod
    def temp_ext(cls, t: float, delta: float, exponent: float) -> "Sampler":
        return cls._stage("temp_ext", "llama_sampler_init_temp_ext", float(t), float(delta), float(exponent))

    @classmethod
    def top_n_sigma(cls, n: float) -> "Sampler":
        return cls._stage("top_n_sigma", "llama_sampler_init_top_n_sigma", float(n))

    @classmethod
    def xtc(cls, p: float, t: float, min_keep: int = 1, seed: int = DEFAULT_SEED) -> "Sampler":
        return cls._stage("xtc", "llama_sampler_init_xtc", float(p), float(t), int(min_keep), seed & 0xFFFFFFFF)

    @classmethod
    def mirostat(cls, n_vocab: int, seed: int, tau: float, eta: float, m: int = 100) -> "Sampler":
        return cls._stage("mirostat", "llama_sampler_init_mirostat", int(n_vocab), seed & 0xFFFFFFFF,
                          float(tau), float(eta), int(m))

    @classmethod
    def mirostat_v2(cls, seed: int, tau: float, eta: float) -> "Sampler":
        return cls._stage("mirostat_v2", "llama_sampler_init_mirostat_v2", seed & 0xFFFFFFFF, float(tau), float(eta))

    @classmethod
    def penalties(cls, last_n: int, repeat: float = 1.0, freq: float = 0.0, present: float = 0.0,
                  n_vocab: int = 0) -> "Sampler":
        """Repetition penalties over the last `last_n` accepted tokens (0 disables). Pass n_vocab for a
        chain used as a backend sampler: upstream's backend path needs it (and aborts without it)."""
        s = cls._stage("penalties", "llama_sampler_init_penalties", int(n_vocab), int(last_n),
                       float(repeat), float(freq), float(present))
        s.backend_ok = n_vocab > 0
        return s

    @classmethod
    def dry(cls, vocab, multiplier: float, base: float, allowed_length: int, last_n: int,
            breakers: Sequence[str] = ("\n", ":", '"', "*")) -> "Sampler":
        ffi, _ = _ffi.load()
        keep = [ffi.new("char[]", b.encode()) for b in breakers]
        arr = ffi.new("const char *[]", keep) if keep else ffi.NULL
        return cls._stage("dry", "llama_sampler_init_dry", vocab._handle(), float(multiplier), float(base),
                          int(allowed_length), int(last_n), arr, len(keep), models=[vocab.model])

    @classmethod
    def logit_bias(cls, n_vocab: int, biases: Mapping[int, float]) -> "Sampler":
        ffi, _ = _ffi.load()
        arr = ffi.new("llama_logit_bias[]", max(1, len(biases)))
        for i, (tok, bias) in enumerate(biases.items()):
            if not 0 <= int(tok) < n_vocab:
                raise EngineError(f"logit_bias token {tok} out of range [0, {n_vocab})")
            arr[i].token, arr[i].bias = int(tok), float(bias)
        return cls._stage("logit_bias", "llama_sampler_init_logit_bias", int(n_vocab), len(biases), arr)

    @classmethod
    def grammar(cls, vocab, gbnf: str, root: str = "root") -> "Sampler":
        """A GBNF grammar constraint; GrammarError carries upstream's parse error for invalid text."""
        from .model import backend_init

        backend_init()  # log routing must be on to capture the parser's error message
        ffi, lib = _ffi.load()
        mark = log.mark()
        ptr = lib.llama_sampler_init_grammar(vocab._handle(), gbnf.encode(), root.encode())
        if ptr == ffi.NULL:
            raise GrammarError("invalid GBNF grammar: " + log.reason_since(mark, "parse failed"))
        return cls(ptr, "grammar", models=[vocab.model])

    @classmethod
    def grammar_lazy(cls, vocab, gbnf: str, root: str = "root", trigger_patterns: Sequence[str] = (),
                     trigger_tokens: Sequence[int] = ()) -> "Sampler":
        """A grammar that activates only once a trigger pattern/token appears (tool calls)."""
        from .model import backend_init

        backend_init()
        ffi, lib = _ffi.load()
        keep = [ffi.new("char[]", p.encode()) for p in trigger_patterns]
        pats = ffi.new("const char *[]", keep) if keep else ffi.NULL
        toks = ffi.new("llama_token[]", list(trigger_tokens)) if trigger_tokens else ffi.NULL
        mark = log.mark()
        ptr = lib.llama_sampler_init_grammar_lazy_patterns(vocab._handle(), gbnf.encode(), root.encode(),
                                                           pats, len(keep), toks, len(trigger_tokens))
        if ptr == ffi.NULL:
            raise GrammarError("invalid GBNF grammar: " + log.reason_since(mark, "parse failed"))
        return cls(ptr, "grammar", models=[vocab.model])
