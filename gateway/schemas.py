"""Request and response schemas (pydantic): OpenAI's shapes. The same models validate
requests and generate /openapi.json, so documentation cannot drift from behaviour; a server
validates with their subclasses bounded by its limits (gateway/limits.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError


def _integral(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


# JSON Schema's "integer" includes 2.0 and excludes true; the request models are strict (no
# true for 1, no "5" for 5) but take a float with no fraction as the integer it is. It goes
# after the constraints: before them, pydantic would write them as unknown keywords (ge, le).
Integral = BeforeValidator(_integral)


def only(allowed: Callable[[Any], bool], why: str) -> AfterValidator:
    """An OpenAI field Ferry honours only where its value asks for nothing more (`store:
    false`): any other value is refused by name (422 unsupported_parameter), never ignored."""

    def check(v: Any) -> Any:
        if not allowed(v):
            raise PydanticCustomError("unsupported_parameter", why)
        return v

    return AfterValidator(check)


Budget = Annotated[float, Field(gt=0, le=3_600_000, description="Latency budget in milliseconds.")]
PriorityName = Literal["interactive", "batch"]
OnInfeasible = Literal["reject", "serve"]
ON_INFEASIBLE = get_args(OnInfeasible)
NonEmptyText = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    # strict: JSON true is not the integer 1, nor "5" the number 5; the schema says
    # "integer" and "number", and the server means it.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def as_conversations(messages: Any) -> list[list[ChatMessage]]:
    """`messages` is one conversation or a list of them; everything past the request model sees a list."""
    return messages if isinstance(messages[0], list) else [messages]


class Scheduling(Strict):
    latency_budget_ms: Budget | None = Field(
        None, description="Overrides X-Ferry-Latency-Budget-Ms and the model default."
    )
    priority: PriorityName | None = Field(None, description="interactive (default) or batch.")
    on_infeasible: OnInfeasible | None = Field(
        None,
        description="What admission does when the latency budget cannot be met: reject (429 at once) or serve "
        "best-effort (X-Ferry-Best-Effort: true). Overrides X-Ferry-On-Infeasible and the model's setting.",
    )
    user: str | None = Field(None, max_length=256)


TokenId = Annotated[int, Field(ge=0), Integral]
TokenPrompt = Annotated[list[TokenId], Field(min_length=1)]


def completion_prompts(prompt: Any) -> list[str] | list[list[int]]:
    """`prompt` (or embeddings' `input`) is a string, a list of strings, token ids, or a
    list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [prompt]
    return prompt


# -- embeddings ---------------------------------------------------------------------
class EmbeddingsRequest(Scheduling):
    model: str = Field(min_length=1, max_length=256)
    input: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | TokenPrompt
        | Annotated[list[TokenPrompt], Field(min_length=1)]
    ) = Field(
        description="A string, a list of strings, token ids, or a list of token-id lists; each input becomes its "
        "own work item. Token ids are the model's input as given (with its special tokens, if it wants them)."
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1), Integral] | None = None

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        return completion_prompts(self.input)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = None


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


# -- chat and completions -------------------------------------------------------------
class TextPart(Strict):
    type: Literal["text"]
    text: str


class MessageFunctionCall(Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(description="The arguments as JSON text, as a tool call answer gave them.")


class MessageToolCall(Strict):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    id: str = Field(max_length=256)
    type: Literal["function"]
    function: MessageFunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)
    # An earlier answer's reasoning, as a response gave it (templates that show past thinking read it).
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


