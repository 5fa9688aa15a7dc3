"""Every public name is defined once: a reader who meets `EngineThread` or `BatchingError`
knows which module it comes from without asking which of two it is. Re-exports (an
import, such as gateway/__init__.py's lazy names) are not definitions."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("gateway", "batcher", "engine", "client/ferry_client", "tuner", "loadtests")

# Deliberate repeats, each with the modules allowed to define it.
ALLOWED: dict[str, set[str]] = {
    # The entry point of each command (`ferry`, `python -m ...`) is `main` by convention.
    "main": {
        "gateway/cli.py",
        "gateway/cores/launch.py",
        "gateway/settings_docs.py",
        "tuner/cli.py",
        "loadtests/bench_chat.py",
        "loadtests/bench_cores.py",
        "loadtests/bench_custom.py",
        "loadtests/bench_embeddings.py",
        "loadtests/bench_gateway.py",
        "loadtests/bench_latency.py",
        "loadtests/bench_replicas.py",
        "loadtests/gpu_check.py",
        "loadtests/lm_eval_check.py",
        "loadtests/padding_free.py",
        "loadtests/rows_attention.py",
        "loadtests/cost_fit.py",
        "loadtests/decode_kernel.py",
        "loadtests/prefix_burst.py",
        "loadtests/bench_metrics_scrape.py",
        "loadtests/sim_priority.py",
        "loadtests/ui_screenshot.py",
        "loadtests/admission_cell.py",
        "loadtests/fairness_cell.py",
        "loadtests/kv_events_compat.py",
    },
    # The two sides of the wire: the server's pydantic models, whose class names are the
    # component names in /openapi.json, and the client's response objects, documented in
    # docs/client.md. The client installs without the gateway, so it cannot import them.
    "CompletionResponse": {"gateway/schemas.py", "client/ferry_client/responses.py"},
    "Usage": {"gateway/schemas.py", "client/ferry_client/responses.py"},
}


def _top_level_defs(body: list[ast.stmt]):
    """Classes and functions a module defines at its top level (also under `if`/`try`)."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name
        elif isinstance(node, ast.If):
            yield from _top_level_defs(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level_defs(
                node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
            )


def public_definitions() -> dict[str, set[str]]:
    where: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            for name in _top_level_defs(ast.parse(path.read_text(encoding="utf-8")).body):
                if not name.startswith("_"):
                    where[name].add(module)
    return where


def test_every_public_class_and_function_name_is_defined_once():
    defs = public_definitions()
    assert defs, "found no modules to check"
    repeated = {
        name: sorted(modules)
        for name, modules in defs.items()
        if len(modules) > 1 and not modules <= ALLOWED.get(name, set())
    }
    assert repeated == {}, f"public names defined in more than one module (rename one): {repeated}"


def test_the_allowlist_names_only_real_repeats():
    # An entry that no longer repeats (a module renamed, a name gone) would silently allow
    # the next accidental repeat; keep the list to what is true today.
    defs = public_definitions()
    stale = {
        name: sorted(modules - defs.get(name, set()))
        for name, modules in ALLOWED.items()
        if not modules <= defs.get(name, set())
    }
    assert stale == {}, f"allowlisted modules that do not define the name: {stale}"
