"""ferry_client against a real gateway on 127.0.0.1 (fake engines: fast and deterministic)."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest

from engine.fake import FakeEmbeddingEngine, FakeGenerationEngine, fake_vector
from ferry_client import (
    APIConnectionError,
    AsyncFerryClient,
    AuthenticationError,
    ChatResponse,
    CompletionResponse,
    FerryClient,
    FerryError,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServerError,
    StreamEvent,
    UnprocessableEntity,
    agather_stream,
    gather_stream,
)

from ..waiting import wait_until

CHAT = "fake-chat"
EMBED = "fake-embed"
CONV_A = [{"role": "user", "content": "Respond with a single word greeting."}]
CONV_B = [{"role": "user", "content": "List three colors separated by commas."}]
CONV_C = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a ferry."}]


def words(k: int) -> str:
    """What the fake engine generates in k tokens."""
    return "".join(f"w{i} " for i in range(k))


def requests_total(server, route: str, model: str, status: str = "200") -> float:
    """A stream is counted when the server's generator finishes, just after the client has
    read [DONE]; give the server loop a moment (bounded) to get there."""
    labels = {"route": route, "model": model, "status": status}
    return wait_until(
        lambda: server.ferry.metrics.registry.get_sample_value("ferry_requests_total", labels),
        timeout=1.0,
        interval=0.01,
        message=f"ferry_requests_total{labels} to count the request",
    )


@pytest.fixture
def server(fake_server_factory):
    return fake_server_factory(max_wait_ms=20)


@pytest.fixture
def client(server):
    with FerryClient(server.url) as c:
        yield c


# -- chat ----------------------------------------------------------------------------------
def test_two_conversations_one_request_in_prompt_order(server, client):
    a, b = client.chat(CHAT, [CONV_A, CONV_B], temperature=0.0, max_completion_tokens=[1, 4])
    assert isinstance(a, ChatResponse) and isinstance(b, ChatResponse)
    assert (a.prompt_index, a.text, a.finish_reason) == (0, words(1), "length")
    assert (b.prompt_index, b.text, b.finish_reason) == (1, words(4), "length")
    assert a.usage.completion_tokens == 5 and a.usage.total_tokens == a.usage.prompt_tokens + 5
    assert a.info.request_id and a.info.model == CHAT and a.info.batch_size >= 1
    assert requests_total(server, "/v1/chat/completions", CHAT) == 1  # ONE request for both prompts


def test_usage_tells_the_prompt_tokens_the_server_had_cached(client):
    """The fake engine serves the whole 16-token blocks an earlier prompt shared."""
    (first,) = client.chat(CHAT, [CONV_A], max_completion_tokens=1)
    (again,) = client.chat(CHAT, [CONV_A], max_completion_tokens=1)
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == 48 and again.usage.prompt_tokens == 53  # three whole blocks of 16


def test_three_conversations_keep_prompt_order_and_their_own_max_tokens(server, client):
    responses = client.chat(CHAT, [CONV_A, CONV_B, CONV_C], max_completion_tokens=[8, 2, 5])
    assert [r.prompt_index for r in responses] == [0, 1, 2]
    assert [r.text for r in responses] == [words(8), words(2), words(5)]
    assert requests_total(server, "/v1/chat/completions", CHAT) == 1


def test_one_conversation_gives_one_response(client):
    r = client.chat(CHAT, CONV_C, max_tokens=3)
    assert isinstance(r, ChatResponse) and r.prompt_index == 0 and r.text == words(3)
    assert client.chat(CHAT, "just a string", max_tokens=1).text == words(1)  # shorthand: one user message
    two = client.chat(CHAT, ["first", "second"], max_tokens=[1, 2])  # strings: one conversation each
    assert [x.text for x in two] == [words(1), words(2)]


def test_per_prompt_stop_and_seed_lists_and_scalars(client):
    a, b = client.chat(CHAT, [CONV_A, CONV_B], max_tokens=8, stop=[["w1"], ["w3"]], seed=[1, 2], top_p=(0.5, 1.0))
    assert (a.text, a.finish_reason) == ("w0 ", "stop")
    assert (b.text, b.finish_reason) == (words(3), "stop")
    c, d = client.chat(CHAT, [CONV_A, CONV_B], max_tokens=np.array([2, 3]), stop=["w2"])  # a list of str: every prompt
    assert (c.text, c.finish_reason) == (words(2), "length")
    assert (d.text, d.finish_reason) == (words(2), "stop")


def test_n_candidates_per_prompt(client):
    a, b = client.chat(CHAT, [CONV_A, CONV_B], n=2, max_tokens=[1, 2])
    assert [c.index for c in a.choices] == [0, 1] and a.texts == [words(1)] * 2
    assert b.texts == [words(2)] * 2 and b.text == words(2)
    a, b = client.chat(CHAT, [CONV_A, CONV_B], n=[1, 3], max_tokens=[1, 2])  # a per-prompt list
    assert a.texts == [words(1)] and b.texts == [words(2)] * 3
    streamed = client.chat(CHAT, [CONV_A, CONV_B], n=[3, 1], max_tokens=[2, 1], stream=True).gather()
    assert [r.texts for r in streamed] == [[words(2)] * 3, [words(1)]]
    assert streamed[0].usage is not None and streamed[0].usage.completion_tokens == 3 * 2 + 1


def test_wrong_length_list_raises_typed_422_naming_the_field(server, client):
    with pytest.raises(UnprocessableEntity) as info:
        client.chat(CHAT, [CONV_A, CONV_B], max_completion_tokens=[4, 5, 6])
    err = info.value
    assert isinstance(err, FerryError)
    assert (err.status, err.code, err.param) == (422, "prompt_count_mismatch", "max_completion_tokens")
    assert "3 values" in err.message and err.request_id
    assert server.ferry.models[CHAT].engine.calls == []  # nothing was queued


def test_typed_errors(fake_server_factory):
    s = fake_server_factory(api_keys=["sesame"], max_body_bytes=2048)
    with FerryClient(s.url) as anonymous:
        with pytest.raises(AuthenticationError) as info:
            anonymous.chat(CHAT, CONV_A)
        assert info.value.status == 401 and info.value.code == "invalid_api_key"
    with FerryClient(s.url + "/v1", api_key="sesame") as c:  # an OpenAI-style base URL is accepted
        with pytest.raises(NotFound) as info:
            c.chat("no-such-model", CONV_A)
        assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")
        with pytest.raises(PayloadTooLarge) as info:
            c.embed(EMBED, ["x" * 4096])
        assert info.value.code == "body_too_large"
        with pytest.raises(UnprocessableEntity) as info:
            c.chat(CHAT, CONV_A, frequency_penalty=3.0)  # out of range: the server names the field
        assert info.value.param == "frequency_penalty"
        with pytest.raises(UnprocessableEntity) as info:
            c.chat(CHAT, CONV_A, reasoning_effort="high")  # refused by name: the server names it
        assert (info.value.code, info.value.param) == ("unsupported_parameter", "reasoning_effort")
        assert c.chat(CHAT, CONV_A, max_tokens=1).text == words(1)


def test_completions(server, client):
    responses = client.completions(CHAT, ["a", "b", "c"], max_completion_tokens=[3, 1, 2])
    assert all(isinstance(r, CompletionResponse) for r in responses)
    assert [r.text for r in responses] == [words(3), words(1), words(2)]
    single = client.completions(CHAT, "one prompt", max_tokens=2)
    assert isinstance(single, CompletionResponse) and single.text == words(2)
    assert requests_total(server, "/v1/completions", CHAT) == 2


# -- streaming ------------------------------------------------------------------------------
def test_stream_is_demultiplexed_into_per_prompt_buffers(server, client):
    buffers: dict[int, str] = {0: "", 1: "", 2: ""}
    finish: dict[int, str] = {}
    usage = None
    with client.chat(CHAT, [CONV_A, CONV_B, CONV_C], max_completion_tokens=[3, 1, 5], stream=True) as stream:
        events = list(stream)
    for prompt_index, delta in events:
        buffers[prompt_index] += delta
    for ev in events:
        assert isinstance(ev, StreamEvent) and ev.prompt_index in (0, 1, 2)
        if ev.finish_reason:
            assert ev.prompt_index not in finish  # exactly one final event per prompt
            finish[ev.prompt_index] = ev.finish_reason
        usage = ev.usage or usage
    assert buffers == {0: words(3), 1: words(1), 2: words(5)}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert events[-1].usage is usage and usage.completion_tokens == 9
    assert stream.usage == usage and stream.request_id
    assert requests_total(server, "/v1/chat/completions", CHAT) == 1


def test_gather_stream_builds_responses_in_prompt_order(client):
    responses = gather_stream(client.chat(CHAT, [CONV_A, CONV_B], max_tokens=[4, 2], stop=[None, ["w1"]], stream=True))
    assert [(r.prompt_index, r.text, r.finish_reason) for r in responses] == [
        (0, words(4), "length"),
        (1, "w0 ", "stop"),
    ]
    assert responses[0].usage.completion_tokens == 4 + 2
    n2 = client.chat(CHAT, [CONV_A, CONV_B], n=2, max_tokens=[1, 3], stream=True, include_usage=False).gather()
    assert [r.texts for r in n2] == [[words(1)] * 2, [words(3)] * 2]
    assert n2[0].usage is None
    (one,) = gather_stream(client.completions(CHAT, "p", max_completion_tokens=2, stream=True))
    assert isinstance(one, CompletionResponse) and one.text == words(2)


def test_a_prompt_failing_mid_stream_carries_a_typed_error(fake_server_factory):
    # The fake engine fails prompts whose first token is 90 ("Z"); the others go on.
    s = fake_server_factory(chat=FakeGenerationEngine(fail_prompts={90}))
    with FerryClient(s.url) as c:
        bad, good = gather_stream(c.completions(CHAT, ["Zap", "ok"], max_tokens=3, stream=True))
        assert (good.text, good.finish_reason, good.error) == (words(3), "length", None)
        assert bad.finish_reason == "error" and isinstance(bad.error, ServerError)
        assert bad.error.code == "engine_error" and bad.error.prompt_index == 0
        with pytest.raises(ServerError):  # without streaming the request fails as a whole
            c.completions(CHAT, ["Zap", "ok"], max_tokens=3)


def test_stream_errors_before_the_first_event_raise_at_the_call(client):
    with pytest.raises(UnprocessableEntity) as info:
        client.chat(CHAT, [CONV_A, CONV_B], temperature=[0.5], stream=True)
    assert info.value.param == "temperature"


# -- embeddings -----------------------------------------------------------------------------------
def test_embeddings_of_a_list_equal_single_calls_in_input_order(server, client):
    texts = ["hello ferry", "goodbye ferry", "a third one", "hello ferry"]
    batch = client.embed(EMBED, texts)
    assert len(batch) == 4 and all(isinstance(v, list) and len(v) == 8 for v in batch)
    singles = [client.embed(EMBED, t) for t in texts]
    assert batch == singles
    np.testing.assert_array_equal(np.asarray(batch, dtype=np.float32), np.stack([fake_vector(t, 8) for t in texts]))
    arr = client.embed(EMBED, texts, numpy=True)
    assert arr.shape == (4, 8) and arr.dtype == np.float32
    np.testing.assert_array_equal(arr, np.asarray(batch, dtype=np.float32))
    one = client.embed(EMBED, "hello ferry", numpy=True)
    assert one.shape == (8,) and np.array_equal(one, arr[0])


def test_models_and_ready(client):
    assert client.ready()
    assert set(client.models()) == {CHAT, EMBED}


# -- retries ------------------------------------------------------------------------------------
class GatedEmbeddings(FakeEmbeddingEngine):
    """Blocks inside the engine until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def embed(self, batch):
        self.entered.set()
        self.gate.wait(30)
        return super().embed(batch)


