"""`ferry tune` (also `python -m loadtests.tune`): sweep batching settings under open-loop
load with locust and recommend the setting with the most throughput within a latency SLO.

    ferry serve --chat-model none --admin-token t &
    ferry tune --admin-token t --sizes 1,8,32 --waits 0,10 --rates 40,120 \\
        --cell-seconds 8 --slo-ms 200 --out tune-out

For every setting (policy x max_batch_size x max_wait_ms) and every arrival rate, one
*cell*: the setting is applied live (PATCH /admin/models/{model}/batching), locust runs
headless for --cell-seconds of open-loop arrivals (loadtests/locustfile.py, same arrival
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
import csv
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# What the locustfile reports (kept in step with loadtests/locustfile.py).
SLO_ENTRIES = {"interactive": "TTFT chat", "batch": "batch chat", "embed": "embeddings"}
REQUEST_ENTRIES = {"interactive": "chat (stream)", "batch": "batch chat", "embed": "embeddings"}
CLASS_ALIASES = {"interactive": "interactive", "chat": "interactive", "stream": "interactive",
                 "batch": "batch", "batch-chat": "batch", "embed": "embed", "embeddings": "embed"}
REASONS = ("full", "max_wait", "deadline", "adaptive", "drain")
REJECTIONS = ("queue_full", "deadline_infeasible")
CELL_OVERHEAD_S = 4.0  # locust start-up, spawning, metrics scrapes: for the time estimate
COLUMNS = [
    "cell", "policy", "max_batch_size", "max_wait_ms", "rate", "offered_rps", "window_s", "span_s", "scheduled", "sent", "ok", "failures",
    "unfinished", "error_rate", "throughput_rps", "goodput_rps", "p50_ms", "p95_ms", "p99_ms", "max_ms",
    "slo_ms", "meets_slo", "late_starts", "lag_p99_ms", "mean_batch_size", "mean_decode_batch", "batches",
    *(f"dispatch_{r}" for r in REASONS), *(f"rejected_{r}" for r in REJECTIONS), "expired", "mean_queue_wait_ms",
    "locust_rc", "error",
]


# --------------------------------------------------------------------------- arguments

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
    p = argparse.ArgumentParser(prog="ferry tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See docs/tuning.md for a worked example.")
    p.add_argument("--host", default=os.environ.get("FERRY_TUNE_HOST", "http://127.0.0.1:8000"),
                   help="gateway URL, 127.0.0.1/localhost only (default %(default)s)")
    p.add_argument("--admin-token", default=os.environ.get("FERRY_ADMIN_TOKEN"),
                   help="the gateway's --admin-token (env FERRY_ADMIN_TOKEN)")
    p.add_argument("--model", help="model to tune (default: the first served model of the route's kind)")
    p.add_argument("--route", choices=["embeddings", "chat", "batch-chat"],
                   help="traffic: embeddings, chat (interactive, streamed) or batch-chat (default: from the model's kind)")
    p.add_argument("--mix", help="traffic mix instead of --route, e.g. embed=3,interactive=1 (classes: embed, interactive, batch)")
    p.add_argument("--embed-model", help="embeddings model name for the mix (default: --model or the first served)")
    p.add_argument("--chat-model", help="chat model name for the mix (default: --model or the first served)")
    p.add_argument("--sizes", type=_ints, default=[1, 8, 32], help="max_batch_size values (default 1,8,32)")
    p.add_argument("--waits", type=_floats, default=[0.0, 5.0, 20.0], help="max_wait_ms values (default 0,5,20)")
    p.add_argument("--policies", type=_names, default=["fixed"], help="policies, e.g. fixed,adaptive (default fixed)")
    p.add_argument("--rates", type=_floats, default=[20.0, 40.0, 80.0], help="arrival rates, requests/s (default 20,40,80)")
    p.add_argument("--cell-seconds", type=float, default=10.0, help="seconds of arrivals per cell (default 10)")
    p.add_argument("--slo-ms", type=float, default=200.0, help="p99 latency objective in ms (default 200)")
    p.add_argument("--max-error-rate", type=float, default=0.01, help="most failures per request in a passing cell (default 0.01)")
    p.add_argument("--tie-tolerance", type=float, default=0.02,
                   help="throughputs within this fraction of the best tie; the lower p99 wins (default 0.02)")
    p.add_argument("--drain-seconds", type=float, default=10.0,
                   help="after the arrivals, how long requests in flight may finish (default 10)")
    p.add_argument("--pool-latency-s", type=float, default=2.0, help="locust pool = rate x this (default 2)")
    p.add_argument("--locust-args", default="", help="extra locustfile options, e.g. '--chat-max-tokens 8'")
    p.add_argument("--out", default="tune-out", help="output directory (default %(default)s)")
    p.add_argument("--max-cells", type=int, default=500, help="refuse larger grids (default 500)")
    p.add_argument("--max-minutes", type=float, default=120.0, help="refuse longer sweeps, and stop one that overruns (default 120)")
    p.add_argument("--apply", action="store_true", help="leave the recommended setting applied (default: restore the original)")
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


# --------------------------------------------------------------------------- gateway

class Gateway:
    def __init__(self, host: str, token: str | None):
        self.host = host
        self.http = httpx.Client(base_url=host, timeout=10.0)
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}

    def close(self) -> None:
        self.http.close()

    def models(self) -> list[dict]:
        r = self.http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"]

    def _admin_url(self, model: str) -> str:
        return f"/admin/models/{model}/batching"

    def settings(self, model: str) -> dict:
        r = self.http.get(self._admin_url(model), headers=self.auth)
        if r.status_code in (401, 404):
            hint = "" if r.status_code == 401 or r.json().get("error", {}).get("code") == "model_not_found" else \
                " (is the gateway running with --admin-token?)"
            raise SystemExit(f"ferry tune: admin API: HTTP {r.status_code} {r.json().get('error', {}).get('message', '')}{hint}")
        r.raise_for_status()
        return r.json()

    def patch(self, model: str, **changes: Any) -> dict:
        r = self.http.patch(self._admin_url(model), headers=self.auth, json=changes)
        if r.status_code != 200:
            raise SystemExit(f"ferry tune: setting {changes} refused: HTTP {r.status_code} {r.text[:300]}")
        return r.json()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return parse_metrics(self.http.get("/metrics").text)

    def drain(self, model: str, timeout: float = 30.0) -> None:
        """Wait (bounded) until the model's queue is empty and nothing is in flight."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            queued = sum(v for (name, labels), v in m.items() if name == "ferry_queue_depth" and dict(labels).get("model") == model)
            flying = sum(v for (name, labels), v in m.items() if name == "ferry_requests_in_flight"
                         and dict(labels).get("route", "").startswith("/v1/"))
            if queued == 0 and flying == 0:
                return
            time.sleep(0.2)


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_delta(before: dict, after: dict, name: str, model: str, **match: str) -> float:
    total = 0.0
    for key, value in after.items():
        n, labels = key
        if n != name:
            continue
        d = dict(labels)
        if d.get("model") != model or any(d.get(k) != v for k, v in match.items()):
            continue
        total += value - before.get(key, 0.0)
    return total


def ferry_figures(before: dict, after: dict, model: str) -> dict[str, float | None]:
    def mean(name: str, **match: str) -> float | None:
        n = metric_delta(before, after, name + "_count", model, **match)
        return metric_delta(before, after, name + "_sum", model, **match) / n if n > 0 else None

    size = mean("ferry_batch_size_items", phase="embed")
    if size is None:
        size = mean("ferry_batch_size_items", phase="prefill")
    wait = mean("ferry_queue_wait_seconds")
    out: dict[str, float | None] = {
        "mean_batch_size": _round(size, 2),
        "mean_decode_batch": _round(mean("ferry_batch_size_items", phase="decode"), 2),
        "batches": metric_delta(before, after, "ferry_batches_total", model),
        "expired": metric_delta(before, after, "ferry_expired_total", model),
        "mean_queue_wait_ms": _round(wait * 1000 if wait is not None else None, 2),
    }
    for r in REASONS:
        out[f"dispatch_{r}"] = metric_delta(before, after, "ferry_batches_total", model, reason=r)
    for r in REJECTIONS:
        out[f"rejected_{r}"] = metric_delta(before, after, "ferry_rejections_total", model, reason=r)
    return out


def _round(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


# --------------------------------------------------------------------------- locust

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
            v = _num(slo_row, col)
            if v is not None and (worst[key] is None or v > worst[key]):  # the worst class decides
                worst[key] = v
    unfinished = max(0, scheduled - sent)
    ok = sent - failures
    total = max(scheduled, sent)
    return {
        "window_s": round(window, 3), "span_s": round(span, 3), "scheduled": scheduled,
        "offered_rps": round(scheduled / window, 3) if window > 0 else 0.0, "sent": sent, "ok": ok, "failures": failures,
        "unfinished": unfinished, "error_rate": round((failures + unfinished) / total, 4) if total else 1.0,
        "throughput_rps": round(ok / span, 3) if span > 0 else 0.0,
        "goodput_rps": round(good / span, 3) if span > 0 else 0.0,
        **worst, "max_ms": _round(worst["max_ms"], 1),
        "late_starts": int(report.get("late_starts") or 0), "lag_p99_ms": report.get("lag_p99_ms"),
    }


def run_locust(args, gw_host: str, rate: float, classes: dict[str, float], models: dict[str, str],
               prefix: Path, timeout: float) -> tuple[int, dict, dict, str]:
    weights = {c: classes.get(c, 0.0) for c in ("interactive", "batch", "embed")}
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", gw_host,
           "-t", f"{max(1, round(args.cell_seconds))}s", "--stop-timeout", f"{args.drain_seconds:g}",
           "--reset-stats", "--only-summary", "--loglevel", "WARNING", "--exit-code-on-error", "0",
           "--csv", str(prefix), "--arrival-rate", f"{rate:g}", "--seed", str(int(rate * 1000) % 100_000),
           "--pool-latency-s", f"{args.pool_latency_s:g}", "--ferry-slo-ms", f"{args.slo_ms:g}",
           "--ferry-report", str(prefix) + "_report.json",
           "--weight-interactive", f"{weights['interactive']:g}", "--weight-batch", f"{weights['batch']:g}",
           "--weight-embed", f"{weights['embed']:g}"]
    if models.get("chat"):
        cmd += ["--ferry-chat-model", models["chat"]]
    if models.get("embed"):
        cmd += ["--ferry-embed-model", models["embed"]]
    cmd += shlex.split(args.locust_args)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCUST_", "FERRY_LOAD_"))}
    log = open(str(prefix) + ".log", "w", encoding="utf-8")
    try:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        rc, err = proc.returncode, ""
    except subprocess.TimeoutExpired:
        rc, err = -9, f"locust timed out after {timeout:.0f} s"
    finally:
        log.close()
    stats, report = {}, {}
    try:
        stats = read_locust_csv(Path(str(prefix) + "_stats.csv"))
        report = json.loads(Path(str(prefix) + "_report.json").read_text())
    except (OSError, ValueError) as exc:
        err = err or f"no locust results ({exc.__class__.__name__}); see {prefix}.log"
    if rc not in (0,) and not err:
        err = f"locust exited {rc}; see {prefix}.log"
    return rc, stats, report, err


