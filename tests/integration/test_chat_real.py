"""ferry-tiny-chat behind a real uvicorn, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai

MODEL = "ferry-tiny-chat"


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_chat_completion(real_server):
    res = client(real_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0
    )
    choice = res.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    assert res.usage.completion_tokens <= 8 and res.usage.prompt_tokens > 0
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens


def test_openai_streaming_matches_non_streaming(real_server):
    c = client(real_server)
    msgs = [{"role": "user", "content": "Tell me about ferries"}]
    whole = (
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0).choices[0].message.content
    )
    parts, finish = [], None
    for chunk in c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            assert chunk.usage.completion_tokens > 0
    assert "".join(parts) == whole
    assert finish in ("length", "stop")


def test_openai_completions(real_server):
    res = client(real_server).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert res.choices[0].finish_reason in ("length", "stop")
    assert res.usage.completion_tokens <= 5


def test_greedy_output_is_the_same_alone_and_batched(real_server):
    prompts = [[{"role": "user", "content": f"Question number {i} about rivers"}] for i in range(6)]
    url = real_server.url + "/v1/chat/completions"
    alone = [
        httpx.post(url, json={"model": MODEL, "messages": p, "max_tokens": 10, "temperature": 0}, timeout=60).json()[
            "choices"
        ][0]["message"]["content"]
        for p in prompts
    ]

    async def together():
        async with httpx.AsyncClient(timeout=60) as c:
            multi = c.post(
                url, json={"model": MODEL, "messages": prompts[:3], "max_tokens": [10, 10, 10], "temperature": 0}
            )
            singles = [
                c.post(url, json={"model": MODEL, "messages": p, "max_tokens": 10, "temperature": 0})
                for p in prompts[3:]
            ]
            return await asyncio.gather(multi, *singles)

    multi, *singles = asyncio.run(together())
    batched = [ch["message"]["content"] for ch in multi.json()["choices"]] + [
        r.json()["choices"][0]["message"]["content"] for r in singles
    ]
    assert batched == alone


def test_seeded_sampling_reproduces_whatever_the_batch_mates(real_server):
    url = real_server.url + "/v1/chat/completions"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Pick words"}],
        "max_tokens": 12,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 1234,
    }
    alone = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]["content"]
    mates = {**body, "messages": [body["messages"], [{"role": "user", "content": "other"}]], "seed": [1234, 5]}
    together = httpx.post(url, json=mates, timeout=60).json()["choices"][0]["message"]["content"]
    assert together == alone


def test_a_role_the_template_refuses_is_a_422_before_the_engine(real_server):
    r = httpx.post(
        real_server.url + "/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
    )
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("chat_template_error", "messages")
    assert err["message"].endswith("Unsupported role: tool")  # the template's own words


def uncached(usage: dict | None) -> dict | None:
    """Usage without its cached tokens, which depend on what the server computed before."""
    return None if usage is None else {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def test_stop_strings_through_an_engine_core_are_those_of_one_process(real_server):
    """The real tiny model in an engine core: the core sends token ids only, the front end
    detokenizes and cuts at the stop strings; the answers are those of one process."""
    import contextlib
    import json

    from loadtests.openloop import GatewayProcess

    url = "/v1/chat/completions"
    prompts = [
        [{"role": "user", "content": "Tell me about ferries"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rivers? ünïcode"}],
    ]
    free = httpx.post(
        real_server.url + url,
        json={"model": MODEL, "messages": prompts, "max_tokens": 16, "temperature": 0},
        timeout=60,
    ).json()
    # Each prompt's stop string is a piece of the middle of its own greedy answer.
    stops = [[c["message"]["content"][5:8]] for c in free["choices"]]
    assert all(s[0] for s in stops)
    body = {"model": MODEL, "messages": prompts, "max_tokens": 16, "temperature": 0.8, "seed": 3, "n": 2}
    bodies = [{**body, "temperature": 0, "stop": stops}, {**body, "stop": stops}]

    def answers(base: str) -> list:
        out = []
        for b in bodies:
            r = httpx.post(base + url, json=b, timeout=60).json()
            out.append(([(c["message"]["content"], c["finish_reason"]) for c in r["choices"]], uncached(r["usage"])))
            chunks: dict[int, list] = {}
            usage = None
            stream = {**b, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", base + url, json=stream, timeout=60) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line.removeprefix("data: "))
                        for c in chunk["choices"]:
                            chunks.setdefault(c["index"], []).append(c)
                        usage = uncached(chunk.get("usage")) or usage
            streamed = [
                ("".join(c["delta"].get("content") or "" for c in chunks[k]), chunks[k][-1]["finish_reason"])
                for k in sorted(chunks)
            ]
            out.append((streamed, usage))
        return out

    local = answers(real_server.url)
    with contextlib.ExitStack() as stack:
        core = stack.enter_context(
            GatewayProcess(
                "--engine-cores", "--embedding-model", "none", "--chat-model", "tiny", env={"FERRY_FAKE_ENGINES": "0"}
            )
        )
        remote = answers(core.url)
    assert remote == local
    greedy = local[0][0]
    assert [finish for _, finish in greedy] == ["stop"] * 4  # each cut at its stop string
    assert all(stops[k // 2][0] not in text for k, (text, _) in enumerate(greedy))
    assert local[0] == local[1]  # streamed as answered


SYSTEM = (
    "You are the harbour master of a busy ferry port. Answer travellers' questions about "
    "timetables, tickets, luggage and the weather at sea, politely and in few words."
)


def test_a_shared_system_prompt_is_served_from_the_prefix_cache(real_server, tmp_path):
    """Two conversations with one long system prompt: the second's usage counts the prompt
    tokens the model's prefix cache served (through its engine core, whole and streamed, and
    in /metrics), and its greedy answer is the one a server without prefix caching gives."""
    from prometheus_client import CollectorRegistry

    from gateway.app import create_app
    from gateway.config import ServerConfig
    from gateway.metrics.registry import GatewayMetrics
    from tests.live import live

    def body(question: str) -> dict:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}

    def metric(url: str, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(url + "/metrics", timeout=30).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name and s.labels.get("model") == MODEL
        )

    url = "/v1/chat/completions"
    questions = ("When does the first boat to the island leave?", "May I bring a bicycle?")
    hits_before = metric(real_server.url, "ferry_prefix_cache_hits_total")
    first, second = (httpx.post(real_server.url + url, json=body(q), timeout=60).json() for q in questions)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= cached < second["usage"]["prompt_tokens"] and cached % 16 == 0
    assert metric(real_server.url, "ferry_prefix_cache_hits_total") - hits_before >= cached
    # The official client reads it where OpenAI puts it, from the stream's usage chunk too.
    c = client(real_server)
    stream = c.chat.completions.create(**body(questions[1]), stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens >= cached

    cfg = ServerConfig(
        embedding_model="none",
        chat_model="tiny",
        engine_cores=False,
        prefix_caching=False,
        warmup=False,
        data_dir=str(tmp_path),
    )
    with live(create_app(cfg, metrics=GatewayMetrics(CollectorRegistry())), ready_timeout=300) as off:
        plain = [httpx.post(off.url + url, json=body(q), timeout=60).json() for q in questions]
        assert metric(off.url, "ferry_prefix_cache_hits_total") == 0
    assert [p["usage"]["prompt_tokens_details"]["cached_tokens"] for p in plain] == [0, 0]
    assert [p["choices"][0]["message"]["content"] for p in plain] == [
        first["choices"][0]["message"]["content"],
        second["choices"][0]["message"]["content"],
    ]


def test_the_defaults_a_chat_ui_sends_are_served(real_server):
    """Penalties 0, an empty logit_bias, logprobs false, top_p 1 and stream_options, as
    many chat front ends send them with every request: each asks for nothing."""
    stream = client(real_server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0.7,
        top_p=1,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
        logprobs=False,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


EOS_ID = 2  # ferry-tiny-chat's <|eos|> (engine/tiny_chat.py: pad=0, bos=1, eos=2)


def test_sampling_fields_per_prompt_reach_the_engine_core(real_server):
    """Three conversations in one request, each with its own logit_bias, min_tokens and
    ignore_eos, through the front end, the wire and the engine core."""
    conversation = [{"role": "user", "content": "Name a boat"}]
    body = {
        "model": MODEL,
        "messages": [conversation] * 3,
        "max_tokens": 5,
        "temperature": 0,
        "logit_bias": [{str(EOS_ID): 100}, {str(EOS_ID): 100}, {str(EOS_ID): 100}],
        "min_tokens": [0, 3, 0],
        "ignore_eos": [False, False, True],
        "presence_penalty": [0.5, 0, 0],
        "repetition_penalty": 1.2,
    }
    r = httpx.post(real_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["prompt_index"])
    assert [c["finish_reason"] for c in choices] == ["stop", "stop", "length"]
    # EOS at once; EOS after three tokens (min_tokens); EOS five times, ignored (ignore_eos).
    per_prompt = ("logit_bias", "min_tokens", "ignore_eos", "presence_penalty")
    counted = [
        httpx.post(
            real_server.url + "/v1/chat/completions",
            json={**body, "messages": conversation, **{k: body[k][i] for k in per_prompt}},
            timeout=60,
        ).json()["usage"]["completion_tokens"]
        for i in range(3)
    ]
    assert counted == [1, 4, 5]
    bad = httpx.post(
        real_server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": conversation, "logit_bias": {"999999": 5}},
        timeout=60,
    )
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_token_id"


def test_log_probabilities_through_the_openai_client(real_server):
    """Chat `logprobs=True, top_logprobs=5`, whole and streamed (the same greedy tokens,
    the same entries), and completions `logprobs=2` in the legacy shape."""
    c = client(real_server)
    msgs = [{"role": "user", "content": "Name a river"}]
    whole = c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5
    )
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the most likely
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = []
    for chunk in c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    legacy = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == legacy.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_echo_scores_a_continuation_as_evaluation_harnesses_ask(real_server):
    """lm-evaluation-harness's loglikelihood request (token ids, `echo`, `logprobs: 1`,
    `max_tokens: 1`) through the openai client and an engine core: one entry per prompt
    token plus the generated one, the first null; the text is the prompt, then the
    completion; streamed, the first chunk carries the prompt and the same entries."""
    c = client(real_server)
    ids = [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]  # byte-level ids of the tiny model
    whole = c.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert whole.usage.prompt_tokens == len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert choice.text.startswith("".join(lp.tokens[: len(ids)]))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed_text, streamed = "", []
    for chunk in c.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True, stream=True
    ):
        if chunk.choices:
            streamed_text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed_text == choice.text
    assert [None if v is None else round(v, 4) for v in streamed] == [
        None if v is None else round(v, 4) for v in lp.token_logprobs
    ]
    text = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0, echo=True)
    assert text.choices[0].text.startswith("Hello there") and text.choices[0].logprobs is None
    r = httpx.post(real_server.url + "/v1/completions", json={"model": MODEL, "prompt": [10**9]}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_token_id"


def test_candidates_per_prompt_through_the_openai_client(real_server):
    """`n` as a per-prompt list through the openai client (extra_body) and an engine core:
    two conversations with 1 and 3 candidates, whole and streamed, each choice tagged with
    its prompt; seeded candidates of one prompt differ from each other."""
    c = client(real_server)
    conversations = [[{"role": "user", "content": "Name a boat"}], [{"role": "user", "content": "Name a port"}]]
    whole = c.chat.completions.create(
        model=MODEL, messages=[], max_tokens=4, seed=3, extra_body={"messages": conversations, "n": [1, 3]}
    )
    tags = [(ch.index, ch.model_extra["prompt_index"]) for ch in whole.choices]
    assert tags == [(0, 0), (1, 1), (2, 1), (3, 1)]
    assert len({ch.message.content for ch in whole.choices[1:]}) > 1
    seen = set()
    for chunk in c.chat.completions.create(
        model=MODEL, messages=[], max_tokens=4, seed=3, stream=True, extra_body={"messages": conversations, "n": [1, 3]}
    ):
        for ch in chunk.choices:
            seen.add((ch.index, ch.model_extra["prompt_index"]))
    assert seen == set(tags)


def test_reasoning_per_prompt_through_the_openai_client(real_server):
    """The built-in model's template has a thinking section, off unless asked. Two
    conversations, thinking off and on (reasoning_effort per prompt): the second's prompt
    opens `<think>`, and what the model writes goes to `reasoning_content` (the random model
    never closes it: all of it), the first's to `content`; streamed the same, as separate
    deltas; chat_template_kwargs says the same in vLLM's words; a schema binds the answer
    only, so a thinking prompt with one still reasons in free text."""
    c = client(real_server)
    conversations = [[{"role": "user", "content": "Name a boat"}]] * 2
    extra = {"messages": conversations, "reasoning_effort": ["none", "high"]}
    whole = c.chat.completions.create(model=MODEL, messages=[], max_tokens=6, temperature=0, extra_body=extra)
    off, on = (ch.message for ch in whole.choices)
    assert off.content and off.model_extra["reasoning_content"] is None
    assert on.model_extra["reasoning_content"] and on.model_extra["reasoning"] == on.model_extra["reasoning_content"]
    assert not on.content
    body = {"model": MODEL, "messages": conversations[0], "max_tokens": 6, "temperature": 0}
    plain = httpx.post(real_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    kwargs = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    vllm_words = httpx.post(real_server.url + "/v1/chat/completions", json=kwargs, timeout=60).json()
    assert vllm_words["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the template opened <think>
    assert vllm_words["choices"][0]["message"]["reasoning_content"] == on.model_extra["reasoning_content"]
    reasoning, content = {0: "", 1: ""}, {0: "", 1: ""}
    for chunk in c.chat.completions.create(
        model=MODEL, messages=[], max_tokens=6, temperature=0, stream=True, extra_body=extra
    ):
        for ch in chunk.choices:
            reasoning[ch.index] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content[ch.index] += ch.delta.content or ""
    assert (reasoning[0], content[0]) == ("", off.content)
    assert (reasoning[1], content[1]) == (on.model_extra["reasoning_content"], "")
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    shaped = {**body, "reasoning_effort": "high", "response_format": schema}
    r = httpx.post(real_server.url + "/v1/chat/completions", json=shaped, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == on.model_extra["reasoning_content"]  # free text, not JSON


def test_tokenizer_routes_are_the_models_own(real_server):
    """vLLM's /tokenize, /detokenize and /tokenizer_info, answered by the front end's
    tokenizer: a prompt's tokens are those the completion counts, a conversation's those
    chat counts; ids decode back; the info names the special tokens and the template."""
    url = real_server.url
    text = "The ferry leaves at dawn"
    with_special = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()
    plain = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
    done = httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}, timeout=60
    ).json()
    assert with_special["count"] == len(with_special["tokens"]) == done["usage"]["prompt_tokens"]
    assert len(plain["tokens"]) < with_special["count"] and with_special["max_model_len"] > 0
    back = httpx.post(url + "/detokenize", json={"tokens": plain["tokens"]}, timeout=30).json()
    assert back["prompt"] == text
    conversation = [{"role": "user", "content": "Name a boat"}]
    chat_ids = httpx.post(url + "/tokenize", json={"messages": conversation}, timeout=30).json()
    chat = httpx.post(
        url + "/v1/chat/completions", json={"model": MODEL, "messages": conversation, "max_tokens": 1}, timeout=60
    ).json()
    assert chat_ids["count"] == chat["usage"]["prompt_tokens"]
    info = httpx.get(url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] and "<think>" in info["chat_template"] and info["model"] == MODEL
    both = httpx.post(url + "/tokenize", json={"prompt": text, "messages": conversation}, timeout=30)
    outside = httpx.post(url + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert (both.status_code, outside.status_code) == (422, 422)
    assert outside.json()["error"]["code"] == "invalid_token_id"


def test_interactive_prompts_preempt_batch_class_streams_which_resume_whole(real_server):
    """The session server's KV budget is 4,096 tokens (`kv_cache_mb=32`): six batch-class
    streams of ~580-token prompts and 64 new tokens fit it, seven do not; an interactive
    prompt arriving while they run makes one of them yield (preempted, recomputed later).
    Every answer is still the greedy one it gives alone, streamed without a lost or repeated
    token, and /metrics counts the preemption."""
    from prometheus_client.parser import text_string_to_metric_families

    def preemptions() -> float:
        text = httpx.get(real_server.url + "/metrics", timeout=30).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "ferry_preemptions_total" and s.labels.get("model") == MODEL
        )

    def body(i: int, stream: bool = False) -> dict:
        text = f"Passenger {i}: " + "the ferry crosses the wide grey river " * 40
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 64,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }

    url = real_server.url + "/v1/chat/completions"
    alone = [httpx.post(url, json=body(i), timeout=60).json()["choices"][0]["message"]["content"] for i in range(7)]
    before = preemptions()

    async def together() -> list[str]:
        started = asyncio.Event()
        first_tokens = 0

        async def stream(c: httpx.AsyncClient, i: int, priority: str) -> str:
            nonlocal first_tokens
            parts = []
            headers = {"X-Ferry-Priority": priority}
            async with c.stream("POST", url, json=body(i, stream=True), headers=headers) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    if delta and not parts:
                        first_tokens += 1
                        if first_tokens == 6:
                            started.set()
                    parts.append(delta)
            return "".join(parts)

        async with httpx.AsyncClient(timeout=60) as c:
            batch = [asyncio.create_task(stream(c, i, "batch")) for i in range(6)]
            await asyncio.wait_for(started.wait(), 60)  # all six running: the budget is full
            interactive = await stream(c, 6, "interactive")
            return [*(await asyncio.gather(*batch)), interactive]

    assert asyncio.run(together()) == alone
    assert preemptions() > before