Conversation = Annotated[list[ChatMessage], Field(min_length=1)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
MaxTokens = Annotated[int, Field(ge=1, le=1_000_000), Integral]
Candidates = Annotated[int, Field(ge=1, le=16), Integral]
Effort = Literal["none", "minimal", "low", "medium", "high"]
TemplateKwargs = Annotated[dict[str, Any], Field(max_length=32)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1), Integral]
Penalty = Annotated[float, Field(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=100)]
TopK = Annotated[int, Field(ge=-1, le=1_000_000), Integral]
MinP = Annotated[float, Field(ge=0, le=1)]
MinTokens = Annotated[int, Field(ge=0, le=1_000_000), Integral]
# OpenAI's logit_bias: token ids (as JSON object keys, so strings) to a bias in [-100, 100].
_TOKEN_ID = r"^[0-9]{1,9}$"
_BIAS_SCHEMA = {
    "type": "object",
    "patternProperties": {_TOKEN_ID: {"type": "number", "minimum": -100, "maximum": 100}},
    "additionalProperties": False,  # pydantic states the key pattern only, which lets any other key through
}
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=_TOKEN_ID)], Annotated[float, Field(ge=-100, le=100)]],
    WithJsonSchema(_BIAS_SCHEMA),
]
StopList = Annotated[list[str], Field(max_length=16)]
Stop = str | StopList | list[str | StopList | None] | None


def stop_lists(stop: Stop) -> tuple[bool, list[list[str]]]:
    """(shared, lists): a string or a list of strings applies to every prompt (OpenAI), so
    it is one shared list; a list holding anything else (a list, null) has one entry per
    prompt. No stop at all is one shared empty list."""
    if stop is None:
        return True, [[]]
    if isinstance(stop, str):
        return True, [[stop]]
    if all(isinstance(s, str) for s in stop):
        return True, [list(stop)]  # type: ignore[arg-type]
    return False, [[s] if isinstance(s, str) else list(s or []) for s in stop]


class StreamOptions(Strict):
    include_usage: StrictBool = False


class JsonSchemaSpec(Strict):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON Schema the answer must match.")
    strict: StrictBool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
ResponseFormats = ResponseFormat | Annotated[list[ResponseFormat | None], Field(min_length=1)] | None


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments (an object).")
    strict: StrictBool | None = None


class FunctionTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ToolList = Annotated[list[FunctionTool], Field(max_length=128)]


class GenerationParams(Scheduling):
    """Each sampling field is a scalar (applies to every prompt) or a per-prompt list."""

    model: str = Field(min_length=1, max_length=256)
    temperature: Temperature | list[Temperature] | None = None
    top_p: TopP | list[TopP] | None = None
    max_tokens: MaxTokens | list[MaxTokens] | None = None
    seed: Seed | list[Seed] | None = None
    stop: Stop = Field(None, description="A string or list of strings for every prompt, or a per-prompt list of lists.")
    n: Candidates | Annotated[list[Candidates], Field(min_length=1)] = Field(
        1, description="Candidates per prompt (1-16): one number for every prompt, or a per-prompt list."
    )
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormats = Field(
        None, description="text, json_object or json_schema; one for every prompt or a per-prompt list."
    )
    presence_penalty: Penalty | list[Penalty] | None = None
    frequency_penalty: Penalty | list[Penalty] | None = None
    repetition_penalty: RepetitionPenalty | list[RepetitionPenalty] | None = None
    top_k: TopK | list[TopK] | None = None
    min_p: MinP | list[MinP] | None = None
    min_tokens: MinTokens | list[MinTokens] | None = None
    ignore_eos: StrictBool | list[StrictBool] | None = None
    logit_bias: LogitBias | Annotated[list[LogitBias | None], Field(min_length=1)] | None = Field(
        None, description="Token id (a string) to a bias in [-100, 100], for every prompt or a per-prompt list."
    )
    prompt_cache_key: str | None = Field(
        None,
        max_length=1024,
        description="Accepted: Ferry's prefix cache finds shared prefixes by their tokens, whatever the key.",
    )
    safety_identifier: str | None = Field(None, max_length=256, description="Accepted, as `user` is.")

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: Any, info: ValidationInfo) -> Any:
        # OpenAI refuses it too: options of a stream that will not be sent would be ignored.
        if v is not None and not info.data.get("stream", False):
            raise PydanticCustomError("stream_options_without_stream", "only allowed when stream is true")
        return v