# --------------------------------------------------------------------------- recommendation

def passes(row: dict, slo_ms: float, max_error_rate: float) -> bool:
    p99, er, ok = row.get("p99_ms"), row.get("error_rate"), row.get("ok")
    if p99 in (None, "") or er in (None, "") or not ok or row.get("error"):
        return False
    return float(p99) <= slo_ms and float(er) <= max_error_rate and int(float(ok)) > 0


def _tiebreak(row: dict) -> tuple:
    return (float(row["p99_ms"]), float(row["max_wait_ms"]), int(float(row["max_batch_size"])), str(row["policy"]))


def recommend(rows: list[dict], slo_ms: float, max_error_rate: float, tolerance: float = 0.02) -> dict | None:
    """The cell with the most throughput among those within the SLO (see the module doc)."""
    ok = [r for r in rows if passes(r, slo_ms, max_error_rate)]
    if not ok:
        return None
    best = max(float(r["throughput_rps"]) for r in ok)
    tied = [r for r in ok if float(r["throughput_rps"]) >= best * (1 - tolerance)]
    return min(tied, key=_tiebreak)


def recommend_throughput(rows: list[dict], max_error_rate: float, tolerance: float = 0.02) -> dict | None:
    """No latency cap (batch traffic): the most throughput with few errors."""
    return recommend(rows, math.inf, max_error_rate, tolerance)


