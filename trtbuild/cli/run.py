"""``trtbuild run ENGINE_DIR --prompt TEXT`` / ``--input prompts.jsonl --output results.jsonl``.

Sampling flags are generated from the ``SamplingParams`` dataclass (one flag per field, same name and default).
Input lines are JSON objects with ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (a chat), an optional
``id``, and any ``SamplingParams`` field overriding the flags for that line (``jsonl.py`` reads them strictly; blank
lines are skipped). ``--input -`` reads the lines from standard input, ``--prompt -`` the prompt text. The output
file is written atomically, one JSON object per prompt line, in order; an interrupted run (Ctrl-C, SIGTERM) writes
the results finished so far and says how many. An existing output file needs ``--overwrite``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ..artifacts.atomic import write_file_atomic
from ..errors import ConfigError, RequestError, TrtbuildError
from ..progress import Progress
from .jsonl import STDIN, InputLine, locate_error, make_params, read_jsonl, read_text, result_record, results_text
from .kv_offload import kv_offload_options
from .options import ByteSize, JsonObjectFile, OutputPath

SAMPLING_HELP = {
    "temperature": "0 = greedy",
    "top_k": "keep the k most likely tokens; -1 or 0 = all [default: all]",
    "top_p": "nucleus sampling mass",
    "min_p": "drop tokens below min_p x the top probability",
    "repetition_penalty": "1 = off",
    "presence_penalty": "0 = off",
    "frequency_penalty": "0 = off",
    "seed": "per-request seed (reproducible sampling) [default: random]",
    "max_tokens": "tokens to generate at most",
    "stop": "stop string (repeatable); the text ends right before it",
    "stop_token_ids": "token id that ends the output (repeatable)",
    "n": "completions per prompt",
    "logprobs": "also return this many top logprobs per token [default: none]",
    "prompt_logprobs": "also return each prompt token's logprob and this many top logprobs [default: none]",
    "prompt_logprobs_from": "the first prompt position --prompt-logprobs scores (reuses the prefix cache before it)",
    "ignore_eos": "keep generating past EOS",
    "regex": "structured output: the text matches this regex (Rust syntax, whole output)",
    "json_schema": "structured output: a JSON schema file; the text is JSON valid under it",
}


def sampling_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One click option per ``SamplingParams`` field (values arrive as kwargs; None / () when not given)."""
    from ..runtime.sampling import SamplingParams

    hints = typing.get_type_hints(SamplingParams)
    for f in reversed(dataclasses.fields(SamplingParams)):
        tp, flag = hints[f.name], "--" + f.name.replace("_", "-")
        help_text = SAMPLING_HELP.get(f.name, f.name)
        if "[default:" not in help_text and not any(f.default is d for d in (None, (), False)):
            help_text += f" [default: {f.default}]"  # None, () and False defaults say themselves in the help
        args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
        if tp is bool:
            option = click.option(flag, f.name, is_flag=True, default=None, help=help_text)
        elif f.name == "json_schema":  # a dict: read from a JSON file (JSON-lines input gives the object itself)
            option = click.option(flag, f.name, type=JsonObjectFile(), default=None, help=help_text)
        elif typing.get_origin(tp) is tuple:
            option = click.option(flag, f.name, type=args[0], multiple=True, help=help_text)
        elif isinstance(tp, types.UnionType):
            option = click.option(flag, f.name, type=args[0], default=None, help=help_text)
        else:
            option = click.option(flag, f.name, type=tp, default=None, help=help_text)
        fn = option(fn)
    return fn


@dataclass(frozen=True)
class EngineFlags:
    """``engine_options``' flags: how ``LLM`` opens an engine (its keyword arguments of the same names)."""

    kv_cache_memory: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_threads: int | None = None
    verify: bool = False

    def llm_kwargs(self) -> dict[str, Any]:
        """The flags as ``LLM(...)`` keyword arguments."""
        return dataclasses.asdict(self)


def engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Flags of ``LLM(...)``: KV-cache size, batching limits, threads, file checks; the command gets ``engine``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        names = [f.name for f in dataclasses.fields(EngineFlags)]
        return fn(*args, engine=EngineFlags(**{name: kwargs.pop(name) for name in names}), **kwargs)

    for option in reversed(
        [
            click.option(
                "--kv-cache-memory",
                type=ByteSize(),
                default=None,
                help="KV-cache memory (e.g. 512MiB, 2G) [default: onnxruntime engines, room for max_batch_size "
                "sequences of max_seq_len tokens, at most 1/4 of the available memory (pages are taken only as "
                "blocks fill); GPU engines, 90% of the memory free after loading, less one step's working memory]",
            ),
            click.option("--max-num-seqs", type=int, default=None, help="requests running at once [default: engine's]"),
            click.option(
                "--max-num-batched-tokens",
                type=int,
                default=None,
                help="tokens per step [default: engine's max_num_tokens]",
            ),
            click.option("--num-threads", type=int, default=None, help="onnxruntime intra-op threads"),
            click.option(
                "--verify",
                is_flag=True,
                help="check every engine file's sha256 against the manifest before loading (sizes are always checked)",
            ),
        ]
    ):
        wrapper = option(wrapper)
    return wrapper


ENGINE_FLAGS = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "kv_cache_memory": "--kv-cache-memory",
}


def open_llm(engine_dir: Path, engine: EngineFlags, *, flags: dict[str, str] | None = None, **options: Any) -> Any:
    """``LLM(engine_dir, **engine, **options)``; an invalid limit is reported under the flag the user typed
    (``flags``)."""
    from ..runtime.llm import LLM

    try:
        return LLM(engine_dir, **{**engine.llm_kwargs(), **options})
    except ConfigError as e:
        for name, flag in {**ENGINE_FLAGS, **(flags or {})}.items():
            if str(e).startswith(name + " "):
                raise ConfigError(flag + str(e)[len(name) :]) from None
        raise


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="prompt text ('-': read it from standard input)")
@click.option(
    "--input",
    "input_path",
    type=click.Path(path_type=Path, allow_dash=True),
    default=None,
    help="prompts, JSON lines ('-': standard input)",
)
@click.option(
    "--output",
    "output_path",
    type=OutputPath(directory=False),
    default=None,
    help="results, JSON lines (one per prompt); its directory must exist",
)
@click.option("--overwrite", is_flag=True, help="replace an existing --output file")
@click.option("--chat", is_flag=True, help="wrap text prompts as a user message and apply the chat template")
@click.option("--system", default=None, help="system message for --chat")
@click.option("--stream", is_flag=True, help="print the text as it is generated (--prompt, n = 1)")
@click.option("--no-prefix-caching", is_flag=True, help="disable automatic prefix caching")
@click.option("--quiet", is_flag=True, help="no progress bar (--output)")
@engine_options
@kv_offload_options
@sampling_options
def run(
    engine_dir: Path,
    prompt: str | None,
    input_path: Path | None,
    output_path: Path | None,
    overwrite: bool,
    chat: bool,
    system: str | None,
    stream: bool,
    no_prefix_caching: bool,
    quiet: bool,
    engine: EngineFlags,
    kv_offload: Any,
    **sampling: Any,
) -> None:
    """Generate text with an engine: one --prompt, or a JSON-lines --input file to an --output file."""
    if (prompt is None) == (input_path is None):
        raise RequestError("give exactly one of --prompt TEXT or --input FILE")
    if input_path is not None and output_path is None:
        raise RequestError("--input needs --output FILE")
    if system is not None and not chat:
        raise RequestError("--system needs --chat")
    if stream and (input_path is not None or output_path is not None):
        raise RequestError("--stream prints to the terminal: it works with --prompt and without --output")
    if output_path is not None and output_path.exists() and not overwrite:
        raise TrtbuildError(f"{output_path}: already exists (use --overwrite to replace it)")
    params = make_params(sampling)
    if prompt == "-":
        prompt = _without_final_newline(read_text(STDIN))
    lines = read_jsonl(input_path) if input_path is not None else [InputLine("--prompt", {"prompt": prompt}, 0)]
    all_params = [make_params(sampling, ln.record, where=ln.where) for ln in lines]
    llm = open_llm(engine_dir, engine, enable_prefix_caching=not no_prefix_caching, kv_offload=kv_offload)
    prompts = [_prompt(llm, ln, chat, system) for ln in lines]
    if stream:
        if params.n != 1:
            raise RequestError("--stream needs --n 1")
        text_stream = llm.generate_stream(prompts[0], params)
        for delta in text_stream:
            click.echo(delta, nl=False)
        click.echo()
        assert text_stream.output is not None
        _print_logprobs(llm, text_stream.output)
        _summary(text_stream.output)
        return
    if output_path is None:
        [out] = llm.generate(prompts, all_params)
        for c in out.outputs:
            if len(out.outputs) > 1:
                click.echo(f"--- completion {c.index} ---")
            click.echo(c.text)
        _print_logprobs(llm, out)
        _summary(out)
        return
    _generate_to_file(llm, lines, prompts, all_params, output_path, quiet=quiet)


