"""The engine alone (no HTTP), 32 conversations on one ~700-token system prompt that start
together: each round all 32 prompts arrive at once (the prefix cached after the first), are
prefilled, decode 16 tokens greedily and finish together, as the conversations of one
batched request do. Driven as the scheduler drives it (`enqueue`, then `step_with_prefill`
with no budget), one torch thread. Prints requests/s per run and their median.

    python -m loadtests.prefix_burst
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.base import SamplingParams, SequenceRequest
from engine.generation import HFGenerationEngine

from .prefix_cell import system_prompt


def rounds_together(engine: HFGenerationEngine, conversations: int, rounds: int, first_id: int) -> float:
    system = system_prompt()
    seq_id = first_id
    t0 = time.perf_counter()
    for r in range(rounds):
        requests = []
        for k in range(conversations):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Passenger {k} asks question {r}: when is the next crossing?"},
            ]
            seq_id += 1
            requests.append(
                SequenceRequest(seq_id, engine.encode_chat(messages), SamplingParams(max_tokens=16, temperature=0.0))
            )
        engine.enqueue(requests)
        while engine.running or engine.prefilling:
            engine.step_with_prefill(None)
    return conversations * rounds / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    engine = HFGenerationEngine.tiny_default(max_running=128, torch_threads=1)
    rounds_together(engine, a.conversations, 1, 10_000_000)  # warm-up: the system prompt into the prefix cache
    rates = [rounds_together(engine, a.conversations, a.rounds, (i + 1) * 100_000) for i in range(a.runs)]
    print(f"{a.conversations} conversations x {a.rounds} rounds: " + ", ".join(f"{r:.1f}" for r in rates))
    print(f"median {statistics.median(rates):.1f} requests/s")


if __name__ == "__main__":
    main()
