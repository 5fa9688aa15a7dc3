"""Locust users for Ferry: interactive chat, batch chat, embeddings.

    locust -f tuner/locustfile.py --headless --host http://127.0.0.1:8000 -t 30s \\
        --arrival-rate 20 --weight-interactive 1 --weight-batch 0 --weight-embed 3

User classes (pick a mix with the --weight-* options, `--tags`, or by naming classes):

- `InteractiveChatUser` (tags chat, interactive, stream): one conversation, streamed (SSE),
  with a latency budget in `X-Ferry-Latency-Budget-Ms`. Two entries: `chat (stream)` (the
  whole stream) and `TTFT chat` (time to first token, the number a chat user feels).
- `BatchChatUser` (tags chat, batch): several conversations in one request, `priority:
  batch`, no budget by default. Entry `batch chat`.
- `EmbeddingsUser` (tags embeddings, embed): one input (or --embed-inputs) per request.
  Entry `embeddings`.

Arrivals are open-loop by default (tuner/arrivals.py): `--arrival-rate R` requests per
second in total, split across classes by weight, or `--rate-steps 20:10,60:10`. Latency
(locust's response time) is measured from each request's *scheduled* arrival, so waiting
for a free user counts, as queueing would. `--arrival-rate 0` gives locust's usual closed
loop of `-u` users (with `--think-time` seconds between requests).

Every option can also be set in the environment as FERRY_LOAD_<OPTION> (e.g.
FERRY_LOAD_CHAT_MODEL=ferry-tiny-chat). `--ferry-report FILE` writes a JSON summary
(window, arrivals, late starts, per-entry counts within `--ferry-slo-ms`) used by
`ferry tune`. Targets 127.0.0.1 / localhost only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from urllib.parse import urlsplit

from locust import FastHttpUser, events, tag, task

if importlib.util.find_spec("tuner") is None:  # run from a checkout without the package installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tuner.arrivals import LOAD, ArrivalSchedule, parse_steps
from tuner.arrivals import ArrivalRateShape as ArrivalRateShape  # locust finds the load shape in this namespace
from tuner.percentile import percentile
from tuner.traffic import (
    BATCH_ENTRY,
    EMBED_ENTRY,
    LOOPBACK,
    REQUEST_ENTRIES,
    SLO_ENTRIES,
    STREAM_ENTRY,
    TTFT_ENTRY,
    question,
    sentence,
)

log = logging.getLogger("ferry.locust")

MAX_SSE_LINES = 100_000
MAX_SAMPLES = 200_000

# --------------------------------------------------------------------------- options


def _env(name: str, default):
    return os.environ.get("FERRY_LOAD_" + name.upper().replace("-", "_"), default)


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    def add(flag: str, default, type_, help_: str) -> None:
        key = flag.lstrip("-").removeprefix("ferry-")
        parser.add_argument(
            flag,
            type=type_,
            default=type_(_env(key, default)),
            help=f"{help_} (env FERRY_LOAD_{key.upper().replace('-', '_')}, default {default})",
        )

    add("--ferry-chat-model", "ferry-tiny-chat", str, "chat model name sent in requests")
    add("--ferry-embed-model", "sentence-transformers/all-MiniLM-L6-v2", str, "embeddings model name")
    add("--weight-interactive", 1.0, float, "share of arrivals (or users) for InteractiveChatUser; 0 leaves it out")
    add("--weight-batch", 1.0, float, "share for BatchChatUser; 0 leaves it out")
    add("--weight-embed", 1.0, float, "share for EmbeddingsUser; 0 leaves it out")
    add("--interactive-budget-ms", 1000.0, float, "latency budget of interactive chat (time to first token); 0: none")
    add("--batch-budget-ms", 0.0, float, "latency budget of batch chat; 0: the model default")
    add("--embed-budget-ms", 0.0, float, "latency budget of embeddings; 0: the model default")
    add("--chat-max-tokens", 16, int, "max_tokens of interactive chat")
    add("--batch-max-tokens", 32, int, "max_tokens of each batch conversation")
    add("--batch-conversations", 4, int, "conversations per batch chat request")
    add("--embed-inputs", 1, int, "inputs per embeddings request")
    add(
        "--arrival-rate",
        10.0,
        float,
        "open loop: total arrivals per second, split by weight; 0: closed loop of -u users",
    )
    add("--rate-steps", "", str, "open loop with stepped rates: RATE:SECONDS,... (e.g. 20:10,60:10)")
    add("--arrivals", "poisson", str, "arrival process: poisson or uniform")
    add("--pool-size", 0, int, "users in the open-loop pool (0: rate x --pool-latency-s + 2 per class)")
    add("--pool-latency-s", 2.0, float, "latency the automatic pool size allows for")
    add("--max-pool", 1000, int, "largest automatic pool")
    add("--think-time", 0.0, float, "closed loop only: seconds a user waits between requests")
    add("--ferry-slo-ms", 0.0, float, "latency objective counted in the report (0: none)")
    add("--ferry-report", "", str, "write a JSON summary here when the run ends")
    add("--seed", 0, int, "seed of the arrival times")


class Options:
    """Parsed options, with defaults when the locustfile is used as a library."""

    def __init__(self, ns=None):
        self.ns = ns

    def __getattr__(self, name):
        return getattr(self.ns, name)


RUN_OPTIONS = Options()

# --------------------------------------------------------------------------- report


class Report:
    """Per-entry counts and latencies (from the scheduled arrival), reset when spawning ends."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.entries: dict[str, dict] = {}
        self.lags: list[float] = []
        self.late = 0
        self.last_done = 0.0  # seconds after the first arrival when the last request finished

    def record(self, name: str, ms: float, failed: bool, slo_ms: float) -> None:
        e = self.entries.setdefault(name, {"n": 0, "failures": 0, "within_slo": 0, "ms": []})
        e["n"] += 1
        self.last_done = max(self.last_done, LOAD.elapsed())
        if failed:
            e["failures"] += 1
        elif slo_ms <= 0 or ms <= slo_ms:
            e["within_slo"] += 1
        if not failed and len(e["ms"]) < MAX_SAMPLES:
            e["ms"].append(ms)

    def lag(self, seconds: float) -> None:
        if seconds > 0.010:
            self.late += 1
        if len(self.lags) < MAX_SAMPLES:
            self.lags.append(seconds * 1000)

    def summary(self) -> dict:
        out = {}
        for name, e in self.entries.items():
            out[name] = {k: e[k] for k in ("n", "failures", "within_slo")} | {
                "p50_ms": _ms(e["ms"], 50),
                "p99_ms": _ms(e["ms"], 99),
                "max_ms": max(e["ms"], default=None),
            }
        return {
            "entries": out,
            "late_starts": self.late,
            "lag_p99_ms": _ms(self.lags, 99),
            "lag_max_ms": max(self.lags, default=None),
            "last_done_s": round(self.last_done, 3),
        }


def _ms(values: list[float], q: float) -> float | None:
    """A percentile for the JSON report: rounded, None (null) without samples."""
    p = percentile(values, q)
    return None if math.isnan(p) else round(p, 3)


REPORT = Report()


def _class_key(user_class) -> str:
    return getattr(user_class, "key", "")


@events.init.add_listener
def _on_init(environment, **_kw) -> None:
    opts = environment.parsed_options
    if opts is None:  # used as a library: nothing to configure
        return
    RUN_OPTIONS.ns = opts
    host = environment.host or opts.host or ""
    if urlsplit(host).hostname not in LOOPBACK:
        log.error("refusing host %r: this locustfile targets 127.0.0.1 / localhost only", host)
        sys.exit(2)
    if opts.arrivals not in ("poisson", "uniform"):
        log.error("--arrivals must be poisson or uniform")
        sys.exit(2)
    weights = {"interactive": opts.weight_interactive, "batch": opts.weight_batch, "embed": opts.weight_embed}
    if hasattr(environment, "_filter_tasks_by_tags"):
        environment._filter_tasks_by_tags()  # apply --tags now (locust does it lazily, once) to drop empty classes
    kept = []
    for uc in environment.user_classes:
        key = _class_key(uc)
        if key in weights:
            uc.weight = max(0, round(weights[key] * 100))  # locust weights are integers
        if uc.weight > 0 and uc.tasks:
            kept.append(uc)
    if not kept:
        log.error("no user class left: check --weight-* and --tags")
        sys.exit(2)
    environment.user_classes[:] = kept
    try:
        steps = parse_steps(opts.rate_steps)
    except ValueError as exc:
        log.error("%s", exc)
        sys.exit(2)
    schedule = ArrivalSchedule(rate=max(0.0, opts.arrival_rate), steps=steps, duration=opts.run_time or None)
    LOAD.configure(
        schedule,
        {_class_key(uc): uc.weight for uc in kept},
        poisson=opts.arrivals == "poisson",
        seed=opts.seed,
        pool_size=max(0, opts.pool_size),
        pool_latency_s=opts.pool_latency_s,
        max_pool=max(1, opts.max_pool),
    )
    if schedule.open_loop and opts.num_users:
        log.warning("open loop: -u is ignored, the pool has %d users (see --pool-size)", LOAD.pool_size)


@events.test_start.add_listener
def _on_test_start(**_kw) -> None:
    if LOAD.t0 is not None:  # a second test in the same process (web UI): start the schedule over
        LOAD.restart()


@events.spawning_complete.add_listener
def _on_spawned(user_count, **_kw) -> None:
    if LOAD.t0 is None:
        REPORT.reset()
        LOAD.start()


