"""``trtbuild run ENGINE_DIR --prompt TEXT`` / ``--input prompts.jsonl --output results.jsonl``.

Sampling flags are generated from the ``SamplingParams`` dataclass (one flag per field, same name and default).
Input lines are JSON objects with ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (a chat), an optional
``id``, and any ``SamplingParams`` field overriding the flags for that line. The output file is written atomically,
one JSON object per input line, in order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError, RequestError, TrtbuildError

SAMPLING_HELP = {
    "temperature": "0 = greedy",
    "top_k": "keep the k most likely tokens",
    "top_p": "nucleus sampling mass",
    "min_p": "drop tokens below min_p x the top probability",
    "repetition_penalty": "1 = off",
    "presence_penalty": "0 = off",
    "frequency_penalty": "0 = off",
    "seed": "per-request seed (reproducible sampling)",
    "max_tokens": "tokens to generate at most",
    "stop": "stop string (repeatable); the text ends right before it",
    "stop_token_ids": "token id that ends the output (repeatable)",
    "n": "completions per prompt",
    "logprobs": "also return this many top logprobs per token",
    "ignore_eos": "keep generating past EOS",
}
PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


def sampling_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One click option per ``SamplingParams`` field (values arrive as kwargs; None / () when not given)."""
    from ..runtime.sampling import SamplingParams

    hints = typing.get_type_hints(SamplingParams)
    for f in reversed(dataclasses.fields(SamplingParams)):
        tp, flag = hints[f.name], "--" + f.name.replace("_", "-")
        help_text = f"{SAMPLING_HELP.get(f.name, f.name)} [default: {f.default!r}]"
        args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
        if tp is bool:
            option = click.option(flag, f.name, is_flag=True, default=None, help=help_text)
        elif typing.get_origin(tp) is tuple:
            option = click.option(flag, f.name, type=args[0], multiple=True, help=help_text)
        elif isinstance(tp, types.UnionType):
            option = click.option(flag, f.name, type=args[0], default=None, help=help_text)
        else:
            option = click.option(flag, f.name, type=tp, default=None, help=help_text)
        fn = option(fn)
    return fn


def make_params(*layers: dict[str, Any]) -> Any:
    """``SamplingParams`` from option/JSON layers (later layers win; None and () mean 'not given')."""
    from ..runtime.sampling import SamplingParams

    names = {f.name for f in dataclasses.fields(SamplingParams)}
    values: dict[str, Any] = {}
    for layer in layers:
        values.update({k: v for k, v in layer.items() if k in names and v is not None and v != ()})
    try:
        return SamplingParams(**values)
    except TypeError as e:
        raise RequestError(f"bad sampling value ({e})") from None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


class ByteSize(click.ParamType):
    """A size in bytes: ``268435456``, ``256MiB``, ``1G`` (binary units)."""

    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(f"--{param.name.replace('_', '-')}: {value!r} is not a size (e.g. 512MiB, 2G)")
        unit = (m.group(2) or "b")[0].lower()
        return int(float(m.group(1)) * 1024 ** "bkmgt".index(unit))


def engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Flags of ``LLM(...)``: KV-cache size, batching limits, prefix caching, threads."""
    for option in reversed(
        [
            click.option(
                "--kv-cache-memory",
                type=ByteSize(),
                default="256MiB",
                show_default=True,
                help="KV-cache memory (e.g. 512MiB, 2G)",
            ),
            click.option("--max-num-seqs", type=int, default=None, help="requests running at once [default: engine's]"),
            click.option(
                "--max-num-batched-tokens",
                type=int,
                default=None,
                help="tokens per step [default: engine's max_num_tokens]",
            ),
            click.option("--num-threads", type=int, default=None, help="onnxruntime intra-op threads"),
        ]
    ):
        fn = option(fn)
    return fn


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="prompt text")
@click.option("--input", "input_path", type=click.Path(path_type=Path), default=None, help="prompts, JSON lines")
@click.option("--output", "output_path", type=click.Path(path_type=Path), default=None, help="results, JSON lines")
@click.option("--chat", is_flag=True, help="wrap text prompts as a user message and apply the chat template")
@click.option("--system", default=None, help="system message for --chat")
@click.option("--stream", is_flag=True, help="print the text as it is generated (--prompt, n = 1)")
@click.option("--no-prefix-caching", is_flag=True, help="disable automatic prefix caching")
@engine_options
@sampling_options
def run(
    engine_dir: Path,
    prompt: str | None,
    input_path: Path | None,
    output_path: Path | None,
    chat: bool,
    system: str | None,
    stream: bool,
    no_prefix_caching: bool,
    kv_cache_memory: int,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    num_threads: int | None,
    **sampling: Any,
) -> None:
    """Generate text with an engine: one --prompt, or a JSON-lines --input file to an --output file."""
    if (prompt is None) == (input_path is None):
        raise RequestError("give exactly one of --prompt TEXT or --input FILE")
    if input_path is not None and output_path is None:
        raise RequestError("--input needs --output FILE")
    if system is not None and not chat:
        raise RequestError("--system needs --chat")
    if stream and input_path is not None:
        raise RequestError("--stream works with --prompt only")
    params = make_params(sampling)
    records = read_jsonl(input_path) if input_path is not None else [{"prompt": prompt}]
    from ..runtime.llm import LLM

    llm = LLM(
        engine_dir,
        kv_cache_memory=kv_cache_memory,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=not no_prefix_caching,
        num_threads=num_threads,
    )
    prompts = [_prompt(llm, rec, chat, system, f"line {i + 1}") for i, rec in enumerate(records)]
    all_params = [make_params(sampling, rec) for rec in records] if input_path is not None else [params]
    if stream:
        if params.n != 1:
            raise RequestError("--stream needs --n 1")
        text_stream = llm.generate_stream(prompts[0], params)
        for delta in text_stream:
            click.echo(delta, nl=False)
        click.echo()
        assert text_stream.output is not None
        _summary(text_stream.output)
        return
    outputs = llm.generate(prompts, all_params)
    if input_path is None:
        for c in outputs[0].outputs:
            if len(outputs[0].outputs) > 1:
                click.echo(f"--- completion {c.index} ---")
            click.echo(c.text)
        _summary(outputs[0])
        return
    assert output_path is not None
    lines = [
        json.dumps(result_record(rec.get("id", i), out), ensure_ascii=False)
        for i, (rec, out) in enumerate(zip(records, outputs, strict=True))
    ]
    write_atomic(output_path, "".join(line + "\n" for line in lines))
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    click.echo(f"wrote {len(lines)} results ({num_tokens} tokens) -> {output_path}", err=True)


def _prompt(llm: Any, rec: dict[str, Any], chat: bool, system: str | None, where: str) -> str | list[int]:
    """The prompt of one input record: text, token ids, or chat messages rendered by the chat template."""
    try:
        if "messages" in rec:
            return llm.chat_prompt(rec["messages"])
        if "prompt_token_ids" in rec:
            return rec["prompt_token_ids"]
        if not isinstance(rec.get("prompt"), str):
            raise RequestError("'prompt' must be a string")
        if chat:
            messages = [{"role": "system", "content": system}] if system is not None else []
            return llm.chat_prompt([*messages, {"role": "user", "content": rec["prompt"]}])
        return rec["prompt"]
    except RequestError as e:
        raise RequestError(f"{where}: {e}") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines prompt file (blank lines skipped), each with exactly one prompt key."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TrtbuildError(f"{path}: cannot read ({e.strerror if isinstance(e, OSError) else e})") from None
    records = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or sum(k in rec for k in PROMPT_KEYS) != 1:
            raise RequestError(f"{path}:{i}: expected an object with exactly one of {', '.join(PROMPT_KEYS)}")
        records.append(rec)
    if not records:
        raise RequestError(f"{path}: no prompts")
    return records


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
    return {"id": request_id, "text": out.text, "outputs": completions}


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary sibling and a rename: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _summary(out: Any) -> None:
    m = out.metrics
    click.echo(
        f"[{m.num_output_tokens} tokens, {out.finish_reason.value}; TTFT {m.ttft * 1000:.0f} ms, "
        f"{m.decode_tokens_per_s:.1f} decode tok/s, {m.num_cached_tokens} prompt tokens cached]",
        err=True,
    )
