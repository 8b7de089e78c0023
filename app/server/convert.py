"""Wire -> runtime: validated request models become token ids, SamplingParams and a GenerationRequest.

The rules follow llama-server's request schema (server-schema.cpp): `n_predict` wins over
`max_completion_tokens` over `max_tokens`; -1 means the server's -n; `n_probs` wins over `logprobs`;
out-of-range sampling values are clamped where upstream clamps them and refused where upstream refuses them;
`stop` may be a string or a list; `logit_bias` may be an OpenAI object or llama.cpp's list of pairs.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

from app.runtime.api import GenerationRequest, SamplingParams
from app.server.errors import ApiError
from app.server.schemas import (
    INT32_MAX,
    ApplyTemplateRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    OAICompletionRequest,
)
from app.server.state import ServerState
from app.server.templates import ChatTemplate, TemplateError

Tokenize = Callable[[str, bool, bool], list[int]]

DEFAULT_TOP_LOGPROBS = 20  # what llama-server reports when a chat request asks for logprobs without a count


# ---- prompts -------------------------------------------------------------------------------------------------


def prompt_text_size(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0


def tokenize_prompt(tokenize: Tokenize, prompt: Any) -> list[int]:
    """A prompt as llama.cpp takes it: text, token ids, or both mixed (BOS only before leading text)."""
    if isinstance(prompt, str):
        return tokenize(prompt, True, True)
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty")
    if any(isinstance(p, list) for p in prompt) or (len(prompt) > 1 and all(isinstance(p, str) for p in prompt)):
        if len(prompt) == 1:
            return tokenize_prompt(tokenize, prompt[0])
        raise ApiError(400, "several prompts in one request are not supported yet: send one request per prompt")
    tokens: list[int] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            tokens.extend(tokenize(p, i == 0, True))  # special tokens (BOS) only for text at the very start
        else:
            tokens.append(p)
    return tokens


# ---- sampling ------------------------------------------------------------------------------------------------


def _clamp(v: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, v))


def parse_logit_bias(raw: Any, n_vocab: int, tokenize: Tokenize) -> dict[int, float]:
    """OpenAI's {"token id or text": bias} or llama.cpp's [[token id or text, bias], ...]; false bans a token."""
    out: dict[int, float] = {}

    def bias_of(v: Any) -> float | None:
        if v is False:
            return -math.inf
        if isinstance(v, bool):  # `true` means nothing upstream: skipped
            return None
        return float(v) if isinstance(v, (int, float)) else None

    def add(key: Any, v: Any) -> None:
        bias = bias_of(v)
        if bias is None:
            return
        if isinstance(key, int) or (isinstance(key, str) and key.lstrip("-").isdigit()):
            tok = int(key)
            if 0 <= tok < n_vocab:
                out[tok] = bias
        elif isinstance(key, str):
            for tok in tokenize(key, False, False):
                out[tok] = bias

    if isinstance(raw, dict):
        for k, v in raw.items():
            add(k, v)
    elif isinstance(raw, list):
        for pair in raw:
            if isinstance(pair, list) and len(pair) == 2:
                add(pair[0], pair[1])
    return out


def stop_strings(raw: str | list[str] | None) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [raw] if raw else []
    return [s for s in raw if s]


def _structured(f: GenerationFields, grammar_wins: bool) -> tuple[str | None, dict | None]:
    """(grammar, json_schema) of a request: upstream lets `grammar` win on /completion if both are sent."""
    grammar = f.grammar or None
    schema = f.json_schema
    if schema is not None and grammar is not None and grammar_wins:
        schema = None
    if schema is not None and grammar is not None:
        raise ApiError(400, "Cannot use both json_schema and grammar")
    if schema is not None and not schema:
        schema = {"type": "object"}  # an empty schema means any JSON object
    return grammar, schema


def sampling_params(
    f: GenerationFields,
    state: ServerState,
    tokenize: Tokenize,
    *,
    n_probs: int = 0,
    grammar: str | None = None,
    json_schema: dict | None = None,
) -> SamplingParams:
    """The request's sampling settings over the server's defaults (-temp, --top-k ... on the command line)."""
    base: SamplingParams = state.settings.runtime.sampling or SamplingParams()
    http = state.settings.http
    if grammar is None and json_schema is None:
        grammar, json_schema = http.grammar, http.json_schema
    seed = base.seed if f.seed is None else f.seed & 0xFFFFFFFF
    n_vocab = state.runtime.info.n_vocab
    return replace(
        base,
        temperature=base.temperature if f.temperature is None else _clamp(f.temperature, 0.0, math.inf),
        top_k=base.top_k if f.top_k is None else int(_clamp(f.top_k, 0, INT32_MAX)),
        top_p=base.top_p if f.top_p is None else _clamp(f.top_p, 0.0, 1.0),
        min_p=base.min_p if f.min_p is None else _clamp(f.min_p, 0.0, 1.0),
        typical_p=base.typical_p if f.typical_p is None else f.typical_p,
        repeat_penalty=base.repeat_penalty if f.repeat_penalty is None else f.repeat_penalty,
        repeat_last_n=base.repeat_last_n if f.repeat_last_n is None else f.repeat_last_n,
        presence_penalty=base.presence_penalty if f.presence_penalty is None else f.presence_penalty,
        frequency_penalty=base.frequency_penalty if f.frequency_penalty is None else f.frequency_penalty,
        seed=None if seed == 0xFFFFFFFF else seed,
        logit_bias=dict(base.logit_bias) if f.logit_bias is None else parse_logit_bias(f.logit_bias, n_vocab,
                                                                                        tokenize),
        grammar=grammar,
        json_schema=json_schema,
        n_probs=min(n_probs, n_vocab),
        ignore_eos=base.ignore_eos if f.ignore_eos is None else f.ignore_eos,
    )


def _n_predict(f: GenerationFields, server_default: int) -> int:
    for v in (f.n_predict, f.max_completion_tokens, f.max_tokens):
        if v is not None:
            return server_default if v == -1 else v  # -1 per request means "the server's -n"
    return server_default


def _check_n(f: GenerationFields) -> None:
    n = f.n_cmpl if f.n_cmpl is not None else f.n
    if n is not None and n != 1:
        raise ApiError(400, f"'n' must be 1: this server returns one choice per request (got {n})")


def generation_request(
    f: GenerationFields,
    prompt: list[int],
    state: ServerState,
    tokenize: Tokenize,
    *,
    n_probs: int = 0,
    grammar: str | None = None,
    json_schema: dict | None = None,
) -> GenerationRequest:
    _check_n(f)
    rs = state.settings.runtime
    return GenerationRequest(
        prompt=prompt,
        sampling=sampling_params(f, state, tokenize, n_probs=n_probs, grammar=grammar, json_schema=json_schema),
        n_predict=_n_predict(f, rs.n_predict),
        stop=stop_strings(f.stop),
        cache_prompt=rs.cache_prompt if f.cache_prompt is None else f.cache_prompt,
        id_slot=-1 if f.id_slot is None else f.id_slot,
        return_tokens=bool(f.return_tokens),
        n_indent=f.n_indent or 0,
        spec_n_max=f.speculative_n_max, spec_n_min=f.speculative_n_min, spec_p_min=f.speculative_p_min,
    )


# ---- the three generation endpoints ------------------------------------------------------------------------------


async def completion_request(req: CompletionRequest | OAICompletionRequest, state: ServerState) -> GenerationRequest:
    """/completion, /completions and /v1/completions."""
    if isinstance(req, OAICompletionRequest) and req.echo:
        raise ApiError(400, "'echo' is not supported: only completions without the prompt echoed")
    rt = state.runtime
    tokens = await state.offload(tokenize_prompt, rt.tokenize, req.prompt, size=prompt_text_size(req.prompt))
    n_probs = req.n_probs if req.n_probs is not None else (req.logprobs or 0)
    grammar, schema = _structured(req, grammar_wins=True)
    return generation_request(req, tokens, state, rt.tokenize, n_probs=n_probs, grammar=grammar,
                              json_schema=schema)


def chat_messages(req: ChatCompletionRequest | ApplyTemplateRequest, jinja: bool) -> list[dict]:
    """Validated messages as plain dicts for the template (extra members such as tool_calls kept)."""
    if not req.messages:
        raise ApiError(400, "'messages' must not be empty")
    if req.tools and not jinja:
        raise ApiError(400, "tools param requires --jinja flag")
    out = []
    for i, m in enumerate(req.messages):
        has_content = "content" in m.model_fields_set
        if m.role != "assistant" and not has_content:
            raise ApiError(400, f"'messages.{i}': all non-assistant messages must contain 'content'")
        if m.role == "assistant" and not has_content and not (m.model_extra or {}).get("tool_calls"):
            raise ApiError(400, f"'messages.{i}': an assistant message must contain 'content' or 'tool_calls'")
        out.append(m.model_dump(exclude_unset=True))
    return out


def render_chat(template: ChatTemplate, req: ChatCompletionRequest | ApplyTemplateRequest, jinja: bool) -> str:
    messages = chat_messages(req, jinja)
    add_gen = True if req.add_generation_prompt is None else req.add_generation_prompt
    try:
        return template.render(messages, add_generation_prompt=add_gen, tools=req.tools,
                               kwargs=req.chat_template_kwargs)
    except TemplateError as e:
        raise ApiError(400, str(e)) from None


def _chat_structured(req: ChatCompletionRequest) -> tuple[str | None, dict | None]:
    grammar, schema = _structured(req, grammar_wins=False)
    rf = req.response_format
    if rf is not None and rf.type not in (None, "", "text"):
        if rf.type == "json_object":
            if rf.schema_ is not None or schema is None:
                schema = rf.schema_ or {}
        elif rf.type == "json_schema":
            schema = (rf.json_schema.schema_ if rf.json_schema else None) or {}
        else:
            raise ApiError(400, "response_format type must be one of \"text\", \"json_object\" or \"json_schema\", "
                                f"but got: {rf.type}")
        if not schema:
            schema = {"type": "object"}
        if grammar is not None:
            raise ApiError(400, "Cannot use both json_schema and grammar")
    return grammar, schema


def chat_n_probs(req: ChatCompletionRequest) -> tuple[int, int]:
    """(n_probs to ask the runtime for, top_logprobs to report): OpenAI's top_logprobs may be 0."""
    if req.logprobs:
        top = DEFAULT_TOP_LOGPROBS if req.top_logprobs is None else req.top_logprobs
        return max(top, 1), top
    if req.top_logprobs is not None:
        raise ApiError(400, "top_logprobs requires logprobs to be set to true")
    n = req.n_probs or 0
    return n, n


