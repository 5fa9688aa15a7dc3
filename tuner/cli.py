"""`ferry tune` (also `python -m tuner`): sweep batching settings under open-loop
load with locust and recommend the setting with the most throughput within a latency SLO.

    ferry serve --chat-model none --admin-token t &
    ferry tune --admin-token t --sizes 1,8,32 --waits 0,10 --rates 40,120 \\
        --cell-seconds 8 --slo-ms 200 --out tune-out

For every setting (policy x max_batch_size x max_wait_ms) and every arrival rate, one
*cell*: the setting is applied live (PATCH /admin/models/{model}/batching), locust runs
headless for --cell-seconds of open-loop arrivals (tuner/locustfile.py, same arrival
times for every setting at a given rate), and /metrics is scraped before and after.
Results: results.csv, results.json, p99_vs_throughput.png, goodput_vs_rate.png,
batch_size_vs_rate.png, and the recommendation with its evidence on stdout.

The recommendation: among cells whose p99 (of time to first token for interactive chat,
of the whole request otherwise) is within --slo-ms and whose error rate (failures and
requests still unfinished at the end, over all scheduled) is at most --max-error-rate,
the most throughput; cells within --tie-tolerance of that throughput count as a tie,
broken by the lower p99, then the smaller max_wait_ms, then the smaller max_batch_size.

Bounded: at most --max-cells cells, each locust run has a timeout, the whole sweep stops
after --max-minutes. Targets 127.0.0.1 / localhost only. The original settings are put
back at the end (or the recommended ones with --apply).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from .plot import plot
from .recommend import evidence, recommend, recommend_throughput
from .scrape import TunedGateway
from .sweep import sweep, write_results
from .traffic import CLASS_ALIASES, LOOPBACK

CELL_OVERHEAD_S = 4.0  # locust start-up, spawning, metrics scrapes: for the time estimate


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative numbers, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) or v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return [int(v) for v in values]


def _names(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one name")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ferry tune",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See docs/tuning.md for a worked example.",
    )
    p.add_argument(
        "--host",
        default=os.environ.get("FERRY_TUNE_HOST", "http://127.0.0.1:8000"),
        help="gateway URL, 127.0.0.1/localhost only (default %(default)s)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("FERRY_ADMIN_TOKEN"),
        help="the gateway's --admin-token (env FERRY_ADMIN_TOKEN)",
    )
    p.add_argument("--model", help="model to tune (default: the first served model of the route's kind)")
    p.add_argument(
        "--route",
        choices=["embeddings", "chat", "batch-chat"],
        help="traffic: embeddings, chat (interactive, streamed) or batch-chat (default: from the model's kind)",
    )
    p.add_argument(
        "--mix", help="traffic mix instead of --route, e.g. embed=3,interactive=1 (classes: embed, interactive, batch)"
    )
    p.add_argument("--embed-model", help="embeddings model name for the mix (default: --model or the first served)")
    p.add_argument("--chat-model", help="chat model name for the mix (default: --model or the first served)")
    p.add_argument("--sizes", type=_ints, default=[1, 8, 32], help="max_batch_size values (default 1,8,32)")
    p.add_argument("--waits", type=_floats, default=[0.0, 5.0, 20.0], help="max_wait_ms values (default 0,5,20)")
    p.add_argument("--policies", type=_names, default=["fixed"], help="policies, e.g. fixed,adaptive (default fixed)")
    p.add_argument(
        "--rates", type=_floats, default=[20.0, 40.0, 80.0], help="arrival rates, requests/s (default 20,40,80)"
    )
    p.add_argument("--cell-seconds", type=float, default=10.0, help="seconds of arrivals per cell (default 10)")
    p.add_argument("--slo-ms", type=float, default=200.0, help="p99 latency objective in ms (default 200)")
    p.add_argument(
        "--max-error-rate", type=float, default=0.01, help="most failures per request in a passing cell (default 0.01)"
    )
    p.add_argument(
        "--tie-tolerance",
        type=float,
        default=0.02,
        help="throughputs within this fraction of the best tie; the lower p99 wins (default 0.02)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="after the arrivals, how long requests in flight may finish (default 10)",
    )
    p.add_argument("--pool-latency-s", type=float, default=2.0, help="locust pool = rate x this (default 2)")
    p.add_argument("--locust-args", default="", help="extra locustfile options, e.g. '--chat-max-tokens 8'")
    p.add_argument("--out", default="tune-out", help="output directory (default %(default)s)")
    p.add_argument("--max-cells", type=int, default=500, help="refuse larger grids (default 500)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=120.0,
        help="refuse longer sweeps, and stop one that overruns (default 120)",
    )
    p.add_argument(
        "--apply", action="store_true", help="leave the recommended setting applied (default: restore the original)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the grid and time estimate, run nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_host(url: str) -> str:
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK:
        raise SystemExit(f"ferry tune: refusing {url!r}: it targets 127.0.0.1 / localhost only")
    return f"{parts.scheme}://{parts.netloc}"


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, _, weight = part.partition("=")
        key = CLASS_ALIASES.get(name.strip())
        if key is None:
            raise SystemExit(f"ferry tune: unknown class {name.strip()!r} in --mix (embed, interactive, batch)")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise SystemExit(f"ferry tune: bad weight in --mix: {part!r}") from None
        if w < 0 or not math.isfinite(w):
            raise SystemExit(f"ferry tune: bad weight in --mix: {part!r}")
        mix[key] = mix.get(key, 0.0) + w
    mix = {k: w for k, w in mix.items() if w > 0}
    if not mix:
        raise SystemExit("ferry tune: --mix selects no traffic")
    return mix


def resolve_traffic(args, served: list[dict]) -> tuple[str, dict[str, float], dict[str, str]]:
    kinds = {m["id"]: m.get("type") for m in served}
    if args.model and args.model not in kinds:
        raise SystemExit(f"ferry tune: model {args.model!r} is not served; served: {', '.join(kinds)}")
    if args.mix:
        classes = parse_mix(args.mix)
    elif args.route:
        classes = {{"embeddings": "embed", "chat": "interactive", "batch-chat": "batch"}[args.route]: 1.0}
    elif args.model:
        classes = {"embed": 1.0} if kinds[args.model] == "embedding" else {"interactive": 1.0}
    else:
        classes = {"embed": 1.0}

    def first(kind: str) -> str | None:
        return next((m for m, k in kinds.items() if k == kind), None)

    wanted: dict[str, str | None] = {}
    if "embed" in classes:
        wanted["embed"] = args.embed_model or (
            args.model if args.model and kinds[args.model] == "embedding" else first("embedding")
        )
    if {"interactive", "batch"} & set(classes):
        wanted["chat"] = args.chat_model or (
            args.model if args.model and kinds[args.model] == "chat" else first("chat")
        )
    models: dict[str, str] = {}
    for kind, name in wanted.items():
        if not name:
            raise SystemExit(f"ferry tune: no {kind} model is served for this traffic")
        models[kind] = name
    model = args.model or models.get("embed") or models["chat"]
    return model, classes, models


def redact(argv: list[str]) -> list[str]:
    """The command line without the admin token."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a == "--admin-token":
            out.append(a)
            hide = True
        else:
            out.append("--admin-token=***" if a.startswith("--admin-token=") else a)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    host = check_host(args.host)
    if args.cell_seconds < 1 or args.cell_seconds > 600:
        raise SystemExit("ferry tune: --cell-seconds must be within 1..600")
    if not (0 <= args.drain_seconds <= 120):
        raise SystemExit("ferry tune: --drain-seconds must be within 0..120")
    if any(r <= 0 for r in args.rates):
        raise SystemExit("ferry tune: --rates must be positive")
    grid = [
        (p, s, w)
        for p in dict.fromkeys(args.policies)
        for s in dict.fromkeys(args.sizes)
        for w in dict.fromkeys(args.waits)
    ]
    rates = sorted(set(args.rates))
    cells = [(p, s, w, r) for (p, s, w), r in itertools.product(grid, rates)]
    per_cell = args.cell_seconds + CELL_OVERHEAD_S + 0.5
    estimate = len(cells) * per_cell
    print(
        f"ferry tune: {len(grid)} settings x {len(rates)} rates = {len(cells)} cells of {args.cell_seconds:g} s, "
        f"about {estimate / 60:.1f} min",
        file=sys.stderr,
    )
    if len(cells) > args.max_cells:
        raise SystemExit(f"ferry tune: {len(cells)} cells is more than --max-cells {args.max_cells}")
    if estimate > args.max_minutes * 60:
        raise SystemExit(f"ferry tune: about {estimate / 60:.0f} min is more than --max-minutes {args.max_minutes:g}")
    if args.dry_run:
        for policy, size, wait, rate in cells:
            print(f"  policy={policy} max_batch_size={size:d} max_wait_ms={wait:g} rate={rate:g}")
        return 0
    if importlib.util.find_spec("locust") is None:
        raise SystemExit("ferry tune: locust is not installed: pip install -e '.[load]'")
    if not args.admin_token:
        raise SystemExit("ferry tune: --admin-token is required (start the gateway with --admin-token)")

    gw = TunedGateway(host, args.admin_token)
    try:
        try:
            served = gw.models()
        except httpx.HTTPError as exc:
            raise SystemExit(f"ferry tune: cannot reach {host}: {exc}") from None
        model, classes, models = resolve_traffic(args, served)
        original = gw.settings(model)
        keep = {k: original[k] for k in ("max_batch_size", "max_wait_ms", "policy")}
        # Refuse a bad grid value now, not halfway through the sweep.
        for p, s, w in grid:
            gw.patch(model, max_batch_size=s, max_wait_ms=w, policy=p)
        gw.patch(model, **keep)
        out = Path(args.out)
        (out / "locust").mkdir(parents=True, exist_ok=True)
        meta = {
            "host": host,
            "model": model,
            "classes": classes,
            "models": models,
            "slo_ms": args.slo_ms,
            "max_error_rate": args.max_error_rate,
            "tie_tolerance": args.tie_tolerance,
            "cell_seconds": args.cell_seconds,
            "original_settings": keep,
            "argv": redact(list(argv) if argv is not None else sys.argv[1:]),
        }
        print(
            f"ferry tune: model {model}, traffic {classes}, SLO p99 <= {args.slo_ms:g} ms, results in {out}/",
            file=sys.stderr,
        )
        rows = sweep(args, gw, host, model, classes, models, cells, out, meta, per_cell)
        rec = recommend(rows, args.slo_ms, args.max_error_rate, args.tie_tolerance)
        thr = recommend_throughput(rows, args.max_error_rate, args.tie_tolerance)
        picked = ("policy", "max_batch_size", "max_wait_ms", "rate", "throughput_rps", "p99_ms", "cell")
        meta["recommendation"] = None if rec is None else {k: rec[k] for k in picked}
        meta["throughput_recommendation"] = None if thr is None else {k: thr[k] for k in picked}
        write_results(out, rows, meta)
        title = f"{model}: {' + '.join(classes)} traffic, {args.cell_seconds:g} s cells, SLO p99 {args.slo_ms:g} ms"
        paths = plot(out, rows, args.slo_ms, rec, title) if rows else []
        text = evidence(rows, rec, args)
        (out / "recommendation.txt").write_text(text + "\n")
        print(text)
        for path in [out / "results.csv", out / "results.json", *paths]:
            print(f"  wrote {path}")
        if args.apply and rec is not None:
            gw.patch(
                model,
                max_batch_size=int(rec["max_batch_size"]),
                max_wait_ms=float(rec["max_wait_ms"]),
                policy=rec["policy"],
            )
            print("  applied the recommended setting")
        else:
            gw.patch(model, **keep)
    finally:
        gw.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
