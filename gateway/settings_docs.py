"""The docs' tables of knobs, generated from their declarations (batcher/settings.py,
gateway/config.py). A table sits between `<!-- knobs TABLE -->` and `<!-- end knobs -->`;
TABLE is `batching`, `server`, or `main NAME...` (those options, for the README).

    python -m gateway.settings_docs          # rewrite the tables
    python -m gateway.settings_docs --check  # exit 1 if a table differs (tests do the same)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from batcher.knobs import Knob

from .config import BATCHING_KNOBS, OPTIONS, SERVER_KNOBS

ROOT = Path(__file__).resolve().parents[1]
FILES = ("README.md", "docs/settings.md")
BLOCK = re.compile(r"(<!-- knobs (?P<spec>[^>]*?) -->\n)(?P<table>.*?)(<!-- end knobs -->)", re.S)


def default(k: Knob) -> str:
    value = k.default
    if value is None or value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return f"`{value}`"
    number = str(int(value)) if float(value).is_integer() else str(value)
    return f"{number} {k.unit}" if k.unit else number


def meaning(k: Knob) -> str:
    text = k.help + (f"; none: {k.null}" if k.nullable and k.null else "")
    return text.replace("|", "\\|")


def flag(k: Knob) -> str:
    return f"`{k.flag}`"


def table(spec: str) -> str:
    kind, *names = spec.split()
    if kind == "batching":
        rows = [["setting", "flag", "env", "default", "accepted", "live", "meaning"], ["---"] * 7]
        for k in BATCHING_KNOBS:
            metric = f" (gauge `{k.gauge_name}`)" if k.gauge else ""
            rows.append(
                [
                    f"`{k.name}`",
                    flag(k),
                    f"`{k.env}`",
                    default(k),
                    _accepted(k),
                    "yes" if k.live else "no",
                    meaning(k) + metric,
                ]
            )
    elif kind == "server":
        rows = [["flag", "env", "default", "accepted", "meaning"], ["---"] * 5]
        rows += [[flag(k), f"`{k.env}`", default(k), _accepted(k), meaning(k)] for k in SERVER_KNOBS]
    elif kind == "main":
        rows = [["flag", "default", "meaning"], ["---"] * 3]
        rows += [[flag(OPTIONS[n]), default(OPTIONS[n]), meaning(OPTIONS[n])] for n in names]
    else:
        raise ValueError(f"unknown knobs table {spec!r}")
    return "".join("| " + " | ".join(row) + " |\n" for row in rows)


def _accepted(k: Knob) -> str:
    return k.requirement.removeprefix("must be ")


def render(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + table(m.group("spec")) + m.group(4), text)


def outdated(root: Path = ROOT) -> list[str]:
    """The files whose tables differ from the declarations."""
    return [name for name in FILES if render(text := (root / name).read_text()) != text]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stale = outdated()
    if "--check" in argv:
        for name in stale:
            print(f"{name}: knob tables differ from the declarations; run python -m gateway.settings_docs")
        return 1 if stale else 0
    for name in stale:
        path = ROOT / name
        path.write_text(render(path.read_text()))
        print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
