"""OpenAI response objects: completions and chat completions, whole or as server-sent-event chunks.

A ``ResponseBuilder`` turns the engine's ``Update``s of one request into the JSON the endpoint returns; it keeps
the per-choice text, token counts and logprob offsets, so a streamed response and a whole one say the same.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..runtime.sampling import TokenLogprobs
from ..runtime.sequence import FinishReason
from ..runtime.tokenizer import Tokenizer
from .engine import Update
from .protocol import Endpoint
from .tools import AutoCallStream, ToolCallStream, ToolRequest, tool_call


def sse(data: Any) -> bytes:
    """One server-sent event carrying ``data`` as JSON (or ``[DONE]``)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


class ResponseBuilder:
    """Accumulates one request's updates; ``chunk(...)`` for streams, ``final()`` for a whole response."""

    def __init__(
        self,
        endpoint: Endpoint,
        model: str,
        num_choices: int,
        prompt_token_ids: Sequence[Sequence[int]],
        tokenizer: Tokenizer | None,
        tools: ToolRequest | None = None,
    ) -> None:
        self.endpoint, self.model, self.tokenizer = endpoint, model, tokenizer
        self.tools = tools  # chat: a reply that is a call becomes tool_calls (serve/tools.py)
        self._calls = [ToolCallStream() for _ in range(num_choices)] if tools is not None and tools.constrained else []
        self._auto = [AutoCallStream(tools) for _ in range(num_choices)] if tools and not tools.constrained else []
        chat = endpoint is Endpoint.CHAT
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.prompt_tokens = sum(len(p) for p in prompt_token_ids)
        self.text = [""] * num_choices
        self.num_tokens = [0] * num_choices
        self.finish: list[str | None] = [None] * num_choices
        self.logprobs: list[dict[str, Any] | None] = [None] * num_choices
        self.text_offset = [0] * num_choices  # completions logprobs: characters before the next token

    def usage(self) -> dict[str, int]:
        completion = sum(self.num_tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def add(self, update: Update) -> dict[str, Any] | None:
        """Record ``update``; returns the logprobs of its tokens in the endpoint's shape (None without any)."""
        i = update.index
        self.text[i] += update.text
        self.num_tokens[i] += len(update.token_ids)
        if update.finish_reason is not None:
            self.finish[i] = finish_reason(update.finish_reason)
        if not update.logprobs:
            return None
        part = self._logprobs(i, update.token_ids, update.logprobs)
        whole = self.logprobs[i]
        if whole is None:
            self.logprobs[i] = {k: list(v) for k, v in part.items()}
        else:
            for k, v in part.items():
                whole[k].extend(v)
        return part

    def echo(
        self,
        i: int,
        prompt: str | Sequence[int],
        prompt_ids: Sequence[int],
        scores: Sequence[TokenLogprobs | None] | None,
        prompt_only: bool,
    ) -> None:
        """Completions' ``echo``, once choice ``i`` has finished: its text and logprobs start with its prompt's
        (``scores``: the prompt tokens' logprobs, the first None; None without ``logprobs``). ``prompt_only``
        (``max_tokens: 0``) first drops what was generated."""
        if prompt_only:
            self.text[i], self.num_tokens[i], self.finish[i] = "", 0, "length"
            self.logprobs[i] = None
        text = prompt if isinstance(prompt, str) else self._decode(prompt)
        self.text[i] = text + self.text[i]
        if scores is None:
            return
        tokens = [self._token(t) for t in prompt_ids]
        generated = self.logprobs[i] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.logprobs[i] = {
            "tokens": tokens + generated["tokens"],
            "token_logprobs": [None if s is None else s.logprob for s in scores] + generated["token_logprobs"],
            "top_logprobs": [None if s is None else {self._token(t): v for t, v in s.top} for s in scores]
            + generated["top_logprobs"],
            "text_offset": [*itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)]
            + [offset + len(text) for offset in generated["text_offset"]],
        }

    def chunk(self, update: Update, logprobs: dict[str, Any] | None, first: bool) -> dict[str, Any]:
        """The stream chunk of one update (``first``: the choice's first chunk, which carries the chat role)."""
        reason = finish_reason(update.finish_reason)
        if self._calls:  # a required call, streamed as tool_calls deltas
            delta = {"role": "assistant", "content": None} if first else {}
            calls = self._calls[update.index].feed(update.text, update.finish_reason is not None)
            if calls:
                delta["tool_calls"] = calls
            reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": update.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return self._envelope("chat.completion.chunk", [choice])
        if self.endpoint is Endpoint.CHAT:
            text, calls = update.text, []
            if self._auto:  # "auto": text unless the reply is calls (held back while it may be)
                auto = self._auto[update.index]
                text, calls = auto.feed(update.text, update.finish_reason is not None)
                reason = "tool_calls" if reason == "stop" and auto.called else reason
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": update.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": update.index, "text": update.text, "logprobs": logprobs, "finish_reason": reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.endpoint is Endpoint.CHAT else "text_completion"
        return {**self._envelope(obj, []), "usage": self.usage()}

    def final(self) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        choices = []
        for i, text in enumerate(self.text):
            finish = self.finish[i]
            calls = [] if self.tools is None else self.tools.parse_calls(text)
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": [tool_call(*c) for c in calls]}
                choice, finish = {"index": i, "message": message}, "tool_calls" if finish == "stop" else finish
            elif self.endpoint is Endpoint.CHAT:
                choice = {"index": i, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": i, "text": text}
            choices.append({**choice, "logprobs": self.logprobs[i], "finish_reason": finish})
        return {**self._envelope(self.object, choices), "usage": self.usage()}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _decode(self, token_ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def _token(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, i: int, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
        tokens = [self._token(t) for t in token_ids]
        if self.endpoint is Endpoint.CHAT:
            content = [
                {
                    "token": tok,
                    "logprob": lp.logprob,
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {"token": (s := self._token(t)), "logprob": v, "bytes": list(s.encode())} for t, v in lp.top
                    ],
                }
                for tok, lp in zip(tokens, logprobs, strict=True)
            ]
            return {"content": content}
        offsets = []
        for tok in tokens:
            offsets.append(self.text_offset[i])
            self.text_offset[i] += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }
