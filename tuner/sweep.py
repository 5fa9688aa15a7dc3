"""The sweep: for every cell (setting x arrival rate) apply the setting live, run locust
headless with open-loop arrivals (tuner/locustfile.py), scrape /metrics before and after,
and turn both into one row of results.csv."""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .recommend import fmt_ms, passes, setting_label
from .scrape import REASONS, REJECTIONS, TunedGateway, ferry_figures
from .traffic import REQUEST_ENTRIES, SLO_ENTRIES

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
COLUMNS = [  # results.csv
    "cell",
    "policy",
    "max_batch_size",
    "max_wait_ms",
    "rate",
    "offered_rps",
    "window_s",
    "span_s",
    "scheduled",
    "sent",
    "ok",
    "failures",
    "unfinished",
    "error_rate",
    "throughput_rps",
    "goodput_rps",
    "p50_ms",
    "p95_ms",
    "p99_ms",
    "max_ms",
    "slo_ms",
    "meets_slo",
    "late_starts",
    "lag_p99_ms",
    "mean_batch_size",
    "mean_decode_batch",
    "batches",
    *(f"dispatch_{r}" for r in REASONS),
    *(f"rejected_{r}" for r in REJECTIONS),
    "expired",
    "mean_queue_wait_ms",
    "locust_rc",
    "error",
]


