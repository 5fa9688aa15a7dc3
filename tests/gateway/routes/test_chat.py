"""/v1/chat/completions and /v1/completions over a real socket with the fake engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.fake import FakeGenerationEngine

from ...waiting import async_wait_until, wait_until

CONV_A = [{"role": "user", "content": "Respond with a single word greeting."}]
CONV_B = [{"role": "user", "content": "List three colors separated by commas."}]


def chat(server, **body):
    body.setdefault("model", "fake-chat")
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_two_conversations_with_per_prompt_parameters(fake_server_factory):
    s = fake_server_factory()
    r = chat(s, messages=[CONV_A, CONV_B], temperature=[0.0, 0.0], max_completion_tokens=[1, 8], stop=[["!"], ["w5"]])
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["prompt_index"] for c in body["choices"]] == [0, 1]
    a, b = (c["message"]["content"] for c in body["choices"])
    assert a == "w0 " and body["choices"][0]["finish_reason"] == "length"
    assert b == "w0 w1 w2 w3 w4 " and body["choices"][1]["finish_reason"] == "stop"  # stop string excluded
    assert body["usage"]["completion_tokens"] == 1 + 6
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 7
    assert body["object"] == "chat.completion"


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", [0.1, 0.2, 0.3]),
        ("max_completion_tokens", [4]),
        ("seed", [1, 2, 3]),
        ("stop", [["a"], ["b"], ["c"]]),
        ("top_p", [0.5]),
    ],
)
def test_wrong_per_prompt_list_length_is_422_naming_the_field(fake_server_factory, field, value):
    s = fake_server_factory()
    r = chat(s, messages=[CONV_A, CONV_B], **{field: value})
    assert r.status_code == 422
    assert r.json()["error"]["param"] == field
    assert s.ferry.models["fake-chat"].engine.calls == []


def test_independent_stopping_2_5_8(fake_server_factory):
    s = fake_server_factory(max_wait_ms=50)
    r = chat(s, messages=[CONV_A, CONV_B, CONV_A], max_tokens=[2, 5, 8])
    counts = [len(c["message"]["content"].split()) for c in r.json()["choices"]]
    assert counts == [2, 5, 8]
    assert {c["finish_reason"] for c in r.json()["choices"]} == {"length"}


def test_streaming_is_demultiplexed_by_prompt_index(fake_server_factory):
    s = fake_server_factory()
    body = {
        "model": "fake-chat",
        "messages": [CONV_A, CONV_B],
        "max_tokens": [3, 6],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9
    buffers, finish = {0: "", 1: ""}, {}
    for e in events[:-2]:
        assert e["object"] == "chat.completion.chunk"
        assert "usage" in e and e["usage"] is None  # OpenAI's: every chunk but the last says null
        (choice,) = e["choices"]
        buffers[choice["prompt_index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finish[choice["prompt_index"]] = choice["finish_reason"]
    assert buffers == {0: "w0 w1 w2 ", 1: "w0 w1 w2 w3 w4 w5 "}
    assert finish == {0: "length", 1: "length"}


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(fake_server_factory):
    """The fake engine serves the whole 16-token blocks a prompt shares with one it
    prefilled before: `<system>` + a 40-character system prompt + `<user>` is 54 tokens,
    three whole blocks."""
    s = fake_server_factory()
    system = {"role": "system", "content": "You are the harbour master of Ferry port"}
    assert len(system["content"]) == 40

    def conv(question: str) -> list:
        return [system, {"role": "user", "content": question}]

    first = chat(s, messages=conv("When does the first boat leave?"), max_tokens=2).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = chat(s, messages=conv("And the last?"), max_tokens=2).json()["usage"]
    assert second["prompt_tokens_details"] == {"cached_tokens": 48}
    assert second["prompt_tokens"] == 54 + len("And the last?") + len("<assistant>")
    body = {"messages": conv("Is it on time?"), "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST",
        s.url + "/v1/chat/completions",
        json={"model": "fake-chat", **body, "stream_options": {"include_usage": True}},
    ) as r:
        events = sse_events(r)
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    completion = httpx.post(
        s.url + "/v1/completions",
        json={"model": "fake-chat", "prompt": "<system>" + system["content"], "max_tokens": 1},
    ).json()
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}  # 48 tokens: the last is never served


def test_n_candidates_per_prompt(fake_server_factory):
    s = fake_server_factory()
    r = chat(s, messages=[CONV_A, CONV_B], n=2, max_tokens=2)
    choices = r.json()["choices"]
    assert [(c["index"], c["prompt_index"]) for c in choices] == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_completions_with_prompt_list(fake_server_factory):
    s = fake_server_factory()
    r = httpx.post(s.url + "/v1/completions", json={"model": "fake-chat", "prompt": ["a", "b"], "max_tokens": [1, 3]})
    body = r.json()
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["w0 ", "w0 w1 w2 "]


def test_prompt_longer_than_context_is_rejected_before_the_engine(fake_server_factory):
    s = fake_server_factory(chat=FakeGenerationEngine(max_context=64))
    r = chat(s, messages=[{"role": "user", "content": "x" * 500}])
    assert r.status_code == 422 and r.json()["error"]["code"] == "context_length_exceeded"
    assert s.ferry.models["fake-chat"].engine.calls == []


def test_client_disconnect_mid_stream_cancels_the_sequence(fake_server_factory):
    engine = FakeGenerationEngine(step_delay=0.01)
    s = fake_server_factory(chat=engine)
    body = {"model": "fake-chat", "messages": CONV_A, "max_tokens": 400, "stream": True}

    async def leave_early():
        async with (
            httpx.AsyncClient(base_url=s.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # got a token; hang up

    asyncio.run(leave_early())
    registry = s.ferry.metrics.registry
    wait_until(lambda: engine.running == 0, timeout=4.0, message="the server to cancel the sequence")
    assert registry.get_sample_value("ferry_cancellations_total", {"model": "fake-chat", "phase": "running"}) == 1
    # Another request is served normally afterwards.
    assert chat(s, messages=CONV_A, max_tokens=2).status_code == 200


def test_client_disconnect_while_waiting_cancels(fake_server_factory):
    engine = FakeGenerationEngine(step_delay=0.02)
    s = fake_server_factory(chat=engine, max_running=1)
    blocker = {"model": "fake-chat", "messages": CONV_A, "max_tokens": 60}

    async def scenario():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            first = asyncio.create_task(c.post("/v1/chat/completions", json=blocker))
            await async_wait_until(lambda: engine.running, message="the blocker to start running")
            waiting = asyncio.create_task(c.post("/v1/chat/completions", json={**blocker, "max_tokens": 2}))
            await async_wait_until(
                lambda: len(s.ferry.models["fake-chat"].batcher.inner.queue), message="the second request to queue"
            )
            waiting.cancel()  # the client gives up while queued
            return await first

    assert asyncio.run(scenario()).status_code == 200
    registry = s.ferry.metrics.registry
    assert registry.get_sample_value("ferry_cancellations_total", {"model": "fake-chat", "phase": "queued"}) == 1
    assert all(len(ids) == 1 for kind, ids in engine.calls)  # the cancelled one never ran


def test_max_streams_holds_while_a_stream_awaits_its_admission(fake_server_factory):
    """A stream counts from before its submit awaits (an engine core's admission answer):
    a second stream checked meanwhile is refused with 429, not let past the limit."""
    s = fake_server_factory(max_streams=1)
    batcher = s.ferry.models["fake-chat"].batcher
    submit_many = batcher.submit_many
    held: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def first_admission_waits(*args, **kw):
        if not held:  # the first stream's admission waits until the test lets it go
            gate = asyncio.Event()
            held.append((asyncio.get_running_loop(), gate))
            await gate.wait()
        return await submit_many(*args, **kw)

    batcher.submit_many = first_admission_waits
    body = {"model": "fake-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            first = asyncio.create_task(c.post("/v1/chat/completions", json=body))
            await async_wait_until(lambda: held, message="the first stream to await its admission")
            second = await c.post("/v1/chat/completions", json=body)
            loop, gate = held[0]
            loop.call_soon_threadsafe(gate.set)
            return await first, second

    first, second = asyncio.run(scenario())
    assert (first.status_code, second.status_code) == (200, 429)
    assert second.json()["error"]["code"] == "too_many_streams"
    # The server lets go of a stream's count as its response ends, which the client may see
    # first: the count must come back to 0, not be 0 the instant the body arrived.
    wait_until(lambda: s.ferry.streams == 0, message="the finished stream to release its count")
