"""The metrics sockets of a server's processes (`--api-workers N`): a peer answers with its
registry, a scrape merges the peers' series with its own and sums equal ones, and a peer
that is not there is left out."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics_merge import merged_exposition
from gateway.peer_metrics import MetricsServer, metrics_address, scrape_peers


def requests_counter(registry: CollectorRegistry) -> Counter:
    return Counter("ferry_requests_total", "HTTP requests.", ["route"], registry=registry)


def test_a_counter_incremented_in_two_processes_scrapes_as_the_sum(tmp_path):
    async def scenario() -> bytes:
        mine, peer = CollectorRegistry(), CollectorRegistry()
        requests_counter(mine).labels("/v1/embeddings").inc(3)
        theirs = requests_counter(peer)
        theirs.labels("/v1/embeddings").inc(4)
        theirs.labels("/v1/chat/completions").inc(1)  # a series only the peer has
        server = MetricsServer(peer, metrics_address(str(tmp_path), "front-1"))
        server.start()
        try:
            gone = metrics_address(str(tmp_path), "front-2")  # never bound: left out, quickly
            texts = await scrape_peers([metrics_address(str(tmp_path), "front-1"), gone], timeout=0.5)
            assert len(texts) == 1
            return merged_exposition(mine, texts)
        finally:
            await server.close()

    text = asyncio.run(scenario()).decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "ferry_requests"]
    totals = {s.labels["route"]: s.value for s in family.samples if s.name == "ferry_requests_total"}
    assert totals == {"/v1/embeddings": 7.0, "/v1/chat/completions": 1.0}
    assert text.count("# TYPE ferry_requests_total counter") == 1
