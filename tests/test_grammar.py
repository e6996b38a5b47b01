"""Structured output (``SamplingParams.regex`` / ``json_schema``, runtime/grammar.py) on a tiny engine.

The tiny models are random, so what they generate unconstrained is noise: every constrained output must still match
its regex or validate under its schema (checked with ``re`` and ``jsonschema``, independent of the grammar library).
The engine gets a character-level tokenizer with JSON's punctuation (``json_tokenizer``), like test_llm's
``add_tokenizer``.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from test_llm import CHAT_TEMPLATE
from test_run_cli import cli

from trtbuild.errors import RequestError
from trtbuild.runtime.llm import LLM, SamplingParams
from trtbuild.runtime.sequence import FinishReason

JSON_CHARS = [*' {}[]":,.-+_\n', *map(chr, range(97, 123)), *map(str, range(10)), *map(chr, range(65, 91))]
JSON_WORDS = ['"name"', "true", "false", "null", ": ", ", ", ' "', "ing"]
JSON_VOCAB = ["<unk>", "<s>", "</s>", *JSON_CHARS, *JSON_WORDS]  # 86 tokens: fits every tiny model's vocabulary
EOS = 2

SCHEMAS = [
    {  # nested object, enum, bounded integer, optional field
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "pet": {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]}},
                "required": ["kind"],
                "additionalProperties": False,
            },
            "note": {"type": "string", "maxLength": 3},
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": False,
    },
    {  # array of bounded numbers, boolean
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["xs", "ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["a", "b", None]}, "minItems": 1, "maxItems": 4},
]


def add_json_tokenizer(engine: Path, dst: Path) -> Path:
    """A copy of ``engine`` with a character-level tokenizer of JSON_VOCAB (</s> = 2 = the llama EOS)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    shutil.copytree(engine, dst)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(JSON_VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (dst / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return dst


@pytest.fixture(scope="module")
def json_engine(tiny_engines, tmp_path_factory) -> Path:
    return add_json_tokenizer(tiny_engines["llama_gqa"][2], tmp_path_factory.mktemp("json") / "engine")


@pytest.fixture(scope="module")
def llm(json_engine) -> LLM:
    return LLM(json_engine)


def test_json_schema_outputs_validate(llm):
    """Greedy and sampled outputs of several schemas, in one batch: each parses, validates and ends with EOS."""
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=120, json_schema=schema)
        for schema in SCHEMAS
        for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (1.5, 3))
    ]
    outs = llm.generate(["the cat"] * len(params), params)
    for out, p in zip(outs, params, strict=True):
        assert out.finish_reason is FinishReason.STOP and out.token_ids[-1] == EOS, out.text
        jsonschema.validate(json.loads(out.text), p.json_schema)
    unconstrained = llm.generate(["the cat"], SamplingParams(temperature=0.0, max_tokens=40))[0].text
    with pytest.raises(ValueError):  # the reference: the random model's own text is not JSON
        json.loads(unconstrained)


def test_regex_outputs_match(llm):
    pattern = r"[a-z]{2,5}-\d{3}( ok)?"
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, regex=pattern) for s in range(6)]
    outs = llm.generate(["id:"] * 6, [*params[:5], SamplingParams(temperature=0.0, max_tokens=30, regex=pattern)])
    for out in outs:
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason is FinishReason.STOP
    assert len({o.text for o in outs}) > 1  # sampled, not one forced string


def test_constrained_and_plain_requests_share_a_batch(llm):
    """Masks touch only their own rows: the unconstrained requests' tokens equal those of a run without them."""
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 2
    alone = llm.generate(["ab", "cd"], plain)
    mixed = llm.generate(["ab", "x", "cd"], [plain[0], SamplingParams(temperature=0.0, regex="[0-9]{8}"), plain[1]])
    assert [o.token_ids for o in (mixed[0], mixed[2])] == [o.token_ids for o in alone]
    assert re.fullmatch("[0-9]{8}", mixed[1].text)


def test_n_completions_have_their_own_grammar_state(llm):
    out = llm.generate(["q"], SamplingParams(n=4, temperature=1.0, seed=7, json_schema=SCHEMAS[2], max_tokens=60))[0]
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS[2])


def test_max_tokens_cuts_a_constrained_output(llm):
    """A grammar does not stretch max_tokens: the output is a valid prefix, finish reason length."""
    out = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=3, regex="[a-z]{20}"))[0]
    assert out.finish_reason is FinishReason.LENGTH and re.fullmatch("[a-z]{3,15}", out.text)


def test_streamed_constrained_output(llm):
    stream = llm.generate_stream("s", SamplingParams(temperature=1.0, seed=3, json_schema=SCHEMAS[1], max_tokens=80))
    text = "".join(stream)
    jsonschema.validate(json.loads(text), SCHEMAS[1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json_schema": {"type": "nonsense"}}, "json_schema is not supported: Invalid type: nonsense"),
        ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum (5) is greater than maximum"),
        ({"json_schema": {"$ref": "#/nowhere"}}, "does not exist"),
        ({"json_schema": "{}"}, "json_schema must be a JSON schema object"),
        ({"regex": "(("}, "regex '((' is not supported: unclosed group"),
        ({"regex": "a", "json_schema": {}}, "at most one of regex and json_schema"),
        ({"regex": "a", "ignore_eos": True}, "ignore_eos cannot be combined"),
    ],
)
def test_bad_grammars_are_one_line_request_errors(kwargs, message):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_request_is_refused_before_anything_runs(tiny_engines):
    """An engine without a tokenizer cannot constrain: the whole call is refused, nothing is queued."""
    bare = LLM(tiny_engines["llama_gqa"][2])
    good = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(RequestError, match=r"^prompt 1: structured output .* needs the engine's tokenizer.json$"):
        bare.generate([[5, 6], [7]], [good, SamplingParams(regex="a+")])
    assert not bare.scheduler.has_unfinished()
    assert bare.generate([[5, 6]], good)[0].finish_reason is FinishReason.LENGTH


def test_masks_are_computed_while_the_engine_runs(llm):
    """The masks of a step start before the engine call (a worker thread) and are exact for the grammar state."""
    llm.generate(["a"], SamplingParams(temperature=0.0, regex="[0-9]+", max_tokens=2))
    grammars = llm.grammars
    seq_params = SamplingParams(regex="(ab|cd)e")
    m = grammars.matcher(seq_params)
    masks = grammars.start_masks([(0, m)])
    logits = np.zeros((1, llm.vocab_size), dtype=np.float32)
    masks.apply(logits)
    allowed = {JSON_VOCAB[t] for t in np.flatnonzero(np.isfinite(logits[0]))}
    assert allowed == {"a", "c"}
    m.advance(JSON_VOCAB.index("a"))
    m.advance(JSON_VOCAB.index("b"))
    logits[:] = 0
    grammars.start_masks([(0, m)]).apply(logits)
    assert {JSON_VOCAB[t] for t in np.flatnonzero(np.isfinite(logits[0]))} == {"e"}
    m.advance(JSON_VOCAB.index("e"))
    logits[:] = 0
    grammars.start_masks([(0, m)]).apply(logits)
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [EOS] and m.accepting


def test_structured_output_imports_no_build_tool(json_engine):
    """A constrained request loads llguidance, and still neither torch nor transformers."""
    code = (
        "import sys, trtbuild\n"
        f"llm = trtbuild.LLM({str(json_engine)!r})\n"
        "out = llm.generate(['a'], trtbuild.SamplingParams(temperature=0, max_tokens=8, regex='[0-9]{4}'))\n"
        "assert len(out[0].text) == 4 and out[0].text.isdigit(), out[0].text\n"
        "assert 'llguidance' in sys.modules\n"
        "heavy = [m for m in ('torch', 'transformers', 'onnx') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------------- trtbuild run


def test_run_json_schema_and_regex_flags(monkeypatch, capsys, json_engine, tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[0]))
    code, out, err = cli(
        monkeypatch, capsys, "run", json_engine, "--prompt", "hi", "--json-schema", schema_file, "--max-tokens", 120
    )
    assert code == 0, err
    jsonschema.validate(json.loads(out), SCHEMAS[0])
    code, out, err = cli(monkeypatch, capsys, "run", json_engine, "--prompt", "hi", "--regex", "[a-c]{3}x")
    assert code == 0 and re.fullmatch("[a-c]{3}x", out.rstrip("\n")), err


