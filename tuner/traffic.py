"""The traffic `ferry tune` sends: its classes, the texts of its requests, and the locust
entries that report them: the one vocabulary the locustfile (which records the entries) and
the sweep (which reads them back from locust's CSV) share. The benchmarks in loadtests/
send the same texts."""

from __future__ import annotations

LOOPBACK = {"127.0.0.1", "localhost", "::1"}  # the only hosts load is ever sent to

TTFT_ENTRY = "TTFT chat"
STREAM_ENTRY = "chat (stream)"
BATCH_ENTRY = "batch chat"
EMBED_ENTRY = "embeddings"
# The entry whose latency the SLO applies to, per class, and the entries that count as
# completed requests (TTFT is a second look at the same requests).
SLO_ENTRIES = {"interactive": TTFT_ENTRY, "batch": BATCH_ENTRY, "embed": EMBED_ENTRY}
REQUEST_ENTRIES = {"interactive": STREAM_ENTRY, "batch": BATCH_ENTRY, "embed": EMBED_ENTRY}
# Names accepted for the classes in `ferry tune --mix`.
CLASS_ALIASES = {
    "interactive": "interactive",
    "chat": "interactive",
    "stream": "interactive",
    "batch": "batch",
    "batch-chat": "batch",
    "embed": "embed",
    "embeddings": "embed",
}

TOPICS = [
    "ferries",
    "rivers",
    "harbours",
    "timetables",
    "latency",
    "throughput",
    "queues",
    "tokens",
    "weather",
    "cargo",
]
QUESTIONS = [
    "Say hello politely.",
    "Give me a fun fact about {a}.",
    "Explain {a} to a child in two sentences.",
    "List three things {a} and {b} have in common.",
    "Write a haiku about {a}.",
    "What is the difference between {a} and {b}?",
]


def sentence(i: int) -> str:
    """Embeddings input number i."""
    return f"Request {i} asks a short question about {TOPICS[i % len(TOPICS)]} and {TOPICS[(i * 7) % len(TOPICS)]}."


def question(i: int) -> str:
    """Chat prompt number i."""
    return QUESTIONS[i % len(QUESTIONS)].format(a=TOPICS[i % len(TOPICS)], b=TOPICS[(i * 3 + 1) % len(TOPICS)])
