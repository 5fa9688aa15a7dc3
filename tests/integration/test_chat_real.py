"""ferry-tiny-chat behind a real uvicorn, driven by the official openai client."""

from __future__ import annotations

import asyncio

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
