"""The front end's half of a chat engine in an engine core (engine/chat_tokenizer.py): the
engine's own ids, template refusals and facts, without the weights."""

from __future__ import annotations

import pytest

from engine.base import ChatTemplateError
from engine.chat_tokenizer import ChatTokenizer


def test_the_front_tokenizer_makes_the_engines_ids(engine, tiny_chat_dir):
    front = ChatTokenizer(str(tiny_chat_dir), name=engine.name, max_context=engine.max_context)
    assert (front.name, front.max_context) == (engine.name, engine.max_context)
    conversations = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Two words, please: ünïcode and spaces  here."},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": ""},
        ],
    ]
    for messages in conversations:
        assert front.encode_chat(messages) == engine.encode_chat(messages)
    for text in ("hi", "", "  leading and trailing  ", "ünïcode, punctuation: fine!"):
        assert front.encode_prompt(text) == engine.encode_prompt(text)
    with pytest.raises(ChatTemplateError, match="Unsupported role: wizard"):
        front.encode_chat([{"role": "wizard", "content": "hi"}])


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Two words, please: ünïcode and spaces  here."},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "And a token in the text: <|eos|>, <|user|>."},
    ],
    [{"role": "user", "content": "no system"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "x"}],
]

# A template in the style of the Hub's (ChatML), using what transformers gives templates:
# loop controls, namespace, raise_exception, strftime_now, tojson, bos_token, loop.last.
HUB_STYLE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system=none) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] %}{% continue %}{% endif %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be user or assistant, not ' + message['role']) }}{% endif %}"
    "{% if loop.first and ns.system is not none %}<|system|>\n{{ ns.system }}{{ eos_token }}\n{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message.get('content', '') }}{{ eos_token }}\n"
    "{% if message['content'] == 'STOP' %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if strftime_now('%Y') | length != 4 %}{{ raise_exception('no year') }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{{ {'meta': 'ü'} | tojson }}{% endif %}"
)


def hub_model_dir(tiny_chat_dir, tmp_path, template) -> str:
    """A model directory as the Hub has them: tokenizer.json and a tokenizer_config.json
    that holds the chat template (no chat_template.jinja)."""
    import json
    import shutil

    shutil.copy(tiny_chat_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_chat_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def transformers_ids(path: str, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_the_template_renders_as_transformers_renders_it_for_the_tiny_model(tiny_chat_dir, conversation):
    messages = CONVERSATIONS[conversation]
    front = ChatTokenizer(str(tiny_chat_dir), name="ferry-tiny-chat", max_context=2048)
    assert front.encode_chat(messages) == transformers_ids(str(tiny_chat_dir), messages)


def test_a_hub_style_template_in_tokenizer_config_renders_as_transformers_renders_it(tiny_chat_dir, tmp_path):
    path = hub_model_dir(tiny_chat_dir, tmp_path, HUB_STYLE_TEMPLATE)
    front = ChatTokenizer(path, name="hub", max_context=2048)
    more = [
        [{"role": "user", "content": "STOP"}, {"role": "user", "content": "unseen"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}],  # None: as if absent
    ]
    for messages in [*CONVERSATIONS, *more]:
        assert front.encode_chat(messages) == transformers_ids(path, messages)
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant, not tool"):
        front.encode_chat([{"role": "tool", "content": "x"}])


def test_named_templates_use_the_default_one(tiny_chat_dir, tmp_path):
    named = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"}]
    named.append({"name": "default", "template": HUB_STYLE_TEMPLATE})
    path = hub_model_dir(tiny_chat_dir, tmp_path, named)
    front = ChatTokenizer(path, name="hub", max_context=2048)
    assert front.encode_chat(CONVERSATIONS[1]) == transformers_ids(path, CONVERSATIONS[1])


def test_no_template_and_a_broken_one_are_chat_template_errors(tiny_chat_dir, tmp_path):
    path = hub_model_dir(tiny_chat_dir, tmp_path, None)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTokenizer(path, name="bare", max_context=8).encode_chat(CONVERSATIONS[0])
    path = hub_model_dir(tiny_chat_dir, tmp_path, "{{ messages[0].content | no_such_filter }}")
    with pytest.raises(ChatTemplateError, match="no_such_filter"):
        ChatTokenizer(path, name="broken", max_context=8).encode_chat(CONVERSATIONS[0])


def test_decoding_is_the_engine_s(engine, tiny_chat_dir):
    front = ChatTokenizer(str(tiny_chat_dir), name=engine.name, max_context=engine.max_context)
    ids = engine.encode_chat(CONVERSATIONS[1]) + engine.encode_prompt(" ünïcode 東😀 <|eos|>")
    for cut in (ids, ids[3:], ids[:-1], [2], []):
        kw = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
        assert front.decode(cut, **kw) == engine.tokenizer.decode(cut, **kw)


def test_the_front_tokenizer_loads_without_torch_or_transformers(tiny_chat_dir):
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from engine.chat_tokenizer import ChatTokenizer\n"
        f"t = ChatTokenizer({str(tiny_chat_dir)!r}, name='ferry-tiny-chat', max_context=2048)\n"
        "ids = t.encode_chat([{'role': 'user', 'content': 'hi'}])\n"
        "assert ids and t.decode(t.encode_prompt('hello there')) == 'hello there'\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
