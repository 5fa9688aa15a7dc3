"""Why a model failed to load, in one line an operator can act on: a missing path, a Hub id
with no network or cache, an architecture of the wrong kind, missing weights; else the
error itself (docs/operations.md, "Engine cores")."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from .catalogue import ModelSpec
from .kinds import CHAT, GENERATIVE_SUFFIXES, HUB_ID, looks_like_path


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during (transformers wraps the Hub's)."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _named(chain: list[BaseException], name: str) -> bool:
    return any(name in (c.__name__ for c in type(e).__mro__) for e in chain)


def _a(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def architectures(source: str) -> list[str] | None:
    """What `source`'s config.json names (a local directory's, or a cached Hub id's), if it can be read."""
    path: Any = os.path.join(os.path.expanduser(source), "config.json")
    if not os.path.isfile(path):
        path = None
        if HUB_ID.fullmatch(source):
            with contextlib.suppress(Exception):  # offline, cache only: never a download
                from huggingface_hub import try_to_load_from_cache

                path = try_to_load_from_cache(source, "config.json")
    if not isinstance(path, str):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(a) for a in found] if isinstance(found, list) else None


def failure_line(spec: ModelSpec, exc: BaseException) -> str:
    """One line for the operator: which model, from where, and why it did not load. The
    reasons it names (docs/operations.md, "Engine cores"): a missing path (`looks_like_path`
    and nothing there); a Hub id not in the local cache while HF_HUB_OFFLINE is set (or the
    Hub unreachable), or not on the Hub; a model that is not of `spec.kind`. Anything else:
    the exception's class and first line."""
    source = spec.source
    chain = _chain(exc)
    text = " ".join(str(e) for e in chain)
    reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    if _named(chain, "GGUFError"):
        reason = next(str(e) for e in chain if _named([e], "GGUFError"))  # already one line, and why
    elif source and looks_like_path(source) and not os.path.exists(os.path.expanduser(source)):
        reason = "no such file or directory"  # what the loader's complaint about a repo id means here
    elif _named(chain, "LocalEntryNotFoundError") or "couldn't find them in the cached files" in text:
        if hub_offline():
            reason = "not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
        else:
            reason = "not in the local Hugging Face cache, and the Hugging Face Hub cannot be reached"
    elif _named(chain, "RepositoryNotFoundError"):
        reason = "no such model on the Hugging Face Hub (or a gated one: set HF_TOKEN)"
    elif "Unrecognized configuration class" in text:  # transformers' Auto class for this kind refused it
        reason = f"not {_a(spec.kind)} model"
    elif spec.kind == CHAT and source:
        names = architectures(source)
        if names and not any(n.endswith(GENERATIVE_SUFFIXES) for n in names):
            reason = f"not {_a(spec.kind)} model (its config names {', '.join(names)})"
    return f"cannot load the {spec.kind} model {source or '(unnamed)'}: {reason}"
