"""The JSON-lines files of ``trtbuild run --input/--output``: strict reading, result records, partial writes.

An input line is a JSON object with exactly one prompt key (``prompt`` text, ``prompt_token_ids`` or ``messages``),
an optional ``id`` and any ``SamplingParams`` field; anything else (a misspelled field, a value of the wrong type)
is refused with ``FILE:LINE:``. Blank (whitespace-only) lines are skipped, as JSON-lines readers do; ``-`` reads
standard input. Results are one JSON object per prompt line, in input order.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..configio import json_lines
from ..errors import RequestError, TrtbuildError

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


@dataclass(frozen=True)
class InputLine:
    """One request of an input file: where it is (``FILE:LINE``), its JSON object and its result id."""

    where: str
    record: dict[str, Any]
    id: Any


def sampling_fields() -> tuple[str, ...]:
    from ..runtime.sampling import SamplingParams

    return tuple(f.name for f in dataclasses.fields(SamplingParams))


def make_params(*layers: dict[str, Any], where: str | None = None) -> Any:
    """``SamplingParams`` from option/JSON layers (later layers win; None and () mean 'not given').

    ``where`` (``FILE:LINE``) prefixes the one-line error of a bad value."""
    from ..runtime.sampling import SamplingParams

    names = set(sampling_fields())
    values: dict[str, Any] = {}
    for layer in layers:
        values.update({k: v for k, v in layer.items() if k in names and v is not None and v != ()})
    try:
        return SamplingParams(**values)
    except (RequestError, TypeError) as e:
        raise RequestError(f"{where + ': ' if where else ''}{e}") from None


STDIN = Path("-")  # ``--input -`` / ``--prompt -``: standard input
STDIN_NAME = "<stdin>"


def read_text(path: Path) -> str:
    """The UTF-8 text of ``path`` (``-``: all of standard input); a one-line ``TrtbuildError`` when unreadable."""
    name = STDIN_NAME if path == STDIN else path
    try:
        if path == STDIN:
            return sys.stdin.buffer.read().decode("utf-8") if hasattr(sys.stdin, "buffer") else sys.stdin.read()
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TrtbuildError(f"{name}: cannot read ({e.strerror if isinstance(e, OSError) else e})") from None


def read_jsonl(path: Path) -> list[InputLine]:
    """The requests of a JSON-lines prompt file (``-``: standard input): one object per line, known keys only,
    exactly one prompt key; blank lines are skipped (errors name the line by its number in the file)."""
    text = read_text(path)
    name = STDIN_NAME if path == STDIN else str(path)
    known = (*PROMPT_KEYS, "id", *sampling_fields())
    lines = []
    for where, rec in json_lines(text, name):
        if not isinstance(rec, dict) or sum(k in rec for k in PROMPT_KEYS) != 1:
            raise RequestError(f"{where}: expected an object with exactly one of {', '.join(PROMPT_KEYS)}")
        for key in rec:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
                raise RequestError(f"{where}: unknown key {key!r}{hint}")
        lines.append(InputLine(where, rec, rec.get("id", len(lines))))
    if not lines:
        raise RequestError(f"{name}: no prompts")
    return lines


_PROMPT_INDEX = re.compile(r"^prompt (\d+): ")


def locate_error(error: RequestError, lines: list[InputLine]) -> RequestError:
    """``LLM.generate``'s ``prompt I: ...`` error, naming the input file and line instead."""
    m = _PROMPT_INDEX.match(str(error))
    if m is None or int(m.group(1)) >= len(lines):
        return error
    return RequestError(f"{lines[int(m.group(1))].where}: {str(error)[m.end() :]}")


def result_record(request_id: Any, out: Any) -> dict[str, Any]:
    """The JSON result of one prompt: ``text`` of the first completion, and every completion with its metrics."""

    def num(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 6)

    completions = []
    for c in out.outputs:
        m = c.metrics
        rec = {
            "index": c.index,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason.value if c.finish_reason else None,
            "stop_reason": c.stop_reason,
            "metrics": {
                "num_prompt_tokens": m.num_prompt_tokens,
                "num_output_tokens": m.num_output_tokens,
                "num_cached_tokens": m.num_cached_tokens,
                "num_preemptions": m.num_preemptions,
                "ttft": num(m.ttft),
                "tpot": num(m.tpot),
                "decode_tokens_per_s": num(m.decode_tokens_per_s),
                "e2e_latency": num(m.e2e_latency),
            },
        }
        if c.logprobs is not None:
            rec["logprobs"] = [{"logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]} for lp in c.logprobs]
        completions.append(rec)
    result = {"id": request_id, "text": out.text, "outputs": completions}
    if out.prompt_logprobs is not None:  # one per prompt token: null, or its logprob and top alternatives
        result["prompt_logprobs"] = [
            None if lp is None else {"logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}
            for lp in out.prompt_logprobs
        ]
    return result


def results_text(results: dict[int, dict[str, Any]]) -> str:
    """The output file's text: one JSON line per result, in input order (``results`` by input index)."""
    return "".join(json.dumps(results[i], ensure_ascii=False) + "\n" for i in sorted(results))
