"""Utility and introspection endpoints: health, models, props, slots, metrics, tokenize, detokenize,
apply-template. Shapes follow llama-server's; none of them touches the engine thread.
"""

from __future__ import annotations

import json
import time

from aiohttp import web

from app.engine import EngineError
from app.runtime.api import GenerationRequest, InvalidRequest
from app.server import convert, metrics
from app.server.errors import NOT_SUPPORTED, UNAVAILABLE, ApiError
from app.server.formats import generation_params
from app.server.handlers import parse_body
from app.server.schemas import (
    ApplyTemplateRequest,
    ApplyTemplateResponse,
    DefaultGenerationSettings,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelMeta,
    ModelsResponse,
    OllamaModel,
    PropsResponse,
    SlotNextToken,
    SlotOut,
    SuccessResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenPiece,
    dump_list,
)
from app.server.sse import json_response
from app.server.state import ServerState, build_info, get_state


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 once the model is loaded (the gate answers 503 before that)."""
    return json_response(HealthResponse())


def _model_card(state: ServerState) -> ModelCard:
    info = state.runtime.info
    return ModelCard.model_construct(
        id=state.model_name, aliases=state.aliases, tags=[], object="model", created=int(time.time()),
        owned_by="llamacpp",
        meta=ModelMeta.model_construct(
            vocab_type=getattr(info, "vocab_type", None), n_vocab=info.n_vocab, n_ctx=info.n_ctx_slot,
            n_ctx_train=info.n_ctx_train, n_embd=info.n_embd, n_params=info.n_params, size=info.size,
            ftype=getattr(info, "ftype", None)))


async def models(request: web.Request) -> web.Response:
    """GET /v1/models and /models."""
    state = get_state(request)
    name = state.model_name
    return json_response(ModelsResponse.model_construct(
        models=[OllamaModel(name=name, model=name)], object="list", data=[_model_card(state)]))


async def props(request: web.Request) -> web.Response:
    """GET /props: server-wide defaults and facts about the model."""
    state = get_state(request)
    rs, http, info = state.settings.runtime, state.settings.http, state.runtime.info
    defaults = GenerationRequest(prompt=[], sampling=rs.sampling, n_predict=rs.n_predict)
    return json_response(PropsResponse.model_construct(
        default_generation_settings=DefaultGenerationSettings.model_construct(
            params=generation_params(defaults, False, rs.backend_sampling, full=False), n_ctx=info.n_ctx_slot),
        total_slots=info.n_slots, model_alias=state.model_name, model_path=state.settings.model.path or "",
        endpoint_slots=http.slots, endpoint_props=http.props, endpoint_metrics=http.metrics, ui=False,
        chat_template=state.template.source if state.template else "", bos_token=info.bos_text,
        eos_token=info.eos_text, build_info=build_info(), is_sleeping=False))


async def set_props(request: web.Request) -> web.Response:
    """POST /props: accepted with --props (nothing is changeable yet, as upstream)."""
    if not get_state(request).settings.http.props:
        raise ApiError(501, "changing properties is off on this server: start it with --props", NOT_SUPPORTED)
    return json_response(SuccessResponse())


async def slots(request: web.Request) -> web.Response:
    """GET /slots: what each slot holds and does."""
    state = get_state(request)
    if not state.settings.http.slots:
        raise ApiError(501, "the slots endpoint is off on this server: start it with --slots", NOT_SUPPORTED)
    infos = state.runtime.slots()
    if "fail_on_no_slot" in request.query and not any(s.state == "idle" for s in infos):
        raise ApiError(503, "no slot available", UNAVAILABLE, retry_after_s=1)
    out = []
    for s in infos:
        busy = s.state != "idle"
        out.append(SlotOut.model_construct(
            id=s.id, n_ctx=s.n_ctx, speculative=False, is_processing=busy, id_task=s.id_task,
            n_prompt_tokens=s.n_cached if s.id_task is not None else None,
            next_token=[SlotNextToken.model_construct(has_next_token=s.state == "generating", has_new_line=False,
                                                      n_remain=-1, n_decoded=s.n_decoded)]
            if s.id_task is not None else None))
    return json_response(dump_list(out))


async def slot_action(request: web.Request) -> web.Response:
    """POST /slots/{id_slot}?action=save|restore|erase."""
    state = get_state(request)
    if not state.settings.runtime.slot_save_path:
        raise ApiError(501, "slot actions are off on this server: start it with --slot-save-path", NOT_SUPPORTED)
    action = request.query.get("action")
    if action not in ("save", "restore", "erase"):
        raise ApiError(400, "Invalid action")
    try:
        id_slot = int(request.match_info["id_slot"])
    except ValueError:
        raise ApiError(400, "Invalid slot ID") from None
    actions = state.runtime.slot_actions()
    try:
        if action == "erase":
            return web.json_response(await actions.erase(id_slot))
        try:
            body = json.loads(await request.read() or b"{}")
        except json.JSONDecodeError:
            raise ApiError(400, "the body is not valid JSON: send {\"filename\": \"NAME\"}") from None
        filename = body.get("filename") if isinstance(body, dict) else None
        if action == "save":
            return web.json_response(await actions.save(id_slot, filename))
        return web.json_response(await actions.restore(id_slot, filename))
    except FileNotFoundError:
        raise ApiError(400, f"no saved slot named {filename!r} in the slot save path") from None
    except (ValueError, EngineError, InvalidRequest) as e:  # bad names, bad files (SlotFileError), busy slots, refused states
        raise ApiError(400, f"Unable to {action} slot: {e}") from None


async def metrics_endpoint(request: web.Request) -> web.Response:
    """GET /metrics (with --metrics)."""
    state = get_state(request)
    if not state.settings.http.metrics:
        raise ApiError(501, "metrics are off on this server: start it with --metrics", NOT_SUPPORTED)
    return web.Response(body=metrics.render(state), headers={
        "Content-Type": metrics.CONTENT_TYPE, "Process-Start-Time-Unix": str(int(state.started_at))})


def _piece(rt, token: int) -> str | list[int]:
    """A token's text, or its bytes when they are not valid UTF-8 on their own (part of a character)."""
    raw = rt.token_bytes(token) if hasattr(rt, "token_bytes") else rt.token_piece(token).encode()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize: text (or text mixed with ids) to token ids, optionally with each token's piece."""
    state = get_state(request)
    req = await parse_body(request, TokenizeRequest)
    if req.content is None:
        return json_response(TokenizeResponse.model_construct(tokens=[]))
    rt = state.runtime
    add_special = bool(req.add_special)
    parse_special = True if req.parse_special is None else req.parse_special

    def run() -> list[int]:
        if isinstance(req.content, str):
            return rt.tokenize(req.content, add_special, parse_special)
        out: list[int] = []
        for i, p in enumerate(req.content):
            if isinstance(p, str):
                out.extend(rt.tokenize(p, add_special and i == 0, parse_special))
            else:
                out.extend(p if isinstance(p, list) else [p])
        return out

    tokens = await state.offload(run, size=convert.prompt_text_size(req.content))
    if req.with_pieces:
        pieces = [TokenPiece.model_construct(id=t, piece=_piece(rt, t)) for t in tokens]
        return json_response(TokenizeResponse.model_construct(tokens=pieces))
    return json_response(TokenizeResponse.model_construct(tokens=tokens))


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: token ids back to text."""
    state = get_state(request)
    req = await parse_body(request, DetokenizeRequest)
    tokens = req.tokens or []
    n_vocab = state.runtime.info.n_vocab
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise ApiError(400, f"'tokens': {bad[0]} is not a token id of this model (0..{n_vocab - 1})")
    text = await state.offload(state.runtime.detokenize, tokens, size=len(tokens) * 4)
    return json_response(DetokenizeResponse.model_construct(content=text))


async def apply_template(request: web.Request) -> web.Response:
    """POST /apply-template: the prompt a chat request would run, without running it."""
    state = get_state(request)
    req = await parse_body(request, ApplyTemplateRequest)
    size = sum(len(m.content) if isinstance(m.content, str) else 64 for m in req.messages)
    text = await state.offload(convert.render_chat, state.template, req, state.settings.http.jinja, size=size)
    return json_response(ApplyTemplateResponse.model_construct(prompt=text))
