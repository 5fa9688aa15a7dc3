"""/metrics with `--engine-cores` over real processes (FERRY_FAKE_ENGINES=1): one scrape of
the server shows the batching series of every core once each, next to the server's own
(gateway/metrics/merge.py), with the values the requests imply."""

from __future__ import annotations

import collections
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.observability.artifacts import catalogue

from .test_core import CHAT, EMBED, chat_body, core_of, serve

MODELS = ("fake-embed", "fake-chat")


def scrape(url: str) -> tuple[list, dict[tuple[str, tuple], float]]:
    text = httpx.get(url + "/metrics", timeout=30).text
    families = list(text_string_to_metric_families(text))
    samples: dict[tuple[str, tuple], float] = {}
    for f in families:
        for s in f.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"series twice in one scrape: {key}"
            samples[key] = s.value
    return families, samples


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_one_scrape_shows_every_cores_batching_series_once_with_the_values_the_requests_imply():
    with serve("--engine-cores") as gw:
        inputs = [["a", "b"], ["c"], ["d", "e", "f"]]
        for batch in inputs:
            r = httpx.post(gw.url + EMBED, json={"model": "fake-embed", "input": batch}, timeout=30)
            assert r.status_code == 200
        chat = httpx.post(gw.url + CHAT, json=chat_body("hello", max_tokens=5), timeout=30)
        assert chat.status_code == 200
        generated = chat.json()["usage"]["completion_tokens"]

        families, samples = scrape(gw.url)
        names = [f.name for f in families]
        assert len(names) == len(set(names)), "a family's HELP and TYPE twice"
        # Every metric of the catalogue (tests/observability/test_catalogue.py) is exposed,
        # and nothing else (but the `_created` series Prometheus' text format adds).
        exposed = {f.name + "_total" if f.type == "counter" else f.name for f in families}
        exposed -= {n for n in exposed if n.endswith("_created")}
        assert exposed == set(catalogue())

        per_model = collections.defaultdict(set)
        for name, labels in samples:
            model = dict(labels).get("model")
            if model in MODELS:
                per_model[model].add(name)
        for model in MODELS:
            assert {"ferry_batches_total", "ferry_queue_depth", "ferry_setting_max_batch_size"} <= per_model[model]
        assert value(samples, "ferry_items_total", model="fake-embed", status="result") == 6
        assert value(samples, "ferry_items_total", model="fake-chat", status="result") == 1
        assert value(samples, "ferry_generated_tokens_total", model="fake-chat") == generated
        assert value(samples, "ferry_requests_total", route=EMBED, model="fake-embed", status="200") == 3
        batches = sum(
            v for (n, labels), v in samples.items() if n == "ferry_batches_total" and ("model", "fake-embed") in labels
        )
        assert 1 <= batches <= 3

        # A second scrape: the counters of the core carry on, not counted twice.
        _, again = scrape(gw.url)
        assert value(again, "ferry_items_total", model="fake-embed", status="result") == 6


def test_a_stuck_core_is_left_out_of_the_scrape_and_the_others_still_show():
    """A core that does not answer within the scrape timeout (stopped here with SIGSTOP, so
    it is neither dead nor restarted) is left out of that scrape rather than failing it."""
    with serve("--engine-cores") as gw:
        r = httpx.post(gw.url + EMBED, json={"model": "fake-embed", "input": ["a"]}, timeout=30)
        assert r.status_code == 200
        chat_core = core_of(gw, "chat")
        chat_core.suspend()
        try:
            _, samples = scrape(gw.url)
        finally:
            chat_core.resume()
        # Only the server's own series of that model remain (its restart counter); none of
        # the core's batching series.
        chat_series = {name for name, labels in samples if dict(labels).get("model") == "fake-chat"}
        assert chat_series <= {"ferry_engine_core_restarts_total", "ferry_engine_core_restarts_created"}
        assert value(samples, "ferry_items_total", model="fake-embed", status="result") == 1
        assert value(samples, "ferry_requests_total", route=EMBED, model="fake-embed", status="200") == 1


def test_the_live_page_shows_the_cores_figures_settings_and_fitted_cost_models():
    """/ui/stats reads the same merged scrape, and each model's settings and cost model from
    its core (what the admin GET answers there)."""
    with serve("--engine-cores") as gw:
        assert httpx.get(gw.url + "/ui/stats", timeout=30).status_code == 200  # the window's start
        inputs = [["a", "b"], ["c"], ["d", "e", "f"]]
        for batch in inputs:
            assert (
                httpx.post(gw.url + EMBED, json={"model": "fake-embed", "input": batch}, timeout=30).status_code == 200
            )
        admin = {"Authorization": "Bearer t"}
        r = httpx.patch(gw.url + "/admin/models/fake-embed/batching", json={"max_batch_size": 3}, headers=admin)
        assert r.status_code == 200
        stats = httpx.get(gw.url + "/ui/stats", timeout=30).json()
        embed = next(m for m in stats["models"] if m["name"] == "fake-embed")
        assert embed["outcomes"]["result"] == sum(map(len, inputs))  # counted in the core
        assert embed["latency"]["request"]["count"] == len(inputs)  # counted in the server
        assert embed["knobs"]["max_batch_size"] == 3 and embed["config_changes"] == 1
        fit = embed["cost"]["embed"]
        assert fit["observations"] >= len(inputs) and fit["predicted"] and fit["observed"]["batches"] >= 1
        assert {m["name"] for m in stats["models"]} == set(MODELS)


def test_cached_prompt_tokens_cross_from_the_core_to_usage_and_metrics():
    """The fake engine in the chat core serves the whole 16-token blocks a prompt shares with
    one it prefilled before (`<system>` + 40 characters + `<user>`: three blocks); the count
    reaches each response's usage (streamed too), the core's prefix-cache counters and,
    with `--metrics-compat vllm`, vLLM's names."""
    system = {"role": "system", "content": "You are the harbour master of Ferry port"}
    with serve("--engine-cores", "--metrics-compat", "vllm") as gw:
        usages = []
        for question in ("When does the first boat leave?", "And the last?"):
            body = chat_body(question, max_tokens=2, messages=[system, {"role": "user", "content": question}])
            r = httpx.post(gw.url + CHAT, json=body, timeout=30)
            assert r.status_code == 200
            usages.append(r.json()["usage"])
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        body = chat_body("on time?", max_tokens=2, messages=[system, {"role": "user", "content": "On time?"}], **stream)
        with httpx.stream("POST", gw.url + CHAT, json=body, timeout=30) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        usages.append(json.loads(chunks[-1].removeprefix("data: "))["usage"])
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 48, 48]

        _, samples = scrape(gw.url)
        queries = value(samples, "ferry_prefix_cache_queries_total", model="fake-chat")
        assert queries == sum(u["prompt_tokens"] for u in usages)
        assert value(samples, "ferry_prefix_cache_hits_total", model="fake-chat") == 96
        assert value(samples, "vllm:prefix_cache_queries_total", model_name="fake-chat") == queries
        assert value(samples, "vllm:prefix_cache_hits_total", model_name="fake-chat") == 96