@events.request.add_listener
def _on_request(name, response_time, exception, **_kw) -> None:
    slo = RUN_OPTIONS.ferry_slo_ms if RUN_OPTIONS.ns is not None else 0.0
    REPORT.record(name, response_time, exception is not None, slo)


@events.test_stopping.add_listener
def _on_stopping(**_kw) -> None:
    if LOAD.t_stop is None:
        LOAD.t_stop = time.perf_counter()


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw) -> None:
    opts = environment.parsed_options
    if opts is None:
        return
    if getattr(opts, "csv_prefix", None):
        # locust rewrites its CSV once a second and does not write it again at exit: give it
        # one more turn so the files hold the final numbers (requests finished while stopping).
        import gevent
        from locust import stats as locust_stats

        gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.3)
    if not opts.ferry_report:
        return
    sched = LOAD.schedule
    if LOAD.t0 is None:
        window = 0.0
    else:
        window = (LOAD.t_stop or time.perf_counter()) - LOAD.t0
        if sched.open_loop and sched.end is not None:
            window = min(window, sched.end)
    summary = REPORT.summary()
    unclaimed = sum(p.unclaimed_before(window) for p in LOAD.pacers.values()) if sched.open_loop else 0
    if unclaimed:
        log.warning(
            "%d arrivals found every user busy and were never sent: the pool (%d) is too small for "
            "this latency; they count as unfinished",
            unclaimed,
            LOAD.pool_size,
        )
    summary.update(
        {
            "mode": "open" if sched.open_loop else "closed",
            "arrival_rate": sched.rate,
            "rate_steps": sched.steps,
            "arrivals": opts.arrivals,
            "window_s": round(window, 3),
            "pool_size": LOAD.pool_size if sched.open_loop else opts.num_users,
            # Offered load: every arrival of the window, including those no free user could take.
            "sent_on_schedule": sum(p.claimed for p in LOAD.pacers.values()),
            "never_sent": unclaimed,
            "scheduled": sum(p.claimed for p in LOAD.pacers.values()) + unclaimed,
            "classes": {k: {"weight": w, "share": LOAD.pacers[k].share} for k, w in LOAD.weights.items()},
            "slo_ms": opts.ferry_slo_ms,
            "slo_entries": SLO_ENTRIES,
            "request_entries": REQUEST_ENTRIES,
        }
    )
    with open(opts.ferry_report, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)


# --------------------------------------------------------------------------- users


def _error_code(resp) -> str:
    try:
        body = json.loads(resp.text or "{}")
        return str(body.get("error", {}).get("code") or "")
    except Exception:  # any unreadable body just has no code
        return ""


def _fail_http(resp) -> None:
    code = _error_code(resp) if resp.status_code else ""
    detail = (
        f"HTTP {resp.status_code} {code}".strip()
        if resp.status_code
        else f"connection error: {type(resp.error).__name__}"
    )
    resp.failure(detail)


class FerryUser(FastHttpUser):
    """Base: open-loop pacing in `wait_time`, latency from the scheduled arrival."""

    abstract = True
    key = ""
    network_timeout = 120.0
    connection_timeout = 10.0
    insecure = False

    def on_start(self) -> None:
        self._slot: float | None = None
        self._n = 0

    def wait_time(self) -> float:
        sched = LOAD.schedule
        if not sched.open_loop:
            return RUN_OPTIONS.think_time if RUN_OPTIONS.ns is not None else 0.0
        LOAD.started.wait()  # arrivals start once every user is spawned (killed here on stop)
        slot = LOAD.pacers[self.key].claim()
        if slot is None:  # arrivals are over: idle until the run stops
            return 3600.0
        self._slot = slot
        return max(0.0, slot - time.perf_counter())

    def arrival(self) -> float | None:
        """The scheduled arrival time of the request to send now (None: not yet paced)."""
        if not LOAD.schedule.open_loop:
            return time.perf_counter()
        slot, self._slot = self._slot, None
        if slot is not None:
            REPORT.lag(max(0.0, time.perf_counter() - slot))
        return slot

    def next_index(self) -> int:
        self._n += 1
        return hash((id(self), self._n)) & 0xFFFF

    @staticmethod
    def budget_headers(ms: float) -> dict[str, str]:
        return {"X-Ferry-Latency-Budget-Ms": f"{ms:g}"} if ms and ms > 0 else {}


