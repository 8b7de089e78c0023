"""Runtime -> wire: TextDelta/Finished events become llama-server's response objects, streamed or whole.

One `ResponseFormat` per endpoint family (llama.cpp native, OpenAI completions, OpenAI chat). Each answers
three questions: the chunks for one TextDelta, the closing chunks for the Finished event, and the whole
response for a non-streamed request. The streamed chunks concatenate to exactly the non-streamed text
because both come from the same TextDelta events.
"""

from __future__ import annotations

import json
import math
import secrets
import string
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from app.runtime.api import Finished, FinishReason, GenerationRequest, TextDelta, Timings, TokenProb
from app.server import schemas as S
from app.server.state import ServerState, build_info

LOWEST_FLOAT = -3.4028234663852886e38  # what upstream reports instead of log(0), which JSON cannot carry
_ID_ALPHABET = string.digits + string.ascii_letters


def completion_id() -> str:
    return "chatcmpl-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(32))


# ---- shared pieces -------------------------------------------------------------------------------------------


def timings_out(t: Timings) -> S.TimingsOut:
    """llama-server's timings object; per-token and per-second figures are 0 where nothing was timed."""
    return S.TimingsOut.model_construct(
        cache_n=t.n_cached,
        prompt_n=t.n_prompt,
        prompt_ms=t.t_prompt_ms,
        prompt_per_token_ms=t.t_prompt_ms / t.n_prompt if t.n_prompt > 0 else 0.0,
        prompt_per_second=1e3 / t.t_prompt_ms * t.n_prompt if t.t_prompt_ms > 0 else 0.0,
        predicted_n=t.n_predicted,
        predicted_ms=t.t_predicted_ms,
        predicted_per_token_ms=t.t_predicted_ms / t.n_predicted if t.n_predicted > 0 else 0.0,
        predicted_per_second=1e3 / t.t_predicted_ms * t.n_predicted if t.t_predicted_ms > 0 else 0.0,
        draft_n=getattr(t, "n_draft", None),
        draft_n_accepted=getattr(t, "n_draft_accepted", None),
    )


def usage_out(fin: Finished) -> S.Usage:
    n_prompt, n_gen = fin.n_prompt_tokens, fin.timings.n_predicted
    return S.Usage.model_construct(
        completion_tokens=n_gen, prompt_tokens=n_prompt, total_tokens=n_prompt + n_gen,
        prompt_tokens_details=S.PromptTokensDetails.model_construct(cached_tokens=fin.timings.n_cached),
    )


def _logprob(x: float) -> float:
    return x if math.isfinite(x) else LOWEST_FLOAT


def probs_out(probs: list[TokenProb], n_top: int, post_sampling: bool) -> list[Any]:
    """Per generated token: its log-probability (or probability) and its top alternatives."""
    out: list[Any] = []
    for p in probs:
        top = p.top[:n_top]
        if post_sampling:
            out.append(S.TokenProbOut.model_construct(
                id=p.token, token=p.text, bytes=list(p.text.encode()), prob=math.exp(p.logprob),
                top_probs=[S.TopProb.model_construct(id=t.token, token=t.text, bytes=list(t.text.encode()),
                                                     prob=math.exp(t.logprob)) for t in top]))
        else:
            out.append(S.TokenLogprob.model_construct(
                id=p.token, token=p.text, bytes=list(p.text.encode()), logprob=_logprob(p.logprob),
                top_logprobs=[S.TopLogprob.model_construct(id=t.token, token=t.text, bytes=list(t.text.encode()),
                                                           logprob=_logprob(t.logprob)) for t in top]))
    return out


def finish_reason(fin: Finished) -> str:
    return "stop" if fin.reason is FinishReason.STOP else "length"


def stop_type(fin: Finished) -> str:
    if fin.stopped_eos:
        return "eos"
    if fin.stopping_word:
        return "word"
    return "limit" if fin.reason is FinishReason.LENGTH else "none"


def generation_params(req: GenerationRequest, stream: bool, backend_sampling: bool, *, full: bool,
                      post_sampling: bool = False) -> S.GenerationParamsOut:
    sp = req.sampling
    return S.GenerationParamsOut.model_construct(
        seed=0xFFFFFFFF if sp.seed is None else sp.seed, temperature=sp.temperature, top_k=sp.top_k,
        top_p=sp.top_p, min_p=sp.min_p, typical_p=sp.typical_p, repeat_last_n=sp.repeat_last_n,
        repeat_penalty=sp.repeat_penalty, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, stop=list(req.stop) if full else None, max_tokens=req.n_predict,
        n_predict=req.n_predict, ignore_eos=sp.ignore_eos, stream=stream,
        logit_bias=[S.LogitBiasOut.model_construct(bias=_logprob(b), token=t) for t, b in sp.logit_bias.items()]
        if full else None,
        n_probs=sp.n_probs, grammar=(sp.grammar or "") if full else None, timings_per_token=False,
        post_sampling_probs=post_sampling, backend_sampling=backend_sampling,
    )


