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

This file wires locust's events; the parts are modules of their own: the users
(tuner/users.py), the options (tuner/options.py) and the report (tuner/report.py).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from urllib.parse import urlsplit

from locust import events

if importlib.util.find_spec("tuner") is None:  # run from a checkout without the package installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tuner.arrivals import LOAD, ArrivalSchedule, parse_steps
from tuner.arrivals import ArrivalRateShape as ArrivalRateShape  # locust finds the load shape in this namespace
from tuner.options import RUN_OPTIONS, add_options
from tuner.report import REPORT
from tuner.traffic import LOOPBACK, REQUEST_ENTRIES, SLO_ENTRIES

# locust finds the user classes in this namespace
from tuner.users import BatchChatUser as BatchChatUser
from tuner.users import EmbeddingsUser as EmbeddingsUser
from tuner.users import InteractiveChatUser as InteractiveChatUser

log = logging.getLogger("ferry.locust")

events.init_command_line_parser.add_listener(add_options)


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