def test_run_jsonl_structured_fields(monkeypatch, capsys, json_engine, tmp_path):
    lines = [
        {"prompt": "a", "json_schema": SCHEMAS[1], "seed": 1, "max_tokens": 100},
        {"prompt": "b", "regex": "[0-9]{5}"},
        {"prompt": "c", "max_tokens": 4},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    code, _, err = cli(monkeypatch, capsys, "run", json_engine, "--input", src, "--output", dst, "--quiet")
    assert code == 0, err
    texts = [json.loads(ln)["outputs"][0]["text"] for ln in dst.read_text().splitlines()]
    jsonschema.validate(json.loads(texts[0]), SCHEMAS[1])
    assert re.fullmatch("[0-9]{5}", texts[1])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--regex", "[a-"], "regex '[a-' is not supported: unclosed character class"),
        (["--json-schema", "SCHEMA"], "json_schema is not supported: Invalid type: nonsense"),
        (["--json-schema", "MISSING"], "cannot read (No such file or directory)"),
        (["--json-schema", "LIST"], "expected a JSON object, got list"),
    ],
)
def test_run_bad_grammar_is_one_error_line(monkeypatch, capsys, json_engine, tmp_path, args, needle):
    (tmp_path / "SCHEMA").write_text('{"type": "nonsense"}')
    (tmp_path / "LIST").write_text("[]")
    args = [str(tmp_path / a) if a in ("SCHEMA", "MISSING", "LIST") else a for a in args]
    code, _, err = cli(monkeypatch, capsys, "run", json_engine, "--prompt", "x", *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


# ---------------------------------------------------------------------------------- serve: response_format


@pytest.fixture(scope="module")
def client(json_engine):
    import openai
    from test_serve import API_KEY, running_server

    from trtbuild.serve.config import ServeConfig

    with running_server(json_engine, ServeConfig(api_key=API_KEY)) as url:
        yield openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=60)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_serve_response_format_json_schema(client):
    messages = [{"role": "user", "content": "a pet"}]
    for schema in SCHEMAS:
        reply = client.chat.completions.create(
            model="tiny", messages=messages, response_format=json_schema_format(schema), max_tokens=100, seed=4
        )
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, response_format=json_schema_format(SCHEMAS[0]), max_tokens=100, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[0])
    done = client.completions.create(  # vLLM's extension: /v1/completions takes response_format too
        model="tiny",
        prompt="x",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": json_schema_format(SCHEMAS[2])},
    )
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMAS[2])


def test_serve_response_format_json_object(client):
    replies = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "json"}],
        response_format={"type": "json_object"},
        max_tokens=100,
        n=3,
        seed=1,
    )
    for choice in replies.choices:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(
    ("response_format", "needle"),
    [
        (json_schema_format({"type": "nonsense"}), "response_format: json_schema is not supported: Invalid type"),
        (json_schema_format({"type": "string", "pattern": "(("}), "unclosed group"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "must be an object with a 'name'"),
        ({"type": "yaml"}, "response_format.type must be"),
    ],
)
def test_serve_bad_response_format_is_one_400(client, response_format, needle):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], response_format=response_format
        )
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == "response_format", error
    assert needle in error["message"] and "\n" not in error["message"], error


# ---------------------------------------------------------------------------------------- serve: tool calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory) -> Path:
    """A tiny random llama of 1,024 positions (the functions' descriptions take ~600 characters), JSON tokenizer."""
    import torch
    from tiny_models import TINY_CONFIGS
    from transformers import AutoConfig, AutoModelForCausalLM

    from trtbuild.build import build_engine
    from trtbuild.config import BuildConfig, DType
    from trtbuild.convert.convert import convert

    root = tmp_path_factory.mktemp("tools")
    spec = {**TINY_CONFIGS["llama_gqa"], "max_position_embeddings": 1024}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec))
    model.save_pretrained(str(root / "hf"))
    convert(root / "hf", root / "ckpt", DType.FLOAT32)
    build_engine(root / "ckpt", root / "long", BuildConfig(max_seq_len=1024, kv_block_size=16))
    return add_json_tokenizer(root / "long", root / "engine")


@contextlib.contextmanager
def openai_client(engine: Path) -> Iterator[Any]:
    import openai
    from test_serve import API_KEY, running_server

    from trtbuild.serve.config import ServeConfig

    with running_server(engine, ServeConfig(api_key=API_KEY)) as url:
        yield openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tool_client(tool_engine):
    """A server whose chat template renders no tools: they are described in a system message."""
    with openai_client(tool_engine) as client:
        yield client


