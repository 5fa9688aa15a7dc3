"""Jobs know the gateway only as a `JobsHost`: nothing under gateway/jobs imports the
gateway's state, not even for type checking (mypy checks that GatewayState is one, where
create_app wires it)."""

from __future__ import annotations

import ast
from pathlib import Path

import gateway.jobs

JOBS = Path(gateway.jobs.__file__).parent


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{a.name}" if node.module else f"{base}{a.name}" for a in node.names)
    return names


def test_no_jobs_module_imports_the_gateway_state() -> None:
    offenders = {
        path.name: sorted(n for n in imported(path) if n in ("gateway.state", "..state") or n.startswith("..state."))
        for path in sorted(JOBS.glob("*.py"))
    }
    assert {name: found for name, found in offenders.items() if found} == {}
