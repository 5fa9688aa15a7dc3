"""The default chat model, "ferry-tiny-chat": built in code, cached on disk.

A randomly initialised Llama and a byte-level BPE tokenizer trained on text generated
from a fixed seed, so the gateway runs end to end with no model hub. The output is
gibberish but deterministic: the same code builds bit-identical weights and vocabulary.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

MODEL_NAME = "ferry-tiny-chat"
# Bump when anything below changes what gets built: the cache is keyed by this name.
CACHE_NAME = "ferry-tiny-chat-v4"
SEED = 20240611

VOCAB_SIZE = 8192
MAX_CONTEXT = 2048

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Trainer special tokens take the first ids in this order: pad=0, bos=1, eos=2.
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS.values()]

# With `tools` (function tools, OpenAI's shape), a system turn lists them first, one JSON
# object a line, and says how to call one: the answer is then exactly
# {"name": "<function>", "arguments": {...}} (docs/api.md, "Tool calls"), which is also
# how an assistant turn's earlier `tool_calls` are written back.
TOOLS_PREAMBLE = 'Tools. To call one, answer only {"name": "<function name>", "arguments": {<its parameters>}}:'
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|system|>\n" + TOOLS_PREAMBLE + "\n' -}}"
    "{%- for tool in tools -%}"
    "{{- (tool.function if tool.function is defined else tool) | tojson + '\n' -}}"
    "{%- endfor -%}"
    "{{- eos_token + '\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson -}}"
    "{%- endfor -%}"
    "{{- eos_token + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}"
    # A thinking section, off unless asked (reasoning_effort, or enable_thinking: true), so
    # every prompt renders as before: the model's reasoning comes first, up to </think>.
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

_COMMON_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "I",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "over",
    "new",
    "sound",
    "take",
    "only",
    "little",
    "work",
    "know",
    "place",
    "year",
    "live",
    "me",
    "back",
    "give",
    "most",
    "very",
    "after",
    "thing",
    "our",
    "just",
    "name",
    "good",
    "sentence",
    "man",
    "think",
    "say",
    "great",
    "where",
    "help",
    "through",
    "much",
    "before",
    "line",
    "right",
    "too",
    "mean",
    "old",
    "any",
    "same",
    "tell",
    "boy",
    "follow",
    "came",
    "want",
    "show",
    "also",
    "around",
    "form",
    "three",
    "small",
    "set",
    "put",
    "end",
    "does",
    "another",
    "well",
    "large",
    "must",
    "big",
    "even",
    "such",
    "because",
    "turn",
    "here",
    "why",
    "ask",
    "went",
    "men",
    "read",
    "need",
    "land",
    "different",
    "home",
    "us",
    "move",
    "try",
    "kind",
    "hand",
    "picture",
    "again",
    "change",
    "off",
    "play",
    "spell",
    "air",
    "away",
    "animal",
    "house",
    "point",
    "page",
    "letter",
    "mother",
    "answer",
    "found",
    "study",
    "still",
    "learn",
    "should",
    "world",
    "hello",
    "thanks",
    "please",
    "question",
    "model",
    "request",
    "batch",
    "token",
    "server",
    "latency",
    "queue",
    "answer",
    "stream",
    "python",
    "gateway",
    "ferry",
    "river",
    "boat",
]
_NON_ASCII = [
    "café",
    "naïve",
    "über",
    "señor",
    "smörgåsbord",
    "東京",
    "北京",
    "日本語",
    "中文",
    "привет",
    "мир",
    "😀",
    "🚀",
    "✓",
    "—",
    "€",
    "ß",
]
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
_PUNCT = [".", ".", ".", "?", "!", ",", ";", ":"]


def default_cache_dir() -> Path:
    """$FERRY_CACHE_DIR/<CACHE_NAME>, else ~/.cache/ferry/<CACHE_NAME>."""
    root = os.environ.get("FERRY_CACHE_DIR") or os.path.join(Path.home(), ".cache", "ferry")
    return Path(root) / CACHE_NAME


def ensure_tiny_chat(cache_dir: str | os.PathLike | None = None) -> str:
    """Path of the built model, building it first if the cache lacks it.

    `cache_dir` is the model's own directory (default: `default_cache_dir()`). Concurrent
    callers may both build; the first rename wins and the loser's copy is discarded.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_tiny_chat(staging)
        os.chmod(staging, 0o755)  # mkdtemp makes it owner-only
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def build_tiny_chat(out_dir: str | os.PathLike) -> None:
    """Build the tokenizer and model into `out_dir` (which must exist or be creatable)."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    with _progress_bars_disabled():
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def _progress_bars_disabled() -> Iterator[None]:
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=list(ROLE_TOKENS.values()),
        padding_side="left",
        model_max_length=MAX_CONTEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_CONTEXT,
        # Tied input/output embeddings make a random model repeat one token under greedy.
        tie_word_embeddings=False,
        # At the default 0.02 a random model falls into a 1-2 token loop after a few steps;
        # 0.1 gives varied, prompt-dependent greedy output, which the tests need.
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # fork_rng: seed the init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.eval()


def _corpus(lines: int = 12_000) -> Iterator[str]:
    """Deterministic text: common words, pseudo-words with Zipf-like frequencies, numbers,
    a little non-ASCII (so multi-byte characters get merged tokens) and chat turns."""
    rng = random.Random(SEED)
    pseudo = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(6000)]
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(pseudo))))
    for i in range(lines):
        words = []
        for _ in range(rng.randint(4, 18)):
            pick = rng.random()
            if pick < 0.5:
                words.append(rng.choice(_COMMON_WORDS))
            elif pick < 0.9:
                words.append(rng.choices(pseudo, cum_weights=cum_weights)[0])
            elif pick < 0.96:
                words.append(str(rng.randint(0, 10_000)))
            else:
                words.append(rng.choice(_NON_ASCII))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(_PUNCT)
        if i % 10 == 0:
            role = rng.choice(list(ROLE_TOKENS))
            sentence = f"{ROLE_TOKENS[role]}\n{sentence}{EOS}\n"
        yield sentence
