"""Wire schemas: every JSON name the server reads or writes, as pydantic models (llama-server's names).

Requests are validated strictly (a string is not a number, a number is not a bool, as in llama-server's
nlohmann::json reads) and unknown fields are ignored, like upstream. A field sent as null means "use the
default". Responses are built with `model_construct` (no re-validation on the hot path) and serialized with
`dump()`; optional members that upstream omits when absent carry `exclude_if=_none`.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1


def _none(v: Any) -> bool:
    return v is None


def Opt(**kw: Any) -> Any:
    """An optional response member that is left out of the JSON when None (as upstream omits it)."""
    return Field(None, exclude_if=_none, **kw)


def dump(model: BaseModel) -> bytes:
    """Serialize a response model to JSON bytes (pydantic-core writes bytes directly)."""
    return model.__pydantic_serializer__.to_json(model, warnings=False)


def dump_list(models: list[BaseModel]) -> bytes:
    """Serialize a bare JSON array of response models."""
    return b"[" + b",".join(dump(m) for m in models) + b"]"


# ---- requests ------------------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None


class JsonSchemaSpec(_Request):
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: str | None = None
    json_schema: JsonSchemaSpec | None = None
    schema_: dict | None = Field(None, alias="schema")  # llama.cpp's json_object + schema form


# a prompt: text, token ids, or text and token ids mixed (llama.cpp native); a list of several prompts is
# recognised only to refuse it clearly
Prompt = Union[str, list[Union[int, str, list[int]]]]


class GenerationFields(_Request):
    """Fields shared by /completion, /v1/completions and /v1/chat/completions (llama.cpp accepts all on all)."""

    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n_predict: int | None = Field(None, ge=-1, le=INT32_MAX)
    max_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    n: int | None = None
    n_cmpl: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = Field(None, ge=0, le=INT32_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, Union[float, bool]] | list[list[Union[int, str, float, bool]]] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    grammar: str | None = None
    json_schema: dict | None = None
    n_probs: int | None = Field(None, ge=0, le=INT32_MAX)
    post_sampling_probs: bool | None = None
    cache_prompt: bool | None = None
    id_slot: int | None = None
    return_tokens: bool | None = None
    n_indent: int | None = Field(None, ge=0, le=INT32_MAX)
    timings_per_token: bool | None = None
    response_fields: list[str] | None = None
    # speculative decoding overrides, under llama-server's (dotted) JSON names
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", ge=0, le=INT32_MAX)
    speculative_n_min: int | None = Field(None, alias="speculative.n_min", ge=0, le=INT32_MAX)
    speculative_p_min: float | None = Field(None, alias="speculative.p_min", ge=0.0, le=1.0)


class CompletionRequest(GenerationFields):
    """POST /completion and /completions (llama.cpp native)."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)  # alias of n_probs, as upstream