class ChatCompletionRequest(GenerationParams):
    messages: Annotated[list[Conversation], Field(min_length=1)] | Conversation = Field(
        description="One conversation, or a list of conversations (one choice per prompt, in order)."
    )
    max_completion_tokens: MaxTokens | list[MaxTokens] | None = None
    tools: ToolList | Annotated[list[ToolList | None], Field(min_length=1)] | None = Field(
        None, description="Function tools for every prompt, or a per-prompt list of tool lists."
    )
    tool_choice: ToolChoice | Annotated[list[ToolChoice | None], Field(min_length=1)] | None = None
    parallel_tool_calls: StrictBool | Annotated[list[StrictBool | None], Field(min_length=1)] | None = None
    reasoning_effort: Effort | Annotated[list[Effort | None], Field(min_length=1)] | None = Field(
        None,
        description="Thinking per prompt on a model whose chat template has a thinking section: none switches "
        "it off, any other effort on; one for every prompt or a per-prompt list.",
    )
    chat_template_kwargs: TemplateKwargs | Annotated[list[TemplateKwargs | None], Field(min_length=1)] | None = Field(
        None,
        description="Further names the chat template reads (vLLM's; e.g. enable_thinking), for every prompt or a "
        "per-prompt list.",
    )
    logprobs: StrictBool | None = Field(None, description="Each generated token's log probability.")
    top_logprobs: Annotated[int, Field(ge=0, le=20), Integral] | None = Field(
        None, description="With logprobs true: the most likely alternatives listed per token (0-20)."
    )

    store: (
        Annotated[
            StrictBool,
            Field(json_schema_extra={"enum": [False]}),
            only(lambda v: not v, "this server stores no completion; send false or omit it"),
        ]
        | None
    ) = Field(None, description="false or absent: Ferry stores no completion.")
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = Field(
        None, description="Up to 16 string pairs, accepted as `user` is (nothing is stored to attach them to)."
    )

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @property
    def conversations(self) -> list[list[ChatMessage]]:
        return as_conversations(self.messages)


class CompletionRequest(GenerationParams):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenPrompt
        | Annotated[list[TokenPrompt], Field(min_length=1)]
    ) = Field(
        description="One prompt or a list of prompts (one choice per prompt, in order); a prompt is text or "
        "its token ids."
    )
    logprobs: Annotated[int, Field(ge=0, le=20), Integral] | None = Field(
        None, description="Each generated token's log probability, with the N most likely alternatives."
    )
    echo: StrictBool = Field(
        False,
        description="The prompt before each completion in `text`; with `logprobs`, the prompt tokens' log "
        "probabilities before the completion's (the first token's null).",
    )
    best_of: (
        Annotated[
            int,
            Field(ge=1, json_schema_extra={"maximum": 1}),
            Integral,
            only(lambda v: v == 1, "each choice is generated once here"),
        ]
        | None
    ) = Field(None, description="1 or absent: each choice is the one generated (a larger best_of is refused by name).")
    suffix: (
        Annotated[
            str,
            Field(json_schema_extra={"maxLength": 0}),
            only(lambda v: not v, "this server's models do not fill in before a suffix"),
        ]
        | None
    ) = Field(None, description='"" or absent: text after the completion is refused by name.')

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        return completion_prompts(self.prompt)


# -- responses (documented in /openapi.json; the routes build the same shapes) ----------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # of the prompt tokens, those whose KV the prefix cache served


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # A model whose chat template has a thinking section: what it wrote before </think> (null: none).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    prompt_index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: dict[str, Any] | None = None  # where the request asked: OpenAI's shape for the route


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class CompletionChoice(BaseModel):
    index: int
    prompt_index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: dict[str, Any] | None = None  # where the request asked: OpenAI's shape for the route


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    type: Literal["embedding", "chat", "custom"]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Status(BaseModel):
    status: str
    models: list[str] | None = None
    error: str | None = None