def setting_label(row: dict) -> str:
    return f"{row['policy']} size={int(float(row['max_batch_size']))} wait={float(row['max_wait_ms']):g}ms"


def setting_key(row: dict) -> tuple:
    return (str(row["policy"]), int(float(row["max_batch_size"])), float(row["max_wait_ms"]))


def evidence(rows: list[dict], rec: dict | None, args) -> str:
    lines = []
    slo = args.slo_ms
    if rec is None:
        lines.append(f"No setting kept p99 within {slo:g} ms with at most {args.max_error_rate:.1%} errors "
                     "at any tested rate: lower the rates, raise --slo-ms, or add capacity.")
    else:
        lines.append(f"Recommended for p99 <= {slo:g} ms: policy={rec['policy']} "
                     f"max_batch_size={int(float(rec['max_batch_size']))} max_wait_ms={float(rec['max_wait_ms']):g}")
        lines.append("  evidence: " + describe(rec))
    lines.append("  per setting (best rate within the SLO | first rate that failed it):")
    by_setting: dict[tuple, list[dict]] = {}
    for r in rows:
        by_setting.setdefault(setting_key(r), []).append(r)
    for key, rs in sorted(by_setting.items()):
        rs = sorted(rs, key=lambda r: float(r["rate"]))
        good = [r for r in rs if passes(r, slo, args.max_error_rate)]
        bad = [r for r in rs if not passes(r, slo, args.max_error_rate)]
        left = (f"{float(good[-1]['rate']):g}/s -> {float(good[-1]['throughput_rps']):.1f}/s p99 {_fmt(good[-1]['p99_ms'])}"
                if good else "none")
        right = f"{float(bad[0]['rate']):g}/s: {why(bad[0], slo, args.max_error_rate)}" if bad else "none failed"
        mark = " <-" if rec is not None and setting_key(rec) == key else ""
        lines.append(f"    {setting_label(rs[0]):34s} {left:38s} | {right}{mark}")
    thr = recommend_throughput(rows, args.max_error_rate, args.tie_tolerance)
    if thr is not None:
        lines.append(f"Without a latency cap (batch traffic) the most throughput: {setting_label(thr)}: {describe(thr)}")
    return "\n".join(lines)


def _fmt(ms: Any) -> str:
    return "n/a" if ms in (None, "") else f"{float(ms):.0f} ms"


def describe(r: dict) -> str:
    reasons = ", ".join(f"{x} {int(float(r.get(f'dispatch_{x}') or 0))}" for x in REASONS if float(r.get(f"dispatch_{x}") or 0))
    mb = r.get("mean_batch_size")
    return (f"at {float(r['rate']):g} req/s offered: {float(r['throughput_rps']):.1f} req/s served, "
            f"p50 {_fmt(r.get('p50_ms'))}, p99 {_fmt(r.get('p99_ms'))}, errors {float(r['error_rate']):.1%}, "
            f"goodput {float(r['goodput_rps']):.1f} req/s, mean batch {mb if mb not in (None, '') else 'n/a'}"
            + (f" (dispatches: {reasons})" if reasons else ""))