async def chat_request(req: ChatCompletionRequest, state: ServerState) -> tuple[GenerationRequest, int]:
    """/v1/chat/completions: template, tokenize, sample settings. Returns the request and top_logprobs."""
    if state.template is None:
        raise ApiError(503, "Loading model", retry_after_s=1)
    jinja = state.settings.http.jinja
    size = sum(len(m.content) if isinstance(m.content, str) else 64 for m in req.messages)
    text = await state.offload(render_chat, state.template, req, jinja, size=size)
    rt = state.runtime
    tokens = await state.offload(rt.tokenize, text, True, True, size=len(text))
    n_probs, top = chat_n_probs(req)
    grammar, schema = _chat_structured(req)
    gen = generation_request(req, tokens, state, rt.tokenize, n_probs=n_probs, grammar=grammar, json_schema=schema)
    if getattr(rt, "needs_checkpoints", False):
        gen.user_starts = await state.offload(user_message_starts, state.template, req, jinja, text, rt.tokenize,
                                              size=len(text) * 4)
    return gen, top


def user_message_starts(template: ChatTemplate, req: ChatCompletionRequest, jinja: bool, text: str,
                        tokenize: Tokenize) -> list[int]:
    """Token positions where the user messages after the first begin: where the runtime checkpoints a model
    whose memory can't be cut, so the next turn of the conversation resumes from there.

    Each position is the token count of the conversation rendered up to that message; a template whose
    shorter renderings are not prefixes of the full one gives no positions (no boundary checkpoints).
    """
    messages = chat_messages(req, jinja)
    starts = []
    for k in range(1, len(messages)):
        if messages[k].get("role") != "user":
            continue
        try:
            prefix = template.render(messages[:k], add_generation_prompt=False, tools=req.tools,
                                     kwargs=req.chat_template_kwargs)
        except TemplateError:
            return []
        if not text.startswith(prefix):
            return []
        starts.append(len(tokenize(prefix, True, True)))
    return starts