class Splice:
    """A streamed chunk serialized once with its text left open, so each later delta costs one string encode.

    The model is dumped with a marker in the text field; the bytes around the marker are kept and a delta's
    text is spliced in (JSON-encoded the way pydantic-core encodes it: UTF-8, minimal escapes).
    """

    MARK = "\x00splice\x00"

    def __init__(self, model: BaseModel):
        raw = b"data: " + S.dump(model) + b"\n\n"
        mark = json.dumps(self.MARK).encode()
        self.ok = raw.count(mark) == 1
        self.pre, _, self.post = raw.partition(mark)

    def fill(self, text: str) -> bytes:
        return self.pre + json.dumps(text, ensure_ascii=False).encode() + self.post


@dataclass
class Collected:
    """A non-streamed request's events, gathered."""

    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    probs: list[TokenProb] = field(default_factory=list)

    def add(self, d: TextDelta) -> None:
        if d.text:
            self.text.append(d.text)
        self.tokens.extend(d.tokens)
        if d.probs:
            self.probs.extend(d.probs)


# ---- the formats ----------------------------------------------------------------------------------------------


class ResponseFormat:
    """What one request's responses look like; subclasses per endpoint family."""

    sse_done: bytes | None = b"data: [DONE]\n\n"  # OpenAI streams end with it; llama.cpp's native one does not

    def __init__(self, state: ServerState, req: GenerationRequest, *, stream: bool, n_top: int | None = None,
                 post_sampling: bool = False, include_usage: bool = False):
        self.state = state
        self.req = req
        self.stream = stream
        self.n_top = req.sampling.n_probs if n_top is None else n_top  # chat's top_logprobs may be 0
        self.post_sampling = post_sampling
        self.include_usage = include_usage
        self.model = state.model_name
        self.id = completion_id()
        self.created = int(time.time())
        self.fingerprint = build_info()
        self.n_decoded = 0
        self.id_slot = -1

    def chunks(self, d: TextDelta) -> list[BaseModel | bytes]:
        """The SSE chunks for one delta: models, or bytes already framed as an SSE event."""
        raise NotImplementedError

    def final_chunks(self, fin: Finished) -> list[BaseModel]:
        raise NotImplementedError

    def response(self, c: Collected, fin: Finished) -> BaseModel | bytes:
        raise NotImplementedError

    def _probs(self, probs: list[TokenProb] | None) -> list[Any] | None:
        return probs_out(probs, self.n_top, self.post_sampling) if probs and self.req.sampling.n_probs else None


class NativeFormat(ResponseFormat):
    """POST /completion: llama.cpp's own fields."""

    sse_done = None

    def __init__(self, *a: Any, response_fields: list[str] | None = None, **kw: Any):
        super().__init__(*a, **kw)
        self.response_fields = response_fields

    def chunks(self, d: TextDelta) -> list[BaseModel | bytes]:
        self.n_decoded += len(d.tokens)
        return [S.NativeChunk.model_construct(
            index=0, content=d.text, tokens=list(d.tokens), stop=False, id_slot=self.id_slot,
            tokens_predicted=self.n_decoded, tokens_evaluated=len(self.req.prompt), timings=None,
            completion_probabilities=self._probs(d.probs))]

    def final_chunks(self, fin: Finished) -> list[BaseModel]:
        return [self._final(Collected(), fin)]

    def _final(self, c: Collected, fin: Finished) -> S.NativeFinal:
        rt = self.state.runtime
        content = "".join(c.text)
        return S.NativeFinal.model_construct(
            index=0, content=content, tokens=c.tokens if self.req.return_tokens else [], id_slot=fin.id_slot,
            stop=True, model=self.model, tokens_predicted=fin.timings.n_predicted,
            tokens_evaluated=fin.n_prompt_tokens,
            generation_settings=generation_params(self.req, self.stream, self.state.settings.runtime.backend_sampling,
                                                  full=True, post_sampling=self.post_sampling),
            prompt=rt.detokenize(self.req.prompt), has_new_line="\n" in content, truncated=fin.truncated,
            stop_type=stop_type(fin), stopping_word=fin.stopping_word,
            tokens_cached=fin.n_prompt_tokens + fin.timings.n_predicted, timings=timings_out(fin.timings),
            completion_probabilities=self._probs(c.probs))

    def response(self, c: Collected, fin: Finished) -> BaseModel | bytes:
        final = self._final(c, fin)
        if not self.response_fields:
            return final
        return json.dumps(_pick(final.model_dump(mode="json", exclude_none=False), self.response_fields)).encode()


def _pick(doc: dict, paths: list[str]) -> dict:
    """llama-server's response_fields: keep these (slash-separated) paths, each flattened to the top level."""
    out = {}
    for path in paths:
        cur: Any = doc
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