class OAICompletionRequest(GenerationFields):
    """POST /v1/completions."""

    prompt: Prompt
    model: str | None = None
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # extra members (tool_calls, tool_call_id, name, reasoning_content...) go to the template untouched
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions (and /chat/completions)."""

    messages: list[ChatMessage]
    model: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ApplyTemplateRequest(_Request):
    messages: list[ChatMessage]
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    content: Prompt | None = None
    add_special: bool | None = None
    parse_special: bool | None = None
    with_pieces: bool | None = None


class DetokenizeRequest(_Request):
    tokens: list[int] | None = None


class EmbeddingRequestWire(_Request):
    input: str | list[str] | list[int] | list[list[int]] | None = None
    content: str | list[str] | list[int] | list[list[int]] | None = None  # llama.cpp native name
    model: str | None = None
    encoding_format: str | None = None


# ---- responses: errors and small ones ---------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="null")


class ErrorBody(_Response):
    code: int
    message: str
    type: str
    n_prompt_tokens: int | None = Opt()
    n_ctx: int | None = Opt()


class ErrorResponse(_Response):
    error: ErrorBody


class HealthResponse(_Response):
    status: str = "ok"


class TokenPiece(_Response):
    id: int
    piece: str | list[int]


class TokenizeResponse(_Response):
    tokens: list[int] | list[TokenPiece]


class DetokenizeResponse(_Response):
    content: str


class ApplyTemplateResponse(_Response):
    prompt: str


class SuccessResponse(_Response):
    success: bool = True


# ---- responses: probabilities, timings, usage --------------------------------------------------------------------


class TopLogprob(_Response):
    id: int
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(_Response):
    id: int
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


class TopProb(_Response):
    id: int
    token: str
    bytes: list[int]
    prob: float


class TokenProbOut(_Response):
    """post_sampling_probs: probabilities instead of log-probabilities, as upstream names them."""

    id: int
    token: str
    bytes: list[int]
    prob: float
    top_probs: list[TopProb]


ProbsList = list[TokenLogprob] | list[TokenProbOut]


class LogprobsContent(_Response):
    content: ProbsList


class TimingsOut(_Response):
    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | None = Opt()  # only when the server speculates, as upstream
    draft_n_accepted: int | None = Opt()


class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    completion_tokens: int
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# ---- responses: llama.cpp native /completion ----------------------------------------------------------------------


class LogitBiasOut(_Response):
    bias: float
    token: int


class GenerationParamsOut(_Response):
    """The settings a completion ran with (`generation_settings`, and /props' defaults without the Opt ones)."""

    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repeat_last_n: int
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: list[str] | None = Opt()
    max_tokens: int
    n_predict: int
    ignore_eos: bool
    stream: bool
    logit_bias: list[LogitBiasOut] | None = Opt()
    n_probs: int
    grammar: str | None = Opt()
    timings_per_token: bool = False
    post_sampling_probs: bool = False
    backend_sampling: bool


class NativeChunk(_Response):
    index: int = 0
    content: str
    tokens: list[int]
    stop: bool = False
    id_slot: int
    tokens_predicted: int
    tokens_evaluated: int
    timings: TimingsOut | None = Opt()
    completion_probabilities: ProbsList | None = Opt()


class NativeFinal(_Response):
    index: int = 0
    content: str
    tokens: list[int]
    id_slot: int
    stop: bool = True
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: GenerationParamsOut
    prompt: str
    has_new_line: bool
    truncated: bool
    stop_type: Literal["none", "eos", "limit", "word"]
    stopping_word: str
    tokens_cached: int
    timings: TimingsOut
    completion_probabilities: ProbsList | None = Opt()


# ---- responses: OpenAI completions and chat ------------------------------------------------------------------------


class CompletionChoice(_Response):
    text: str
    index: int = 0
    logprobs: LogprobsContent | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    choices: list[CompletionChoice]
    created: int
    model: str
    system_fingerprint: str
    object: str = "text_completion"
    usage: Usage | None = Opt()
    id: str
    timings: TimingsOut | None = Opt()


class ChatMessageOut(_Response):
    role: str = "assistant"
    content: str | None
    tool_calls: list[dict] | None = Opt()


class ChatChoice(_Response):
    finish_reason: str
    index: int = 0
    message: ChatMessageOut
    logprobs: LogprobsContent | None = Opt()


class ChatCompletionResponse(_Response):
    choices: list[ChatChoice]
    created: int
    model: str
    system_fingerprint: str
    object: str = "chat.completion"
    usage: Usage
    id: str
    timings: TimingsOut | None = Opt()


class ChatDelta(_Response):
    role: str | None = Opt()
    content: str | None = None


class EmptyDelta(_Response):
    pass


class ChatChunkChoice(_Response):
    finish_reason: str | None = None
    index: int = 0
    delta: ChatDelta | EmptyDelta
    logprobs: LogprobsContent | None = Opt()


class ChatCompletionChunk(_Response):
    choices: list[ChatChunkChoice]
    created: int
    id: str
    model: str
    system_fingerprint: str
    object: str = "chat.completion.chunk"
    usage: Usage | None = Opt()
    timings: TimingsOut | None = Opt()


class StreamError(_Response):
    """An error after the stream started: sent as one SSE event, then the stream ends."""

    error: ErrorBody


# ---- responses: embeddings -----------------------------------------------------------------------------------------


class EmbeddingData(_Response):
    embedding: list[float] | str
    index: int
    object: str = "embedding"
    encoding_format: str | None = Opt()


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    model: str
    object: str = "list"
    usage: EmbeddingUsage
    data: list[EmbeddingData]


class NativeEmbedding(_Response):
    index: int
    embedding: list[list[float]]


# ---- responses: models, props, slots ---------------------------------------------------------------------------------


class ModelMeta(_Response):
    vocab_type: int | None = Opt()
    n_vocab: int
    n_ctx: int
    n_ctx_train: int
    n_embd: int
    n_params: int
    size: int
    ftype: str | None = Opt()


class ModelCard(_Response):
    id: str
    aliases: list[str]
    tags: list[str] = []
    object: str = "model"
    created: int
    owned_by: str = "llamacpp"
    meta: ModelMeta


class ModelDetails(_Response):
    parent_model: str = ""
    format: str = "gguf"
    family: str = ""
    families: list[str] = [""]
    parameter_size: str = ""
    quantization_level: str = ""


class OllamaModel(_Response):
    """The Ollama-style entry llama-server lists beside the OpenAI one (some clients read it)."""

    name: str
    model: str
    modified_at: str = ""
    size: str = ""
    digest: str = ""
    type: str = "model"
    description: str = ""
    tags: list[str] = [""]
    capabilities: list[str] = ["completion"]
    parameters: str = ""
    details: ModelDetails = ModelDetails()


class ModelsResponse(_Response):
    models: list[OllamaModel]
    object: str = "list"
    data: list[ModelCard]


class DefaultGenerationSettings(_Response):
    params: GenerationParamsOut
    n_ctx: int


class Modalities(_Response):
    vision: bool = False
    video: bool = False
    audio: bool = False


class PropsResponse(_Response):
    default_generation_settings: DefaultGenerationSettings
    total_slots: int
    model_alias: str
    model_path: str
    modalities: Modalities = Modalities()
    endpoint_slots: bool
    endpoint_props: bool
    endpoint_metrics: bool
    ui: bool = False
    chat_template: str
    bos_token: str
    eos_token: str
    build_info: str
    is_sleeping: bool = False


class SlotNextToken(_Response):
    has_next_token: bool
    has_new_line: bool = False
    n_remain: int = -1
    n_decoded: int


class SlotOut(_Response):
    id: int
    n_ctx: int
    speculative: bool = False
    is_processing: bool
    id_task: int | None = Opt()
    n_prompt_tokens: int | None = Opt()
    next_token: list[SlotNextToken] | None = Opt()