def test_serve_tool_choice_required_calls_a_declared_function(tool_client):
    """20 of 20 sampled replies name a declared function with arguments that validate."""
    reply = tool_client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "weather in paris?"}],
        tools=[WEATHER, ADD],
        tool_choice="required",
        n=20,
        temperature=1.0,
        seed=0,
        max_tokens=80,
    )
    names = set()
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        names.add(call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    assert len(reply.choices) == 20 and names <= set(PARAMETERS)


def test_serve_named_tool_choice_streams_like_openai(tool_client):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 + 2"}],
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=60,
        temperature=0,
    )
    whole = tool_client.chat.completions.create(**kwargs)
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["add"])
    chunks = list(tool_client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].function.name == "add" and calls[0].id.startswith("call_")
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice", "'tool_choice' needs 'tools'"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                "tool_choice": "required",
            },
            "tools",
            "Invalid type: nonsense",
        ),
    ],
)
def test_serve_bad_tools_are_one_400(tool_client, kwargs, param, needle):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        tool_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param and needle in e.value.body["message"]


def test_structured_output_on_a_device_sampler_engine(tiny_engines, json_engine, tmp_path):
    """The torch engine keeps its logits as torch tensors (DeviceSampler): masked there, the tokens equal the
    onnxruntime engine's (numpy logits) for the same constrained requests."""
    from trtbuild.backends.torch.sampling import DeviceSampler
    from trtbuild.build import build_engine
    from trtbuild.config import Backend, BuildConfig, TorchConfig, TorchDevice, TorchRuntime

    torch_config = TorchConfig(TorchDevice.CPU, torch_runtime=TorchRuntime.TORCH_COMPILE)
    built = tmp_path / "torch"
    config = BuildConfig(backend=Backend.TORCH, max_seq_len=128, kv_block_size=4)
    build_engine(tiny_engines["llama_gqa"][1], built, config, torch=torch_config)
    engine = add_json_tokenizer(built, tmp_path / "engine")
    device = LLM(engine)
    assert isinstance(device.sampler, DeviceSampler)
    params = [
        SamplingParams(temperature=0.0, max_tokens=80, json_schema=SCHEMAS[0]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=80, json_schema=SCHEMAS[2]),
        SamplingParams(temperature=0.0, max_tokens=20, regex="[a-z]{4}-[0-9]{2}"),
    ]
    outs = device.generate(["the cat"] * 3, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(json_engine).generate(["the cat"] * 3, params)]
    jsonschema.validate(json.loads(outs[0].text), SCHEMAS[0])


def test_tool_call_stream_splits_a_call_at_any_boundary():
    """However the call's text arrives, the deltas carry the name once and the arguments exactly."""
    from trtbuild.serve.tools import ToolCallStream, parse_tools

    text = json.dumps({"name": "get_weather", "arguments": {"city": "a}b", "unit": "c"}})
    for step in (1, 2, 5, len(text)):
        stream, calls = ToolCallStream(), []
        for i in range(0, len(text), step):
            calls += stream.feed(text[i : i + step], finished=i + step >= len(text))
        assert [c["function"]["name"] for c in calls if "id" in c] == ["get_weather"]
        assert "".join(c["function"]["arguments"] for c in calls) == json.dumps({"city": "a}b", "unit": "c"})
    tools = parse_tools({"tools": [WEATHER, ADD]})  # tool_choice auto: a reply is a call only if it is one
    assert tools.parse_calls(text) == [("get_weather", json.dumps({"city": "a}b", "unit": "c"}))]
    assert tools.parse_calls('{"name": "nope", "arguments": {}}') == []
    assert tools.parse_calls("the weather is fine") == []
    assert tools.parse_calls(f"<tool_call>{text}</tool_call>") == []  # the Hermes tags are not this format's