def test_retry_honours_retry_after_of_a_full_queue(fake_server_factory):
    engine = GatedEmbeddings()
    # No interactive lane: the second request must queue behind the running one.
    s = fake_server_factory(embed=engine, max_queue=1, max_batch_size=1, max_wait_ms=0, interactive_lane=False)
    batcher = s.ferry.models[EMBED].batcher.inner
    results: dict[str, list] = {}

    def call(text: str) -> None:
        with FerryClient(s.url) as c:
            results[text] = c.embed(EMBED, text)

    running = threading.Thread(target=call, args=("running",))
    queued = threading.Thread(target=call, args=("queued",))
    try:
        running.start()
        assert engine.entered.wait(10)
        queued.start()
        wait_until(
            lambda: len(batcher.queue) == 1, timeout=10, interval=0.01, message="the second request to be queued"
        )

        # The queue is full: without retries, a typed 429 with Retry-After.
        with FerryClient(s.url) as c, pytest.raises(RateLimited) as info:
            c.embed(EMBED, "refused")
        err = info.value
        assert (err.status, err.code) == (429, "queue_full") and err.retry_after >= 1

        # A Retry-After beyond max_retry_wait is never retried early.
        attempts: list[tuple[int, str, float]] = []

        def record(attempt: int, e: RateLimited, delay: float) -> None:
            attempts.append((attempt, e.code, delay))

        with FerryClient(s.url, retries=3, max_retry_wait=0.5, on_retry=record) as c, pytest.raises(RateLimited):
            c.embed(EMBED, "refused")
        assert attempts == []

        # With retries: wait what Retry-After says (the wait is replaced by opening the gate).
        slept: list[float] = []
        with FerryClient(s.url, retries=3, on_retry=record) as c:

            def fake_sleep(seconds: float) -> None:
                slept.append(seconds)
                engine.gate.set()
                running.join(10)
                queued.join(10)

            c._sleep = fake_sleep
            vector = c.embed(EMBED, "patient")
        assert attempts == [(1, "queue_full", err.retry_after)]  # one retry, then success: two attempts
        assert slept == [err.retry_after]
        assert np.allclose(vector, fake_vector("patient", 8))
        assert set(results) == {"running", "queued"}
    finally:
        engine.gate.set()
        running.join(10)
        queued.join(10)


