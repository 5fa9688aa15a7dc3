"""The front-end half of a chat engine whose model runs in an engine core (`ferry serve
--engine-cores`): its name, context, tokenizer and chat template, never its weights. The
gateway's translation (gateway/translate/chat.py) and the front end's detokenization
(gateway/cores/client.py) need no more than this.

Without transformers: the model's `tokenizer.json` is read with the `tokenizers` library
and its chat template rendered with jinja2 exactly as transformers' `apply_chat_template`
renders it (`render_chat`: a sandboxed environment with trim_blocks and lstrip_blocks, the
loop controls extension, the globals `raise_exception`, `strftime_now`, `dict` and
`namespace`, the `tojson` filter, the named special tokens such as `bos_token`, and
`add_generation_prompt`), then tokenized without adding special tokens, as transformers
does. transformers imports torch where it is installed (seconds, hundreds of MB), which a
front end has no use for. A model without a `tokenizer.json` (a SentencePiece-only one)
falls back to transformers' AutoTokenizer, as the engine itself loads it.

The engine (engine/generation.py) keeps transformers' own `apply_chat_template`
(`encode_chat` below); tests check that both make the same ids.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from .base import ChatTemplateError
from .grammar import GrammarCache

# The named special tokens a chat template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def grammar_cache(tokenizer: Any, path: str, trust_remote_code: bool) -> GrammarCache:
    """A GrammarCache for the model at `path` over transformers' tokenizer (its vocabulary
    size from its config)."""
    import copy

    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).vocab_size)
    eos = tokenizer.eos_token_id
    return GrammarCache(copy.deepcopy(tokenizer), vocab, [eos] if isinstance(eos, int) else [])


def encode_chat(
    tokenizer: Any,
    name: str,
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A conversation through the model's chat template, with transformers' tokenizer (the
    engine's): token ids ready to generate from; `tools` (OpenAI function tools) go to the
    template, which decides how to show them; `template_kwargs` (`enable_thinking`, ...) are
    further names the template may read."""
    if not tokenizer.chat_template:
        raise ChatTemplateError(f"model {name!r} has no chat template")
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **(template_kwargs or {}),
        )
    except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or an undefined name it needs
        raise ChatTemplateError(exc.message or type(exc).__name__) from None
    return list(ids)


# -- the chat template, as transformers renders it (transformers/utils/chat_template_utils.py) ----
def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # Unlike jinja2's own filter: no HTML escaping, and json.dumps' options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in a template, without the attributes of the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace`, refusing underscore names (no way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store {name!r} on a namespace")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (which transformers uses to mark assistant
    tokens for training masks) renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    return env.from_string(source)


def render_chat(
    template: str,
    messages: Sequence[dict],
    special_tokens: dict[str, str],
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation, ending with the generation prompt. Keys whose
    value is None are dropped from each message, as transformers does (templates handle a
    missing key, not a None). Raises ChatTemplateError for a conversation it refuses."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        compiled = compile_chat_template(template)
        return compiled.render(
            **(template_kwargs or {}),
            messages=messages,
            tools=tools or None,
            documents=None,
            add_generation_prompt=True,
            **special_tokens,
        )
    except jinja2.TemplateError as exc:  # raise_exception(...) in the template, or an undefined name it needs
        raise ChatTemplateError(exc.message or type(exc).__name__) from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: str, config: dict[str, Any]) -> str | None:
    """The model's default chat template: `chat_template.jinja` (transformers 5 saves it
    there, and it wins), else tokenizer_config.json's `chat_template`: a string, or named
    templates (a list of {name, template}, or a dict) of which "default"."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


def _vocab_size(path: str, fast: Any) -> int:
    """The model's vocabulary (its logits' width) from config.json, else the tokenizer's."""
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            size = json.load(f).get("vocab_size")
        if isinstance(size, int):
            return size
    return int(fast.get_vocab_size(with_added_tokens=True))


class ChatTokenizer:
    def __init__(self, path: str, *, name: str, max_context: int, trust_remote_code: bool = False):
        """`path`: the model's directory. `name` and `max_context` are what the core's engine
        reports of itself."""
        self.name, self.max_context = name, max_context
        self._fast: Any = None
        self._auto: Any = None
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
            self._fast.no_padding()
            self._fast.no_truncation()
            config: dict[str, Any] = {}
            config_file = os.path.join(path, "tokenizer_config.json")
            if os.path.isfile(config_file):
                with open(config_file, encoding="utf-8") as f:
                    config = json.load(f)
            self.chat_template = _chat_template(path, config)
            tokens = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_NAMES}
            self.special_tokens = {key: value for key, value in tokens.items() if value is not None}
            # The front end compiles schemas too, so that one it cannot follow is a 422 here.
            eos = self._fast.token_to_id(self.special_tokens.get("eos_token", ""))
            self.grammars = GrammarCache(self._fast, _vocab_size(path, self._fast), [] if eos is None else [eos])
        else:
            from transformers import AutoTokenizer

            self._auto = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.chat_template = self._auto.chat_template
            self.grammars = grammar_cache(self._auto, path, trust_remote_code)

    def encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        if self._auto is not None:
            return encode_chat(self._auto, self.name, messages, tools, template_kwargs)
        if not self.chat_template:
            raise ChatTemplateError(f"model {self.name!r} has no chat template")
        text = render_chat(self.chat_template, messages, self.special_tokens, tools, template_kwargs)
        return list(self._fast.encode(text, add_special_tokens=False).ids)  # the template wrote them

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._auto is not None:
            return list(self._auto.encode(text, add_special_tokens=add_special_tokens))
        return list(self._fast.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        """Generated ids as text, as the engine decodes them (engine/detokenize.py passes no
        clean-up, which is all this supports without transformers)."""
        if self._auto is not None:
            text = self._auto.decode(
                list(ids),
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            )
            return str(text)
        return str(self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens))