# A chat template in the Hermes tool format (modelled on Qwen2.5's, Apache-2.0): tools listed in <tools>, calls in
# <tool_call> blocks, tool results as <tool_response> user turns.
HERMES_TEMPLATE = (
    "{% if tools %}<s>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools></s>\n"
    "{% elif messages[0].role == 'system' %}<s>system\n{{ messages[0].content }}</s>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<s>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n</tool_call>{% endfor %}</s>\n'
    "{% elif m.role == 'tool' %}<s>user\n<tool_response>\n{{ m.content }}\n</tool_response></s>\n"
    "{% else %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_engine(tool_engine, tmp_path_factory) -> Path:
    engine = tmp_path_factory.mktemp("hermes") / "engine"
    shutil.copytree(tool_engine, engine)
    (engine / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return engine


def test_hermes_template_gets_the_tools_and_the_calls_in_its_own_format(hermes_engine, tool_engine):
    """A template that renders ``tools`` with <tool_call> tags gets the functions as ``tools`` (not a system
    message), the history's calls with their arguments as objects, and a required call starts after <tool_call>."""
    from trtbuild.runtime.tokenizer import Tokenizer
    from trtbuild.serve.protocol import Endpoint, parse_request
    from trtbuild.serve.tools import ToolFormat

    tokenizer = Tokenizer.from_engine_dir(hermes_engine)
    assert tokenizer.template_takes_tools and ToolFormat.of(tokenizer) is ToolFormat.HERMES
    assert ToolFormat.of(Tokenizer.from_engine_dir(tool_engine)) is ToolFormat.SYSTEM_MESSAGE  # renders no tools
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "user", "content": "1 + 2"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    body = {"messages": messages, "tools": [WEATHER, ADD], "tool_choice": "required"}
    [chat] = parse_request(body, Endpoint.CHAT, ToolFormat.HERMES).prompts
    assert chat.messages[0] == messages[0] and chat.tools == [WEATHER, ADD] and chat.reply_prefix == "<tool_call>\n"
    text = tokenizer.apply_chat_template(chat.messages, tools=chat.tools) + chat.reply_prefix
    assert text.startswith("<s>system\n<tools>" + json.dumps(WEATHER) + json.dumps(ADD) + "</tools>")
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text  # not re-quoted
    assert text.endswith("<tool_response>\n3\n</tool_response></s>\n<s>assistant\n<tool_call>\n")
    auto = parse_request({**body, "tool_choice": "auto"}, Endpoint.CHAT, ToolFormat.HERMES)
    assert auto.prompts[0].reply_prefix == "" and auto.tools is not None
    two = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n' + (
        '{"name": "get_weather", "arguments": {"city": "x", "unit": "c"}}\n</tool_call>'
    )
    assert [name for name, _ in auto.tools.parse_calls(two)] == ["add", "get_weather"]
    assert auto.tools.parse_calls("sure: " + two) == []  # text beside the calls: a text reply
    assert auto.tools.parse_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}') == [("add", '{"a": 1, "b": 2}')]


def test_serve_required_call_on_a_hermes_template(hermes_engine):
    """Through the server: the reply generated after the forced <tool_call> names a declared function with
    arguments that validate, whole and streamed alike; an "auto" text reply streams the text it answers whole."""
    with openai_client(hermes_engine) as client:
        kwargs = dict(
            model="tiny",
            messages=[{"role": "user", "content": "weather in paris?"}],
            tools=[WEATHER, ADD],
            tool_choice="required",
            max_tokens=80,
            temperature=0,
        )
        whole = client.chat.completions.create(**kwargs)
        [call] = whole.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        assert whole.choices[0].finish_reason == "tool_calls"
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert calls[0].function.name == call.function.name
        assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
        auto = {**kwargs, "tool_choice": "auto", "max_tokens": 30}  # the random model replies text: streamed as such
        text = client.chat.completions.create(**auto).choices[0].message.content
        chunks = list(client.chat.completions.create(**auto, stream=True))
        assert text and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_auto_call_stream_holds_back_only_what_may_be_a_call(step):
    """``"auto"`` streaming: a reply that is calls goes out as tool_calls deltas at its end, whatever the
    boundaries; a text reply streams as it comes (held back only while it could still open a call)."""
    from trtbuild.serve.tools import AutoCallStream, ToolFormat, parse_tools

    def run(tools, reply):
        stream, text, calls = AutoCallStream(tools), [], []
        for i in range(0, len(reply), step):
            t, c = stream.feed(reply[i : i + step], finished=i + step >= len(reply))
            text.append(t)
            calls += c
        return "".join(text), calls, text

    hermes = parse_tools({"tools": [WEATHER, ADD]}, ToolFormat.HERMES)
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    text, calls, _ = run(hermes, reply)
    assert text == "" and [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "add", '{"a": 1, "b": 2}')
    ]
    text, calls, parts = run(hermes, "Hello there, no call")
    assert text == "Hello there, no call" and calls == []
    assert step == 1000 or parts[1] != ""  # passed through once it cannot open a call, not held to the end
    text, calls, _ = run(hermes, '{"not": "a call"}')
    assert text == '{"not": "a call"}' and calls == []  # held (it could have been one), then sent as text
