"""The OpenAI request and response bodies of ``z2all serve``, as pydantic models, and the API's error shape.

The request models validate what a client sends (after ``null`` fields are dropped: OpenAI's rule is that a field
sent as ``null`` is absent); :func:`validation_error` turns pydantic's first complaint into the API's error, a 400
whose ``param`` names the field at fault (``messages[2].content``) and whose message says what the field must be and
what it got. The response models are the shapes the server writes (it builds plain dicts for speed; the tests check
them against these models) and, with the requests, make ``/openapi.json`` (:func:`openapi`).

Types are strict: ``"1"`` is not a number and ``true`` is not 1; a number must be finite (``NaN`` and ``Infinity``,
which Python's JSON reader accepts, are refused).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.json_schema import models_json_schema

from zero2all.data.tools import TOOL_NAME, call_arguments


class RequestError(Exception):
    """An API error: the HTTP status and OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def show(value) -> str:
    """A request value for an error message, cut short (a 4000-digit integer would flood the message)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- requests -----------------------------------------------------------------------------------------------------

FINITE = {"allow_inf_nan": False}


class _Request(BaseModel):
    """The fields both endpoints share, in the order they are checked (the first error is the one reported)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = Field(description="the model id (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="most tokens to generate (default: the server's "
                                                           "default, cut to what the prompt leaves of the context)")
    stop: str | list[str] | None = Field(None, description="up to 4 strings that end the text (not included)")
    n: int | None = Field(None, description="only 1")
    stream: bool | None = Field(None, description="server-sent events, one chunk per generated piece")
    logprobs: Any = Field(None, description="not supported")
    top_logprobs: Any = Field(None, description="not supported")
    functions: list | None = Field(None, description="not supported (an empty list is accepted)")
    response_format: dict | None = Field(None, description='{"type": "text"} (the default), {"type": "json_object"} '
                                         '(any JSON object) or {"type": "json_schema", "json_schema": {"name", '
                                         '"schema", "strict"}}: the output is constrained to the format')
    seed: int | None = Field(None, description="a 64-bit integer: the same request gives the same text")
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2, **FINITE)
    top_p: float | None = Field(None, gt=0, le=1, **FINITE)
    top_k: int | None = Field(None, ge=0, description="an extension: sample among the k likeliest (0: all)")
    repetition_penalty: float | None = Field(None, gt=0, **FINITE, description="an extension (1: none)")
    ignore_eos: bool | None = Field(None, description="an extension: generate through stop tokens up to max_tokens")
    fit_context: bool | None = Field(None, description="an extension: an explicit max_tokens is an upper bound, cut "
                                                       "to what the prompt leaves of the context")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or len(v) > 4 or any(not isinstance(s, str) or not s for s in v):
            raise ValueError("'stop' must be a non-empty string or a list of up to 4 of them")
        return v

    @field_validator("n", mode="before")
    @classmethod
    def _n(cls, v):
        if v != 1 or isinstance(v, bool):
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("logprobs", "top_logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v):
        if v is not False:
            raise ValueError("logprobs are not supported by this server")
        return v

    @field_validator("functions", mode="before")
    @classmethod
    def _functions(cls, v):
        if v:  # silently ignored, a client would wait for function calls that never come
            raise ValueError("'functions' (the deprecated form) is not supported by this server: send 'tools'")
        return v

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, v):
        check_response_format(v)
        return v

    @field_validator("seed", mode="before")
    @classmethod
    def _seed(cls, v):
        if not isinstance(v, int) or isinstance(v, bool) or not -(1 << 63) <= v < (1 << 64):
            raise ValueError(f"'seed' must be a 64-bit integer, got {show(v)}")
        return v


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def check_response_format(v) -> None:
    """OpenAI's ``response_format`` shapes (ValueError otherwise); whether a schema compiles is seen later."""
    if not isinstance(v, dict) or v.get("type") not in RESPONSE_FORMATS:
        raise ValueError(f"'response_format' must be an object whose 'type' is one of {list(RESPONSE_FORMATS)}, "
                         f"got {show(v)}")
    if v["type"] != "json_schema":
        return
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("'response_format' of type json_schema needs 'json_schema': {\"name\", \"schema\", "
                         f"\"strict\"}}, got {show(spec)}")
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise ValueError(f"'response_format.json_schema.name' must be a string of 1-64 characters, got {show(name)}")
    if not isinstance(spec.get("schema", {}), (dict, bool)):
        raise ValueError(f"'response_format.json_schema.schema' must be a JSON schema (an object), got "
                         f"{show(spec.get('schema'))}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError(f"'response_format.json_schema.strict' must be true or false, got {show(spec['strict'])}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = Field(None, description="a last chunk with the usage and no choices")


class CompletionRequest(_Request):
    """``POST /v1/completions``: each prompt starts a new document (the end-of-text separator goes in front)."""

    prompt: str | list[str] = Field(description="a string or a list of them (one sequence each)")
    tools: list | None = Field(None, description="not for completions (an empty list is accepted): use chat")

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, v):
        if v:
            raise ValueError("'tools' are for /v1/chat/completions, not /v1/completions")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        prompts = [v] if isinstance(v, str) else v
        if not isinstance(prompts, list) or not prompts or any(not isinstance(p, str) for p in prompts):
            raise ValueError("'prompt' must be a string or a non-empty list of strings")
        if any(not p for p in prompts):
            raise ValueError("'prompt' must not be empty")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"] = Field(
        description="developer is read as system; tool: a tool's result (with tool_call_id)")
    content: str | list[TextPart] | None = Field(None, description="null only for an assistant message with "
                                                                   "tool_calls")
    tool_calls: list[dict] | None = Field(None, description="an assistant message's calls: [{id, type: function, "
                                                            "function: {name, arguments: JSON text}}]")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        if v is None:
            return v
        if isinstance(v, list):  # [{"type": "text", "text": ...}, ...]
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in v):
                raise ValueError("only text parts are supported")
            return v
        if not isinstance(v, str):
            raise ValueError("must be a string")
        return v

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls(cls, v):
        if v is None:
            return v
        if not isinstance(v, list):
            raise ValueError("must be a list of tool calls")
        for i, call in enumerate(v):
            try:
                call_arguments(call)
            except ValueError as e:
                raise ValueError(f"[{i}]: {e}") from None
        return v

    @model_validator(mode="after")
    def _shape(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: must be a string (null only for an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has tool calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(description="letters, digits, _ and -, at most 64")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = None

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, v):
        if not isinstance(v, str) or not TOOL_NAME.fullmatch(v):
            raise ValueError(f"must be 1-64 letters, digits, _ or -, got {show(v)}")
        return v


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


TOOL_CHOICES = ("none", "auto", "required")


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: the messages in the model's chat template, then the assistant's turn."""

    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens (wins)")
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, description="functions the model may call (offered in the system turn)")
    tool_choice: str | dict | None = Field(None, description='"none", "auto" (the default with tools), "required" '
                                                             'or {"type": "function", "function": {"name"}}: the '
                                                             'last two constrain the output to a call')
    parallel_tool_calls: bool | None = Field(None, description="accepted; a constrained call is always one call")

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):
        if isinstance(v, str) and v in TOOL_CHOICES:
            return v
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
                and isinstance(v["function"].get("name"), str):
            return v
        raise ValueError(f"'tool_choice' must be one of {list(TOOL_CHOICES)} or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {show(v)}")

    def choice(self) -> str | None:
        """What the tools allow: None (no tools offered), "none", "auto", "required", or the one function's name."""
        if not self.tools:
            return None if self.tool_choice in (None, "none", "auto") else self.tool_choice
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return self.tool_choice or "auto"


# -- responses (the shapes written; /openapi.json) ----------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens whose keys and values came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


FinishReason = Literal["stop", "length", "tool_calls", "cancelled"] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason


class Completion(BaseModel):
    """The answer of ``/v1/completions``; streamed, each chunk has this shape (one choice, no usage)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(ToolCall):
    index: int


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (the last one, with include_usage: no choices)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    context_length: int = Field(description="the most tokens a prompt and its completion may span")
    max_tokens_limit: int = Field(description="the largest max_tokens this server accepts")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "draining"]
    running: int | None = None
    waiting: int | None = None
    cancelled: int | None = None


# -- errors -------------------------------------------------------------------------------------------------------

_PHRASES = {"int_type": "must be an integer", "int_from_float": "must be an integer", "float_type": "must be a number",
            "finite_number": "must be a finite number", "bool_type": "must be true or false",
            "string_type": "must be a string", "list_type": "must be a list", "dict_type": "must be an object",
            "model_type": "must be an object", "model_attributes_type": "must be an object",
            "too_short": "must not be empty"}
_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


def param_name(loc: tuple) -> str:
    """pydantic's location of a field as the API names it: ('messages', 2, 'content') -> messages[2].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "str" or not str(part).isidentifier():
            continue  # the member of a union that was tried ("list[str]")
        else:
            out += ("." if out else "") + str(part)
    return out


def validation_error(e: ValidationError) -> RequestError:
    """The first of pydantic's complaints as a 400 naming the field."""
    err = e.errors(include_url=False)[0]
    param = param_name(err["loc"])
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "missing":
        return RequestError(400, f"missing required field '{param}'", param, "missing_field")
    if kind == "value_error":
        text = str(ctx.get("error", err["msg"]))
        # the top-level checks name their field themselves; a nested one gets its place in front
        return RequestError(400, f"{param}: {text}" if "." in param or "[" in param else text, param)
    if kind in _BOUNDS:
        key, sign = _BOUNDS[kind]
        phrase = f"must be {sign} {ctx[key]}"
    elif kind == "literal_error":
        phrase = f"must be one of {ctx.get('expected')}"
    else:
        phrase = _PHRASES.get(kind, err["msg"].lower())
    return RequestError(400, f"'{param}' {phrase}, got {show(err.get('input'))}", param)


def parse(model: type[BaseModel], body: dict) -> BaseModel:
    """Validate a request body (``null`` fields dropped first: they mean absent); raises :class:`RequestError`."""
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None


# -- OpenAPI --------------------------------------------------------------------------------------------------------

def openapi(title: str, version: str) -> dict:
    """The OpenAPI 3.1 description of the server's routes, its schemas generated from the models above."""
    models = [CompletionRequest, ChatCompletionRequest, Completion, ChatCompletion, ChatCompletionChunk, ModelList,
              ErrorResponse, Health]
    _, top = models_json_schema([(m, "validation" if m.__name__.endswith("Request") else "serialization")
                                 for m in models], ref_template="#/components/schemas/{model}")
    ref = lambda name: {"$ref": f"#/components/schemas/{name}"}
    errors = {str(s): {"description": d, "content": {"application/json": {"schema": ref("ErrorResponse")}}}
              for s, d in ((400, "invalid request (param names the field)"), (401, "missing or wrong API key"),
                           (404, "unknown model"), (413, "body over 1 MiB"), (429, "queue full (Retry-After)"),
                           (503, "shutting down"))}

    def post(summary, request, response, chunk):
        return {"post": {"summary": summary, "security": [{"bearer": []}], "requestBody": {
            "required": True, "content": {"application/json": {"schema": ref(request)}}},
            "responses": {"200": {"description": f"the answer; with stream: true, server-sent events of {chunk}s "
                                                 "ending with data: [DONE]",
                                  "content": {"application/json": {"schema": ref(response)},
                                              "text/event-stream": {"schema": ref(chunk)}}}, **errors}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/completions": post("text completion", "CompletionRequest", "Completion", "Completion"),
            "/v1/chat/completions": post("chat completion", "ChatCompletionRequest", "ChatCompletion",
                                         "ChatCompletionChunk"),
            "/v1/models": {"get": {"summary": "the served model", "security": [{"bearer": []}], "responses": {
                "200": {"description": "one model", "content": {"application/json": {"schema": ref("ModelList")}}},
                "401": errors["401"]}}},
            "/health": {"get": {"summary": "liveness and load (503 while draining)", "responses": {
                s: {"description": d, "content": {"application/json": {"schema": ref("Health")}}}
                for s, d in (("200", "serving"), ("503", "draining"))}}},
            "/metrics": {"get": {"summary": "Prometheus text exposition", "responses": {
                "200": {"description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": top.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
