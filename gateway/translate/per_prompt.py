"""A request field spread over its prompts: chat and completions sampling fields, stop
lists, response formats and tools are each a scalar for every prompt or a list with one
value per prompt."""

from __future__ import annotations

from typing import Any

from ..errors import APIError


def per_prompt(name: str, value: Any, n: int, default: Any) -> list[Any]:
    """A scalar applies to every prompt; a list must have one value per prompt."""
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise APIError(
                422,
                f"{name} is a list of {len(value)} values but the request has {n} prompts; "
                f"give one value per prompt or a single value for all",
                code="prompt_count_mismatch",
                param=name,
            )
        return list(value)
    return [value] * n
