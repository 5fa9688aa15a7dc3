"""The kinds of model a gateway serves (embeddings, chat, a user's own batched model), and what tells them apart from
a model's source: its Hugging Face architectures, and whether a source names a local path
or a Hub id. No HTTP, no torch."""

from __future__ import annotations

import os
import re
from typing import Final, Literal

ModelKind = Literal["embedding", "chat", "custom"]
EMBEDDING: Final = "embedding"
CHAT: Final = "chat"
CUSTOM: Final = "custom"  # a user's class (engine/custom.py), served over the Open Inference Protocol


# A config file's `kind` (as the issue and docs spell it) to the kind of a served model.
KIND_OF: dict[str, ModelKind] = {"embeddings": EMBEDDING, "chat": CHAT, "custom": CUSTOM}


# A Hugging Face Hub id: "name" or "owner/name" (huggingface_hub's own rule, roughly:
# letters, digits, "-", "_", "." in each part).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


# The architectures (config.json) a chat model's engine can load (AutoModelForCausalLM).
GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def looks_like_path(source: str) -> bool:
    """A source meant as a local path: absolute, `./`, `../` or `~`; or with a separator and
    either not shaped like a Hub id (`a/b/c`, `a//b`) or under a directory that exists here
    (`models/x` where `models/` does)."""
    if source.startswith(("/", "./", "../", "~")):
        return True
    if os.sep not in source:
        return False
    return not HUB_ID.fullmatch(source) or os.path.isdir(os.path.dirname(source))


def kind_of_architectures(archs: list[str]) -> ModelKind:
    """Chat for a generative architecture (config.json's `architectures`), else embeddings."""
    return CHAT if any(a.endswith(GENERATIVE_SUFFIXES) for a in archs) else EMBEDDING