class InteractiveChatUser(FerryUser):
    """A person chatting: one conversation, streamed, with a latency budget on TTFT."""

    key = "interactive"
    weight = 1

    @tag("chat", "interactive", "stream")
    @task
    def chat_stream(self) -> None:
        start = self.arrival()
        if start is None:
            return
        body = {
            "model": RUN_OPTIONS.ferry_chat_model,
            "messages": [{"role": "user", "content": question(self.next_index())}],
            "max_tokens": RUN_OPTIONS.chat_max_tokens,
            "temperature": 0,
            "stream": True,
        }
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=self.budget_headers(RUN_OPTIONS.interactive_budget_ms),
            stream=True,
            catch_response=True,
            name=STREAM_ENTRY,
        ) as resp:
            ttft, problem, nbytes = None, None, 0
            if resp.status_code == 200:
                ttft, problem, nbytes = read_stream(resp, start)
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            resp.request_meta["response_length"] = nbytes
            if resp.status_code != 200:
                _fail_http(resp)
            elif problem or ttft is None:  # read_stream names a problem whenever no token came
                resp.failure(problem)
            else:
                resp.success()
                self.environment.events.request.fire(
                    request_type="SSE",
                    name=TTFT_ENTRY,
                    response_time=ttft * 1000,
                    response_length=0,
                    exception=None,
                    context={},
                    response=None,
                    url=None,
                    start_time=time.time(),
                )


def sse_lines(resp):
    """Lines of a streamed response as they arrive (bounded)."""
    raw = getattr(resp, "_response", None)
    if raw is not None and hasattr(raw, "readline"):
        for _ in range(MAX_SSE_LINES):
            line = raw.readline(b"\n")
            if not line:
                return
            yield line.decode("utf-8", "replace").rstrip("\r\n")
        return
    buf = ""
    for chunk in resp.iter_content(chunk_size=256):  # fallback: may batch lines, delaying TTFT
        buf += chunk if isinstance(chunk, str) else chunk.decode("utf-8", "replace")
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            yield line.rstrip("\r")


def read_stream(resp, start: float) -> tuple[float | None, str | None, int]:
    """Read an SSE chat stream: (time to first content token in s, problem or None, bytes)."""
    ttft, done, nbytes = None, False, 0
    for line in sse_lines(resp):
        nbytes += len(line) + 1
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            obj = json.loads(data)
        except ValueError:
            return ttft, "bad SSE event", nbytes
        if "error" in obj:
            return ttft, f"stream error {obj['error'].get('code') or ''}".strip(), nbytes
        for choice in obj.get("choices") or []:
            if choice.get("error") or choice.get("finish_reason") == "error":
                return ttft, "stream error", nbytes
            if ttft is None and (choice.get("delta") or {}).get("content"):
                ttft = time.perf_counter() - start
    if not done:
        return ttft, "stream ended without [DONE]", nbytes
    if ttft is None:
        return ttft, "no token in stream", nbytes
    return ttft, None, nbytes


class BatchChatUser(FerryUser):
    """An offline job: several conversations in one request, priority batch."""

    key = "batch"
    weight = 1

    @tag("chat", "batch")
    @task
    def batch_chat(self) -> None:
        start = self.arrival()
        if start is None:
            return
        k = max(1, RUN_OPTIONS.batch_conversations)
        i = self.next_index()
        body = {
            "model": RUN_OPTIONS.ferry_chat_model,
            "messages": [[{"role": "user", "content": question(i + j)}] for j in range(k)],
            "max_tokens": RUN_OPTIONS.batch_max_tokens,
            "temperature": 0,
            "priority": "batch",
        }
        if RUN_OPTIONS.batch_budget_ms > 0:
            body["latency_budget_ms"] = RUN_OPTIONS.batch_budget_ms
        with self.client.post("/v1/chat/completions", json=body, catch_response=True, name=BATCH_ENTRY) as resp:
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            if resp.status_code != 200:
                _fail_http(resp)
                return
            try:
                choices = json.loads(resp.text)["choices"]
            except (ValueError, KeyError, TypeError):
                resp.failure("bad response body")
                return
            if len(choices) != k:
                resp.failure(f"expected {k} choices")


class EmbeddingsUser(FerryUser):
    """Search or RAG traffic: one short text (or --embed-inputs) per request."""

    key = "embed"
    weight = 1

    @tag("embeddings", "embed")
    @task
    def embed(self) -> None:
        start = self.arrival()
        if start is None:
            return
        n = max(1, RUN_OPTIONS.embed_inputs)
        i = self.next_index()
        body = {
            "model": RUN_OPTIONS.ferry_embed_model,
            "input": sentence(i) if n == 1 else [sentence(i + j) for j in range(n)],
        }
        with self.client.post(
            "/v1/embeddings",
            json=body,
            headers=self.budget_headers(RUN_OPTIONS.embed_budget_ms),
            catch_response=True,
            name=EMBED_ENTRY,
        ) as resp:
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            if resp.status_code != 200:
                _fail_http(resp)
                return
            try:
                data = json.loads(resp.text)["data"]
            except (ValueError, KeyError, TypeError):
                resp.failure("bad response body")
                return
            if len(data) != n:
                resp.failure(f"expected {n} embeddings")
