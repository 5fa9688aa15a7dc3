"""`ferry serve`: the command-line entry point."""

from __future__ import annotations

import os
import sys

from .config import from_args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["tune"]:  # `ferry tune`: the sweep in tuner/ (needs the `load` extra)
        from tuner.cli import main as tune_main

        return tune_main(args[1:])
    command, cfg = from_args(argv)
    # Before torch is imported; an engine core sets its own count when it loads its engine.
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.torch_threads or 1))
    from .logs import setup_logging

    setup_logging()
    if command == "serve" and cfg.api_workers > 1:  # a supervisor of front ends and cores
        from .cores.supervisor import serve_front_ends

        return serve_front_ends(cfg)
    if command == "serve":
        from .server import serve

        return serve(cfg)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