def why(r: dict, slo: float, max_er: float) -> str:
    if r.get("error"):
        return str(r["error"])
    parts = []
    if r.get("p99_ms") not in (None, "") and float(r["p99_ms"]) > slo:
        parts.append(f"p99 {float(r['p99_ms']):.0f} ms")
    if float(r.get("error_rate") or 0) > max_er:
        parts.append(f"errors {float(r['error_rate']):.1%}")
    return ", ".join(parts) or "no successful request"


# --------------------------------------------------------------------------- output

def write_results(out: Path, rows: list[dict], meta: dict) -> None:
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))


def plot(out: Path, rows: list[dict], slo_ms: float, rec: dict | None, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_setting: dict[tuple, list[dict]] = {}
    for r in rows:
        by_setting.setdefault(setting_key(r), []).append(r)
    keys = sorted(by_setting)
    cmap = plt.get_cmap("tab20" if len(keys) > 10 else "tab10")
    styles = {k: dict(color=cmap(i % cmap.N), marker="os^Dv<>ph*"[i % 10], linestyle=["-", "--", ":", "-."][(i // 10) % 4])
              for i, k in enumerate(keys)}

    def figure(name: str, xlabel: str, ylabel: str, series, extra=None, logy=False) -> Path:
        fig, ax = plt.subplots(figsize=(9.5, 5.5), dpi=110)
        for k in keys:
            pts = [(x, y) for x, y in series(sorted(by_setting[k], key=lambda r: float(r["rate"]))) if x is not None and y is not None]
            if pts:
                ax.plot(*zip(*pts), label=setting_label(by_setting[k][0]), **styles[k])
        if extra:
            extra(ax)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        return path

    def num(r: dict, k: str) -> float | None:
        v = r.get(k)
        return None if v in (None, "") else float(v)

    def slo_line(ax) -> None:
        ax.axhline(slo_ms, color="crimson", linestyle="--", linewidth=1, label=f"SLO p99 {slo_ms:g} ms")
        if rec is not None and num(rec, "p99_ms") is not None:
            ax.plot([float(rec["throughput_rps"])], [float(rec["p99_ms"])], marker="*", markersize=18, color="gold",
                    markeredgecolor="black", linestyle="none", label="recommended", zorder=5)

    def offered(ax) -> None:
        rates = sorted({float(r["rate"]) for r in rows})
        ax.plot(rates, rates, color="grey", linestyle=":", linewidth=1, label="offered rate")
        if rec is not None:
            ax.plot([float(rec["rate"])], [float(rec["goodput_rps"])], marker="*", markersize=18, color="gold",
                    markeredgecolor="black", linestyle="none", label="recommended", zorder=5)

    return [
        figure("p99_vs_throughput.png", "throughput (successful requests/s)", "p99 latency (ms, log)",
               lambda rs: [(num(r, "throughput_rps"), num(r, "p99_ms")) for r in rs], slo_line, logy=True),
        figure("goodput_vs_rate.png", "offered arrival rate (requests/s)", f"goodput (requests/s within {slo_ms:g} ms)",
               lambda rs: [(float(r["rate"]), num(r, "goodput_rps")) for r in rs], offered),
        figure("batch_size_vs_rate.png", "offered arrival rate (requests/s)", "mean batch size (items, Ferry metrics)",
               lambda rs: [(float(r["rate"]), num(r, "mean_batch_size")) for r in rs]),
    ]


class Progress:
    """tqdm when available (cells done, time left), else one line per cell."""

    def __init__(self, total: int, per_cell: float, enabled: bool):
        self.total, self.per_cell, self.done, self.t0 = total, per_cell, 0, time.monotonic()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="cell", file=sys.stderr, dynamic_ncols=True,
                                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} cells [{elapsed}<{remaining}] {postfix}")
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


# --------------------------------------------------------------------------- main

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

    models = {}
    if "embed" in classes:
        models["embed"] = args.embed_model or (args.model if args.model and kinds[args.model] == "embedding" else first("embedding"))
    if {"interactive", "batch"} & set(classes):
        models["chat"] = args.chat_model or (args.model if args.model and kinds[args.model] == "chat" else first("chat"))
    for kind, name in models.items():
        if not name:
            raise SystemExit(f"ferry tune: no {kind} model is served for this traffic")
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
    grid = [(p, s, w) for p in dict.fromkeys(args.policies) for s in dict.fromkeys(args.sizes) for w in dict.fromkeys(args.waits)]
    rates = sorted(set(args.rates))
    cells = [(p, s, w, r) for (p, s, w), r in itertools.product(grid, rates)]
    per_cell = args.cell_seconds + CELL_OVERHEAD_S + 0.5
    estimate = len(cells) * per_cell
    print(f"ferry tune: {len(grid)} settings x {len(rates)} rates = {len(cells)} cells of {args.cell_seconds:g} s, "
          f"about {estimate / 60:.1f} min", file=sys.stderr)
    if len(cells) > args.max_cells:
        raise SystemExit(f"ferry tune: {len(cells)} cells is more than --max-cells {args.max_cells}")
    if estimate > args.max_minutes * 60:
        raise SystemExit(f"ferry tune: about {estimate / 60:.0f} min is more than --max-minutes {args.max_minutes:g}")
    if args.dry_run:
        for c in cells:
            print("  policy=%s max_batch_size=%d max_wait_ms=%g rate=%g" % c)
        return 0
    import importlib.util

    if importlib.util.find_spec("locust") is None:
        raise SystemExit("ferry tune: locust is not installed: pip install -e '.[load]'")
    if not args.admin_token:
        raise SystemExit("ferry tune: --admin-token is required (start the gateway with --admin-token)")

    gw = Gateway(host, args.admin_token)
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
        meta = {"host": host, "model": model, "classes": classes, "models": models, "slo_ms": args.slo_ms,
                "max_error_rate": args.max_error_rate, "tie_tolerance": args.tie_tolerance,
                "cell_seconds": args.cell_seconds, "original_settings": keep,
                "argv": redact(list(argv) if argv is not None else sys.argv[1:])}
        print(f"ferry tune: model {model}, traffic {classes}, SLO p99 <= {args.slo_ms:g} ms, results in {out}/", file=sys.stderr)
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
            gw.patch(model, max_batch_size=int(rec["max_batch_size"]), max_wait_ms=float(rec["max_wait_ms"]), policy=rec["policy"])
            print("  applied the recommended setting")
        else:
            gw.patch(model, **keep)
    finally:
        gw.close()
    return 0


def sweep(args, gw: Gateway, host: str, model: str, classes: dict, models: dict, cells: list, out: Path,
          meta: dict, per_cell: float) -> list[dict]:
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
            row: dict[str, Any] = {"cell": i, "policy": policy, "max_batch_size": size, "max_wait_ms": wait,
                                   "rate": rate, "slo_ms": args.slo_ms, "locust_rc": rc, "error": err}
            row.update(cell_figures(stats, report, classes, args.slo_ms) if stats and report else
                       {"error_rate": 1.0, "throughput_rps": 0.0, "goodput_rps": 0.0, "ok": 0})
            row.update(ferry_figures(before, after, model))
            row["meets_slo"] = passes(row, args.slo_ms, args.max_error_rate)
            rows.append(row)
            write_results(out, rows, meta)  # partial results survive an interruption
            progress.step(f"  {setting_label(row):34s} rate {rate:6g}/s -> {row['throughput_rps']:7.1f}/s "
                          f"p99 {_fmt(row.get('p99_ms')):>8s} err {row['error_rate']:.1%} "
                          f"batch {row.get('mean_batch_size') if row.get('mean_batch_size') is not None else 'n/a'}"
                          f"{'  ok' if row['meets_slo'] else ''}{'  ' + err if err else ''}")
    finally:
        progress.close()
    return rows


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
