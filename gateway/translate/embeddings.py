"""Embeddings requests: each input string is its own work item (its token ids), so inputs
from many requests batch together."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import APIError, check_vocabulary
from ..schemas import EmbeddingsRequest

if TYPE_CHECKING:
    from engine.base import EmbeddingEngine

    from ..config import ServerConfig


@dataclass
class EmbeddingWork:
    model: str
    token_ids: list[list[int]]  # one per input, in input order
    encoding_format: str

    @property
    def payloads(self) -> list[list[int]]:
        return self.token_ids

    @property
    def costs(self) -> list[int]:
        return [len(ids) for ids in self.token_ids]

    def response(self, results: list[Any]) -> dict[str, Any]:
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(r.vector, self.encoding_format)}
            for i, r in enumerate(results)
        ]
        tokens = sum(r.tokens for r in results)
        return {
            "object": "list",
            "data": data,
            "model": self.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def check_embeddings(body: EmbeddingsRequest, engine: EmbeddingEngine) -> None:
    """The checks that need the model but no tokenizer (batch files are validated with
    them); the request model has checked the number of inputs."""
    dim = engine.dim
    if body.dimensions is not None and body.dimensions != dim:
        raise APIError(
            422,
            f"dimensions: {engine.name} produces {dim}-dimensional embeddings; other sizes are not supported",
            code="invalid_value",
            param="dimensions",
        )
    inputs = body.inputs
    if not isinstance(inputs[0], str):
        check_token_inputs(inputs, engine)  # token-id lists


def check_token_inputs(inputs: list[list[int]], engine: EmbeddingEngine) -> None:
    """Inputs given as token ids are the model's input as they are: each id in its
    vocabulary, each input within its length (a text is truncated to it; ids are not cut,
    which would drop the end token a client put there). Refused, never reaching a batch."""
    vocab = getattr(engine, "vocab_size", None)
    if vocab is None:
        raise APIError(422, f"{engine.name} takes its inputs as text only", code="unsupported_parameter", param="input")
    for i, ids in enumerate(inputs):
        check_vocabulary(ids, vocab, f"input[{i}]", engine.name, "input")
        if len(ids) > engine.max_length:
            raise APIError(
                422,
                f"input[{i}] has {len(ids)} token ids; {engine.name} takes at most {engine.max_length}",
                code="context_length_exceeded",
                param="input",
            )


def embedding_work(body: EmbeddingsRequest, engine: EmbeddingEngine, cfg: ServerConfig) -> EmbeddingWork:
    """Check and tokenize every input (the engine truncates text to its own max length;
    token ids are taken as they are); an input still over `--max-prompt-tokens` is refused."""
    check_embeddings(body, engine)
    inputs = body.inputs
    token_ids = engine.tokenize(inputs) if isinstance(inputs[0], str) else [list(ids) for ids in inputs]
    if cfg.max_prompt_tokens is not None:
        for i, ids in enumerate(token_ids):
            if len(ids) > cfg.max_prompt_tokens:
                raise APIError(
                    422,
                    f"input[{i}] has {len(ids)} tokens; the limit is {cfg.max_prompt_tokens}",
                    code="too_many_tokens",
                    param="input",
                )
    return EmbeddingWork(engine.name, token_ids, body.encoding_format)


def _encode(vector: np.ndarray, fmt: str) -> Any:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
