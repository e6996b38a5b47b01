"""The engine's tokenizer (``tokenizer.json`` via ``tokenizers``), chat template (jinja2) and streaming detokenizer.

An engine directory carries ``tokenizer.json``, ``tokenizer_config.json`` and usually ``chat_template.jinja``
(copied from the checkpoint). Engines without ``tokenizer.json`` still run, on token-id prompts only.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from ..errors import EngineError, RequestError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Prompt tokens decoded in front of the output so the first output token keeps its leading space (vLLM's offset).
DETOKENIZE_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 sequence decodes to: hold it back until the next token


class Tokenizer:
    """Text <-> token ids for one engine, plus its chat template. Load with ``from_engine_dir``."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        config: Mapping[str, Any],
        chat_template: str | None,
        tool_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template  # jinja2 source, or None when the engine has none
        # tokenizer_config.json's named "tool_use" template, rendered instead when tools are given (transformers' rule)
        self.tool_template = tool_template
        # Special tokens the chat template may reference ({{ bos_token }} ...): strings, or {"content": ...} dicts.
        self.special_tokens = {
            key: value["content"] if isinstance(value, dict) else value
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if isinstance(value := config.get(key), str | dict)
        }
        self._compiled: dict[str, Any] = {}  # jinja2 source -> its compiled template

    @classmethod
    def from_engine_dir(cls, engine_dir: Path) -> Tokenizer | None:
        """The tokenizer of ``engine_dir``; None when it has no ``tokenizer.json``. Corrupt files raise EngineError."""
        path = Path(engine_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise EngineError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
        config: dict[str, Any] = {}
        config_path = path.with_name("tokenizer_config.json")
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise EngineError(f"{config_path}: not valid JSON ({e})") from None
        template_path = path.with_name(CHAT_TEMPLATE_FILE)
        template = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        tool_template = None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template, tool_template = named.get("default"), named.get("tool_use")
        return cls(
            tok,
            config,
            template if isinstance(template, str) else None,
            tool_template if isinstance(tool_template, str) else None,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what the grammar library reads)."""
        return self._tok.to_str()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's template (BOS where it has one).

        Text that is not valid Unicode (raw bytes a terminal passed through, a lone surrogate in JSON) raises
        ``RequestError``."""
        check_text(text)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the engine's chat template.

        Rendered like transformers' ``apply_chat_template``: a sandboxed jinja2 environment with ``trim_blocks``,
        ``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now`` and a ``tojson`` filter. The
        result already holds the template's special tokens: encode it with ``add_special_tokens=False``.
        ``tools`` (OpenAI function tools, ``{"type": "function", "function": {...}}``) are handed to the template
        as its ``tools`` variable, by the ``tool_use`` template where the tokenizer config names one.
        """
        source = self.tool_template if tools is not None and self.tool_template is not None else self.chat_template
        if source is None:
            raise RequestError("the engine has no chat template (chat_template.jinja or in tokenizer_config.json)")
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
                raise RequestError(f"messages[{i}]: expected an object with a 'role' string and a 'content'")
        from jinja2 import TemplateError

        extra = {} if tools is None else {"tools": [dict(t) for t in tools]}
        try:
            return self._template(source).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **extra,
                **self.special_tokens,
            )
        except TemplateError as e:
            raise RequestError(f"chat template: {e}") from None

    @functools.cached_property
    def template_takes_tools(self) -> bool:
        """Whether the chat template (or the ``tool_use`` one) reads a ``tools`` variable: describes functions
        (the templates are fixed, so it is parsed once)."""
        if self.tool_template is not None:
            return True
        if self.chat_template is None:
            return False
        from jinja2 import TemplateError, meta

        try:
            return "tools" in meta.find_undeclared_variables(_environment().parse(self.chat_template))
        except TemplateError as e:
            raise EngineError(f"the engine's chat template does not compile ({e})") from None

    def _template(self, source: str) -> Any:
        if source not in self._compiled:
            from jinja2 import TemplateError

            try:
                self._compiled[source] = _environment().from_string(source)
            except TemplateError as e:
                raise EngineError(f"the engine's chat template does not compile ({e})") from None
        return self._compiled[source]


def _environment() -> Any:
    """transformers' chat-template environment: sandboxed jinja2, trimmed blocks, its filters and globals."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def check_text(text: object) -> None:
    """``RequestError`` unless ``text`` is a string that encodes to UTF-8 (tokenizers takes nothing else)."""
    if not isinstance(text, str):
        raise RequestError(f"a text prompt must be a string, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"lone surrogate U+{char:04X}"
        raise RequestError(f"the text is not valid UTF-8 ({what} at character {e.start})") from None


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


class IncrementalDetokenizer:
    """Turns a request's output tokens into text one token at a time (the HF/vLLM prefix/read-offset method).

    Each ``append`` returns only text that can no longer change: the decode of a window of recent tokens minus the
    decode of the window without the newest ones, held back while it ends in an incomplete UTF-8 sequence. The
    concatenated deltas plus ``flush()`` equal the decode of the output tokens in the prompt's context.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-DETOKENIZE_CONTEXT_TOKENS:])  # decoding window: context + output
        self._prefix_offset = 0  # window start of the last emitted decode
        self._read_offset = len(self._ids)  # tokens before this offset are emitted as text

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special)

    def append(self, token_id: int) -> str:
        """Add one output token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back, without an incomplete UTF-8 sequence at its end (the output stopped in the
        middle of a character, e.g. at ``max_tokens``: its bytes stay in the token ids, not in the text); call
        once, when the output ends."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :].rstrip(REPLACEMENT_CHAR)