def test_retry_gives_up_after_n_attempts_on_connection_failure():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    attempts = []
    with FerryClient(f"http://127.0.0.1:{port}", retries=2, on_retry=lambda a, e, d: attempts.append(a)) as c:
        c._sleep = lambda seconds: None
        with pytest.raises(APIConnectionError) as info:
            c.embed(EMBED, "x")
    assert attempts == [1, 2] and info.value.status is None


def test_no_retry_without_opt_in_or_on_client_errors(client):
    calls = []
    client.on_retry = lambda *a: calls.append(a)
    with pytest.raises(UnprocessableEntity):
        client.chat(CHAT, [CONV_A], max_tokens=[1, 2])
    with (
        FerryClient(client.base_url, retries=5, on_retry=lambda *a: calls.append(a)) as c,
        pytest.raises(UnprocessableEntity),
    ):
        c.chat(CHAT, [CONV_A], max_tokens=[1, 2])
    assert calls == []


# -- async ----------------------------------------------------------------------------------------
def test_async_client(server):
    async def main():
        async with AsyncFerryClient(server.url) as c:
            a, b, c3 = await c.chat(CHAT, [CONV_A, CONV_B, CONV_C], max_completion_tokens=[2, 6, 1])
            assert [a.text, b.text, c3.text] == [words(2), words(6), words(1)]
            buffers = {0: "", 1: ""}
            stream = await c.chat(CHAT, [CONV_A, CONV_B], max_tokens=[2, 3], stream=True)
            async for prompt_index, delta in stream:
                buffers[prompt_index] += delta
            assert buffers == {0: words(2), 1: words(3)} and stream.usage.completion_tokens == 5
            gathered = await agather_stream(await c.completions(CHAT, ["x", "y"], max_tokens=[3, 1], stream=True))
            assert [r.text for r in gathered] == [words(3), words(1)]
            vectors = await c.embed(EMBED, ["one", "two"])
            assert vectors == [await c.embed(EMBED, "one"), await c.embed(EMBED, "two")]
            with pytest.raises(UnprocessableEntity) as info:
                await c.chat(CHAT, [CONV_A, CONV_B], seed=[1, 2, 3])
            assert info.value.param == "seed"
            assert await c.ready() and CHAT in await c.models()

    asyncio.run(main())


def test_closing_a_stream_early_cancels_the_rest(fake_server_factory):
    engine = FakeGenerationEngine(step_delay=0.01)
    s = fake_server_factory(chat=engine)
    with FerryClient(s.url) as c:
        with c.chat(CHAT, [CONV_A, CONV_B], max_tokens=400, stream=True) as stream:
            first = next(iter(stream))
            assert first.prompt_index in (0, 1)
        wait_until(
            lambda: engine.running == 0,
            timeout=10,
            interval=0.01,
            message="the server to cancel the abandoned sequences",
        )
        assert c.chat(CHAT, CONV_A, max_tokens=1).text == words(1)