class OAICompletionFormat(ResponseFormat):
    """POST /v1/completions."""

    _splice: Splice | None = None

    def _envelope(self, choice: S.CompletionChoice, usage: S.Usage | None = None,
                  timings: S.TimingsOut | None = None) -> S.CompletionResponse:
        return S.CompletionResponse.model_construct(
            choices=[choice], created=self.created, model=self.model, system_fingerprint=self.fingerprint,
            object="text_completion", usage=usage, id=self.id, timings=timings)

    def _logprobs(self, probs: list[TokenProb] | None) -> S.LogprobsContent | None:
        out = self._probs(probs)
        return S.LogprobsContent.model_construct(content=out) if out else None

    def _text_chunk(self, text: str, probs: list[TokenProb] | None) -> S.CompletionResponse:
        return self._envelope(S.CompletionChoice.model_construct(
            text=text, index=0, logprobs=self._logprobs(probs), finish_reason=None))

    def chunks(self, d: TextDelta) -> list[BaseModel | bytes]:
        if d.probs:
            return [self._text_chunk(d.text, d.probs)]
        if self._splice is None:
            self._splice = Splice(self._text_chunk(Splice.MARK, None))
        return [self._splice.fill(d.text)] if self._splice.ok else [self._text_chunk(d.text, None)]

    def final_chunks(self, fin: Finished) -> list[BaseModel]:
        return [self.response(Collected(), fin)]

    def response(self, c: Collected, fin: Finished) -> BaseModel:
        choice = S.CompletionChoice.model_construct(
            text="".join(c.text), index=0, logprobs=self._logprobs(c.probs), finish_reason=finish_reason(fin))
        return self._envelope(choice, usage_out(fin), timings_out(fin.timings))


class ChatFormat(ResponseFormat):
    """POST /v1/chat/completions."""

    _splice: Splice | None = None

    def _chunk(self, choices: list[S.ChatChunkChoice], **kw: Any) -> S.ChatCompletionChunk:
        return S.ChatCompletionChunk.model_construct(
            choices=choices, created=self.created, id=self.id, model=self.model,
            system_fingerprint=self.fingerprint, object="chat.completion.chunk", usage=kw.get("usage"),
            timings=kw.get("timings"))

    def _logprobs(self, probs: list[TokenProb] | None) -> S.LogprobsContent | None:
        out = self._probs(probs)
        return S.LogprobsContent.model_construct(content=out) if out else None

    def role_chunk(self) -> S.ChatCompletionChunk:
        # OpenAI opens every chat stream with the role and a null content
        return self._chunk([S.ChatChunkChoice.model_construct(
            finish_reason=None, index=0, delta=S.ChatDelta.model_construct(role="assistant", content=None),
            logprobs=None)])

    def _text_chunk(self, text: str, probs: list[TokenProb] | None) -> S.ChatCompletionChunk:
        return self._chunk([S.ChatChunkChoice.model_construct(
            finish_reason=None, index=0, delta=S.ChatDelta.model_construct(role=None, content=text),
            logprobs=self._logprobs(probs))])

    def chunks(self, d: TextDelta) -> list[BaseModel | bytes]:
        out: list[BaseModel | bytes] = []
        if self.n_decoded == 0:
            out.append(self.role_chunk())
        self.n_decoded += max(len(d.tokens), 1)
        if d.probs:
            out.append(self._text_chunk(d.text, d.probs))
        elif d.text:
            if self._splice is None:
                self._splice = Splice(self._text_chunk(Splice.MARK, None))
            out.append(self._splice.fill(d.text) if self._splice.ok else self._text_chunk(d.text, None))
        return out

    def final_chunks(self, fin: Finished) -> list[BaseModel]:
        out: list[BaseModel] = []
        if self.n_decoded == 0:
            out.append(self.role_chunk())
        out.append(self._chunk([S.ChatChunkChoice.model_construct(
            finish_reason=finish_reason(fin), index=0, delta=S.EmptyDelta(), logprobs=None)]))
        if self.include_usage:
            # OpenAI: the usage chunk comes last, with an empty choices list
            out.append(self._chunk([], usage=usage_out(fin)))
        out[-1].timings = timings_out(fin.timings)
        return out

    def response(self, c: Collected, fin: Finished) -> BaseModel:
        choice = S.ChatChoice.model_construct(
            finish_reason=finish_reason(fin), index=0,
            message=S.ChatMessageOut.model_construct(role="assistant", content="".join(c.text), tool_calls=None),
            logprobs=self._logprobs(c.probs))
        return S.ChatCompletionResponse.model_construct(
            choices=[choice], created=self.created, model=self.model, system_fingerprint=self.fingerprint,
            object="chat.completion", usage=usage_out(fin), id=self.id, timings=timings_out(fin.timings))