def read_locust_csv(path: Path) -> dict[str, dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def _num(row: dict | None, col: str) -> float | None:
    if not row:
        return None
    try:
        v = float(row.get(col, ""))
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def cell_figures(stats: dict[str, dict], report: dict, classes: Iterable[str], slo_ms: float) -> dict[str, Any]:
    """Locust statistics (CSV) + the locustfile's report -> one row's load-side figures."""
    classes = list(classes)
    window = float(report.get("window_s") or 0.0)
    # Throughput over the arrival window, or until the last answer if a backlog ran past it.
    span = max(window, float(report.get("last_done_s") or 0.0))
    scheduled = int(report.get("scheduled") or 0)
    entries = report.get("entries", {})
    sent = failures = good = 0
    worst: dict[str, float | None] = {"p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None}
    for c in classes:
        req = stats.get(REQUEST_ENTRIES[c])
        sent += int(_num(req, "Request Count") or 0)
        failures += int(_num(req, "Failure Count") or 0)
        good += int(entries.get(SLO_ENTRIES[c], {}).get("within_slo", 0))
        slo_row = stats.get(SLO_ENTRIES[c])
        for key, col in (("p50_ms", "50%"), ("p95_ms", "95%"), ("p99_ms", "99%"), ("max_ms", "Max Response Time")):
            v, current = _num(slo_row, col), worst[key]
            if v is not None and (current is None or v > current):  # the worst class decides
                worst[key] = v
    unfinished = max(0, scheduled - sent)
    ok = sent - failures
    total = max(scheduled, sent)
    return {
        "window_s": round(window, 3),
        "span_s": round(span, 3),
        "scheduled": scheduled,
        "offered_rps": round(scheduled / window, 3) if window > 0 else 0.0,
        "sent": sent,
        "ok": ok,
        "failures": failures,
        "unfinished": unfinished,
        "error_rate": round((failures + unfinished) / total, 4) if total else 1.0,
        "throughput_rps": round(ok / span, 3) if span > 0 else 0.0,
        "goodput_rps": round(good / span, 3) if span > 0 else 0.0,
        **worst,
        "max_ms": None if worst["max_ms"] is None else round(worst["max_ms"], 1),
        "late_starts": int(report.get("late_starts") or 0),
        "lag_p99_ms": report.get("lag_p99_ms"),
    }


def run_locust(
    args, gw_host: str, rate: float, classes: dict[str, float], models: dict[str, str], prefix: Path, timeout: float
) -> tuple[int, dict, dict, str]:
    weights = {c: classes.get(c, 0.0) for c in ("interactive", "batch", "embed")}
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        gw_host,
        "-t",
        f"{max(1, round(args.cell_seconds))}s",
        "--stop-timeout",
        f"{args.drain_seconds:g}",
        "--reset-stats",
        "--only-summary",
        "--loglevel",
        "WARNING",
        "--exit-code-on-error",
        "0",
        "--csv",
        str(prefix),
        "--arrival-rate",
        f"{rate:g}",
        "--seed",
        str(int(rate * 1000) % 100_000),
        "--pool-latency-s",
        f"{args.pool_latency_s:g}",
        "--ferry-slo-ms",
        f"{args.slo_ms:g}",
        "--ferry-report",
        str(prefix) + "_report.json",
        "--weight-interactive",
        f"{weights['interactive']:g}",
        "--weight-batch",
        f"{weights['batch']:g}",
        "--weight-embed",
        f"{weights['embed']:g}",
    ]
    if models.get("chat"):
        cmd += ["--ferry-chat-model", models["chat"]]
    if models.get("embed"):
        cmd += ["--ferry-embed-model", models["embed"]]
    cmd += shlex.split(args.locust_args)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCUST_", "FERRY_LOAD_"))}
    with open(str(prefix) + ".log", "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            rc, err = proc.returncode, ""
        except subprocess.TimeoutExpired:
            rc, err = -9, f"locust timed out after {timeout:.0f} s"
    stats, report = {}, {}
    try:
        stats = read_locust_csv(Path(str(prefix) + "_stats.csv"))
        report = json.loads(Path(str(prefix) + "_report.json").read_text())
    except (OSError, ValueError) as exc:
        err = err or f"no locust results ({exc.__class__.__name__}); see {prefix}.log"
    if rc not in (0,) and not err:
        err = f"locust exited {rc}; see {prefix}.log"
    return rc, stats, report, err


def sweep(
    args,
    gw: TunedGateway,
    host: str,
    model: str,
    classes: dict,
    models: dict,
    cells: list,
    out: Path,
    meta: dict,
    per_cell: float,
) -> list[dict]:
    rows: list[dict] = []
    stop_at = time.monotonic() + args.max_minutes * 60
    timeout = args.cell_seconds + args.drain_seconds + 90  # start-up, spawning, drain, slack
    progress = Progress(len(cells), per_cell, not args.no_progress)
    try:
        for i, (policy, size, wait, rate) in enumerate(cells):
            if time.monotonic() > stop_at:
                print(f"ferry tune: --max-minutes reached after {i} cells; the results cover those", file=sys.stderr)
                break
            progress.describe(f"{policy} size={size} wait={wait:g}ms rate={rate:g}/s")
            gw.drain(model)
            gw.patch(model, max_batch_size=size, max_wait_ms=wait, policy=policy)
            time.sleep(0.3)
            before = gw.metrics()
            prefix = out / "locust" / f"cell{i:03d}"
            rc, stats, report, err = run_locust(args, host, rate, classes, models, prefix, timeout)
            after = gw.metrics()
            row: dict[str, Any] = {
                "cell": i,
                "policy": policy,
                "max_batch_size": size,
                "max_wait_ms": wait,
                "rate": rate,
                "slo_ms": args.slo_ms,
                "locust_rc": rc,
                "error": err,
            }
            row.update(
                cell_figures(stats, report, classes, args.slo_ms)
                if stats and report
                else {"error_rate": 1.0, "throughput_rps": 0.0, "goodput_rps": 0.0, "ok": 0}
            )
            row.update(ferry_figures(before, after, model))
            row["meets_slo"] = passes(row, args.slo_ms, args.max_error_rate)
            rows.append(row)
            write_results(out, rows, meta)  # partial results survive an interruption
            progress.step(
                f"  {setting_label(row):34s} rate {rate:6g}/s -> {row['throughput_rps']:7.1f}/s "
                f"p99 {fmt_ms(row.get('p99_ms')):>8s} err {row['error_rate']:.1%} "
                f"batch {row.get('mean_batch_size') if row.get('mean_batch_size') is not None else 'n/a'}"
                f"{'  ok' if row['meets_slo'] else ''}{'  ' + err if err else ''}"
            )
    finally:
        progress.close()
    return rows


def write_results(out: Path, rows: list[dict], meta: dict) -> None:
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))


class Progress:
    """tqdm when available (cells done, time left), else one line per cell."""

    def __init__(self, total: int, per_cell: float, enabled: bool):
        self.total, self.per_cell, self.done, self.t0 = total, per_cell, 0, time.monotonic()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(
                    total=total,
                    unit="cell",
                    file=sys.stderr,
                    dynamic_ncols=True,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} cells [{elapsed}<{remaining}] {postfix}",
                )
            except ImportError:
                pass
        self.enabled = enabled

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def step(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
        elif self.enabled:
            left = (time.monotonic() - self.t0) / self.done * (self.total - self.done)
            print(f"[{self.done}/{self.total} cells, ~{left:.0f} s left] {line}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