def _generate_to_file(
    llm: Any, lines: list[InputLine], prompts: list[Any], params: list[Any], path: Path, *, quiet: bool
) -> None:
    """Run every request, showing progress on a terminal (requests done, tokens/s, time left; not with ``quiet``);
    write the results in input order, the finished ones when interrupted (then exit 130)."""
    try:
        finished = llm.generate_iter(prompts, params)
    except RequestError as e:
        raise locate_error(e, lines) from None
    results: dict[int, dict[str, Any]] = {}
    num_tokens = 0
    bar = Progress(len(lines), "generating", "req", enabled=False if quiet else None, work_unit="tok")
    bar.update(0)  # at once: the first request may take many steps to finish
    try:
        for done in finished.by_step():
            for i, out in done:
                results[i] = result_record(lines[i].id, out)
                num_tokens += sum(len(c.token_ids) for c in out.outputs)
            if bar.enabled:
                generated, left = finished.tokens()
                bar.update(len(done), work=generated, work_left=left)
    except KeyboardInterrupt:
        finished.close()
        bar.close()
        if results:
            write_file_atomic(path, results_text(results))
        click.echo(
            f"interrupted: wrote the {len(results)} of {len(lines)} results that had finished ({num_tokens} tokens, "
            f"in input order; their ids say which) -> {path}"
            if results
            else f"interrupted before any result finished: {path} not written",
            err=True,
        )
        raise SystemExit(130) from None
    bar.close()
    write_file_atomic(path, results_text(results))
    click.echo(f"wrote {len(results)} results ({num_tokens} tokens) -> {path}", err=True)


def _without_final_newline(text: str) -> str:
    """A prompt piped in (``echo TEXT | trtbuild run --prompt -``) without the one newline that ends the input."""
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            return text[: -len(end)]
    return text


def _prompt(llm: Any, line: InputLine, chat: bool, system: str | None) -> str | list[int]:
    """The prompt of one input line: text, token ids, or chat messages rendered by the chat template."""
    from ..runtime.tokenizer import check_text

    rec = line.record
    try:
        if "messages" in rec:
            return llm.chat_prompt(rec["messages"])
        if "prompt_token_ids" in rec:
            return rec["prompt_token_ids"]
        if not isinstance(rec.get("prompt"), str):
            raise RequestError("'prompt' must be a string")
        check_text(rec["prompt"])
        if chat:
            messages = [{"role": "system", "content": system}] if system is not None else []
            return llm.chat_prompt([*messages, {"role": "user", "content": rec["prompt"]}])
        return rec["prompt"]
    except RequestError as e:
        raise RequestError(f"{line.where}: {e}") from None


def _print_logprobs(llm: Any, out: Any) -> None:
    """``--logprobs K`` / ``--prompt-logprobs K`` with ``--prompt``: each token's logprob and its top K alternatives
    (prompt tokens from the first scored one)."""
    tok = llm.tokenizer

    def show(t: int) -> str:
        return repr(tok.decode([t], skip_special_tokens=False)) if tok is not None else str(t)

    sections = [("prompt logprobs", out.prompt_token_ids, out.prompt_logprobs)]
    many = len(out.outputs) > 1
    sections += [
        (f"logprobs{f' of completion {c.index}' if many else ''}", c.token_ids, c.logprobs) for c in out.outputs
    ]
    for title, token_ids, logprobs in sections:
        if logprobs is None:
            continue
        click.echo(f"--- {title} ---")
        for t, lp in zip(token_ids, logprobs, strict=False):
            if lp is not None:
                top = ", ".join(f"{show(a)} {v:.3f}" for a, v in lp.top)
                click.echo(f"{show(t):>16} {lp.logprob:8.3f}" + (f"   top: {top}" if top else ""))


def _summary(out: Any) -> None:
    m = out.metrics
    click.echo(
        f"[{m.num_output_tokens} tokens, {out.finish_reason.value}; TTFT {m.ttft * 1000:.0f} ms, "
        f"{m.decode_tokens_per_s:.1f} decode tok/s, {m.num_cached_tokens} prompt tokens cached]",
        err=True,
    )
