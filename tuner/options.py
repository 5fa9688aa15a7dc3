"""The locustfile's own command-line options, each also an environment variable
FERRY_LOAD_<OPTION>, and `RUN_OPTIONS`, where the users read them once locust has parsed
them (tuner/locustfile.py, tuner/users.py)."""

from __future__ import annotations

import os


def _env(name: str, default):
    return os.environ.get("FERRY_LOAD_" + name.upper().replace("-", "_"), default)


def add_options(parser) -> None:
    """Add the options to locust's parser (the locustfile's init_command_line_parser listener)."""

    def add(flag: str, default, type_, help_: str) -> None:
        key = flag.lstrip("-").removeprefix("ferry-")
        parser.add_argument(
            flag,
            type=type_,
            default=type_(_env(key, default)),
            help=f"{help_} (env FERRY_LOAD_{key.upper().replace('-', '_')}, default {default})",
        )

    add("--ferry-chat-model", "ferry-tiny-chat", str, "chat model name sent in requests")
    add("--ferry-embed-model", "sentence-transformers/all-MiniLM-L6-v2", str, "embeddings model name")
    add("--weight-interactive", 1.0, float, "share of arrivals (or users) for InteractiveChatUser; 0 leaves it out")
    add("--weight-batch", 1.0, float, "share for BatchChatUser; 0 leaves it out")
    add("--weight-embed", 1.0, float, "share for EmbeddingsUser; 0 leaves it out")
    add("--interactive-budget-ms", 1000.0, float, "latency budget of interactive chat (time to first token); 0: none")
    add("--batch-budget-ms", 0.0, float, "latency budget of batch chat; 0: the model default")
    add("--embed-budget-ms", 0.0, float, "latency budget of embeddings; 0: the model default")
    add("--chat-max-tokens", 16, int, "max_tokens of interactive chat")
    add("--batch-max-tokens", 32, int, "max_tokens of each batch conversation")
    add("--batch-conversations", 4, int, "conversations per batch chat request")
    add("--embed-inputs", 1, int, "inputs per embeddings request")
    add(
        "--arrival-rate",
        10.0,
        float,
        "open loop: total arrivals per second, split by weight; 0: closed loop of -u users",
    )
    add("--rate-steps", "", str, "open loop with stepped rates: RATE:SECONDS,... (e.g. 20:10,60:10)")
    add("--arrivals", "poisson", str, "arrival process: poisson or uniform")
    add("--pool-size", 0, int, "users in the open-loop pool (0: rate x --pool-latency-s + 2 per class)")
    add("--pool-latency-s", 2.0, float, "latency the automatic pool size allows for")
    add("--max-pool", 1000, int, "largest automatic pool")
    add("--think-time", 0.0, float, "closed loop only: seconds a user waits between requests")
    add("--ferry-slo-ms", 0.0, float, "latency objective counted in the report (0: none)")
    add("--ferry-report", "", str, "write a JSON summary here when the run ends")
    add("--seed", 0, int, "seed of the arrival times")


class Options:
    """Parsed options, with defaults when the locustfile is used as a library."""

    def __init__(self, ns=None):
        self.ns = ns

    def __getattr__(self, name):
        return getattr(self.ns, name)


RUN_OPTIONS = Options()
