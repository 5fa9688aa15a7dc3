"""Request and response schemas (pydantic). The same models validate requests and
generate /openapi.json, so documentation cannot drift from behaviour."""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

Budget = Annotated[float, Field(gt=0, le=3_600_000, description="Latency budget in milliseconds.")]
PriorityName = Literal["interactive", "batch"]
NonEmptyText = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Scheduling(Strict):
    latency_budget_ms: Budget | None = Field(None, description="Overrides X-Ferry-Latency-Budget-Ms and the model default.")
    priority: PriorityName | None = Field(None, description="interactive (default) or batch.")
    user: str | None = Field(None, max_length=256)


# -- embeddings ---------------------------------------------------------------------
class EmbeddingsRequest(Scheduling):
    model: str = Field(min_length=1, max_length=256)
    input: Union[NonEmptyText, Annotated[list[NonEmptyText], Field(min_length=1)]] = Field(
        description="A string or a list of strings; each becomes its own work item.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


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


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


Conversation = Annotated[list[ChatMessage], Field(min_length=1)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
MaxTokens = Annotated[int, Field(ge=1, le=1_000_000)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
StopList = Annotated[list[str], Field(max_length=16)]


class StreamOptions(Strict):
    include_usage: StrictBool = False


class GenerationParams(Scheduling):
    """Each sampling field is a scalar (applies to every prompt) or a per-prompt list."""

    model: str = Field(min_length=1, max_length=256)
    temperature: Union[Temperature, list[Temperature], None] = None
    top_p: Union[TopP, list[TopP], None] = None
    max_tokens: Union[MaxTokens, list[MaxTokens], None] = None
    seed: Union[Seed, list[Seed], None] = None
    stop: Union[str, StopList, list[Union[str, StopList, None]], None] = Field(
        None, description="A string or list of strings for every prompt, or a per-prompt list of lists.")
    n: int = Field(1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None


class ChatCompletionRequest(GenerationParams):
    messages: Union[Annotated[list[Conversation], Field(min_length=1)], Conversation] = Field(
        description="One conversation, or a list of conversations (one choice per prompt, in order).")
    max_completion_tokens: Union[MaxTokens, list[MaxTokens], None] = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @property
    def conversations(self) -> list[list[ChatMessage]]:
        return self.messages if isinstance(self.messages[0], list) else [self.messages]  # type: ignore[list-item]


class CompletionRequest(GenerationParams):
    prompt: Union[str, Annotated[list[str], Field(min_length=1)]] = Field(
        description="One prompt or a list of prompts (one choice per prompt, in order).")

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt


# -- admin ------------------------------------------------------------------------
class BatchingPatch(Strict):
    max_batch_size: int | None = Field(None, ge=1, le=1_000_000)
    max_wait_ms: float | None = Field(None, ge=0, lt=3_600_000)
    policy: Literal["fixed", "deadline", "adaptive"] | None = None
    max_queue: int | None = Field(None, ge=1, le=1_000_000)
    default_budget_ms: float | None = Field(None, gt=0, lt=3_600_000)
    max_itl_ms: float | None = Field(None, gt=0, lt=3_600_000)
    max_running: int | None = Field(None, ge=1, le=1_000_000)
    on_infeasible: Literal["reject", "serve"] | None = None
    aging_ms: float | None = Field(None, ge=0, lt=3_600_000)
    interactive_first: bool | None = None


def is_finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


# -- responses (documented in /openapi.json; the routes build the same shapes) ----------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    prompt_index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


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
    logprobs: None = None


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
    type: Literal["embedding", "chat"]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Status(BaseModel):
    status: str
    models: list[str] | None = None
    error: str | None = None


class BatchingSettingsOut(BaseModel):
    max_batch_size: int
    max_wait_ms: float
    max_queue: int
    policy: str
    default_budget_ms: float | None
    deadline_margin_ms: float
    aging_ms: float
    on_infeasible: str
    interactive_first: bool
    budget_scope: str
    max_itl_ms: float | None
    max_running: int
    prefill_token_budget: int
    mode: str
    cost_model: dict[str, Any] | None = None
