"""Structured outputs in ``lmforge serve`` (``serve/grammar.py``): ``response_format`` json_object /
json_schema, ``tool_choice`` "required" / named, ``parallel_tool_calls: false``, ``strict`` tools, through
the ``openai`` client against a real server.

The model is a tiny random Llama on the ASCII character tokenizer (``char:ascii``), sampled at temperature
1: left to itself it writes noise, so every valid reply below is the grammar's doing, and a test with the
mask switched off shows the checks can fail. The logprobs are checked against a mask computed
independently (one matcher copy per candidate token). SmolLM2 tests (marker ``smollm2``) check the same on
a real BPE tokenizer.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from lmforge.envs.toolcalls import parse_tool_calls

openai = pytest.importorskip("openai")
xgr = pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["color", "n", "ok", "word"],
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"type": "string", "enum": ["red", "green"]},
        "ok": {"type": "boolean"},
        "word": {"type": "string", "maxLength": 6},
    },
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 999},
                    "b": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "negate",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99}},
                "required": ["x"],
            },
        },
    },
]
QUESTION = [{"role": "user", "content": "12*34="}]
N = 4  # samples per request (n): independent draws, one batch


def valid_answer(obj) -> bool:
    """Whether ``obj`` matches SCHEMA (checked by hand: no schema library needed)."""
    return (
        isinstance(obj, dict)
        and set(obj) == {"color", "n", "ok", "word"}
        and obj["color"] in ("red", "green")
        and type(obj["n"]) is int
        and 0 <= obj["n"] <= 99
        and type(obj["ok"]) is bool
        and isinstance(obj["word"], str)
        and len(obj["word"]) <= 6
    )


def valid_call(name: str, arguments: dict) -> bool:
    """Whether a call matches TOOLS' schemas."""
    keys = {"multiply": {"a", "b"}, "negate": {"x"}}.get(name)
    return keys is not None and set(arguments) == keys and all(type(v) is int for v in arguments.values())


def parse_json(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


@pytest.fixture(scope="module")
def ascii_model(make_ascii):
    return make_ascii(context=2048, seed=0)


@pytest.fixture
def client(serve_model, ascii_model):
    server = serve_model(*ascii_model)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, **kwargs):
    return client.chat.completions.create(
        model="tiny-test", messages=QUESTION, temperature=1.0, **{"max_tokens": 300, **kwargs}
    )


# ------------------------------------------------------------------------------------------ response_format


def test_json_schema_replies_match_the_schema_for_every_sample(client):
    for seed in (0, 1):
        for choice in ask(client, response_format=JSON_SCHEMA, seed=seed, n=N).choices:
            assert choice.finish_reason == "stop"
            assert valid_answer(parse_json(choice.message.content)), choice.message.content
            assert list(parse_json(choice.message.content)) == list(SCHEMA["properties"])  # the schema's order


def test_json_object_replies_are_json_objects(client):
    for choice in ask(client, response_format={"type": "json_object"}, seed=0, n=N, max_tokens=400).choices:
        assert choice.finish_reason == "stop"
        assert isinstance(parse_json(choice.message.content), dict), choice.message.content


def test_text_format_changes_nothing(client):
    plain = ask(client, seed=3, max_tokens=12).choices[0].message.content
    assert ask(client, seed=3, max_tokens=12, response_format={"type": "text"}).choices[0].message.content == plain


def test_without_the_mask_the_replies_are_not_valid(client, monkeypatch):
    """The same requests with the mask switched off (the matcher still runs): the model's own text fails
    the checks, so the tests above measure the grammar."""
    from lmforge.serve.grammar import GrammarProcessor

    monkeypatch.setattr(GrammarProcessor, "mask", lambda self, logits: None)
    replies = [c.message.content for c in ask(client, response_format=JSON_SCHEMA, seed=0, n=N, max_tokens=40).choices]
    assert not any(valid_answer(parse_json(text)) for text in replies)


def test_logprobs_are_those_of_the_masked_tempered_distribution(client, ascii_model):
    """Each returned logprob = log_softmax(masked logits / T) of the sampled token, where the mask is
    recomputed here by trying every token on a copy of a matcher, not from xgrammar's bitmask."""
    model, tok = ascii_model
    temperature = 0.7
    reply = client.chat.completions.create(
        model="tiny-test",
        messages=QUESTION,
        temperature=temperature,
        seed=5,
        max_tokens=200,
        logprobs=True,
        response_format=JSON_SCHEMA,
    )
    choice = reply.choices[0]
    sampled, returned = choice.model_extra["token_ids"], [e.logprob for e in choice.logprobs.content]
    ids = torch.tensor([reply.model_extra["prompt_token_ids"] + sampled])
    with torch.no_grad():
        logits = model(ids).logits[0, -len(sampled) - 1 : -1].float()  # (T, V): the logits each token was drawn from
    info = xgr.TokenizerInfo.from_huggingface(tok, stop_token_ids=[tok.eos_token_id])
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True)
    )
    specials = set(tok.all_special_ids) - {tok.eos_token_id}
    mass_left_out = []
    for step, token in enumerate(sampled):
        allowed = [t for t in range(logits.shape[1]) if t not in specials and matcher.fork().accept_token(t)]
        masked = torch.full_like(logits[step], -math.inf)
        masked[allowed] = logits[step, allowed]
        expected = torch.log_softmax(masked / temperature, -1)[token].item()
        assert returned[step] == pytest.approx(expected, abs=2e-5), step
        unmasked = torch.log_softmax(logits[step] / temperature, -1)[token].item()
        mass_left_out.append(expected - unmasked)  # -log(allowed mass) >= 0
        assert matcher.accept_token(token)
    assert matcher.is_terminated() and sampled[-1] == tok.eos_token_id
    assert max(mass_left_out) > 0.1  # the mask mattered: the unmasked logprob differs


# ------------------------------------------------------------------------------------------ tools


def calls_of(choice) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def test_required_gives_calls_that_parse_and_match_their_schemas(client):
    counts = []
    for choice in ask(client, tools=TOOLS, tool_choice="required", seed=0, n=N, max_tokens=1000).choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = calls_of(choice)
        assert calls and all(valid_call(name, args) for name, args in calls), calls
        counts.append(len(calls))
    assert min(counts) >= 1


def test_required_text_is_what_parse_tool_calls_reads(client, ascii_model):
    _, tok = ascii_model
    choice = ask(client, tools=TOOLS, tool_choice="required", seed=1, max_tokens=1000).choices[0]
    text = tok.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    parsed = parse_tool_calls(text)
    assert parsed.errors == [] and parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.calls] == calls_of(choice)
    assert len(parsed.calls) > 1  # parallel calls (the default), one per line
    assert text.startswith('<tool_call>\n{"name": "') and "</tool_call>\n<tool_call>\n" in text


def test_named_tool_choice_calls_that_tool_once(client):
    named = {"type": "function", "function": {"name": "negate"}}
    for choice in ask(client, tools=TOOLS, tool_choice=named, seed=0, n=N).choices:
        [(name, arguments)] = calls_of(choice)
        assert name == "negate" and valid_call(name, arguments)


def test_parallel_tool_calls_false_allows_one_call(client):
    for choice in ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=0, n=N).choices:
        assert len(calls_of(choice)) == 1 and valid_call(*calls_of(choice)[0])


def test_streamed_required_call_is_the_non_streamed_one(client):
    kwargs = dict(tools=TOOLS, tool_choice="required", seed=2)
    whole = ask(client, **kwargs).choices[0]
    chunks = [c for c in ask(client, **kwargs, stream=True) if c.choices]
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids", [])] == whole.model_extra["token_ids"]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in last.delta.tool_calls] == calls_of(whole)


def test_streamed_json_schema_reply_is_valid(client):
    chunks = [c for c in ask(client, response_format=JSON_SCHEMA, seed=0, stream=True) if c.choices]
    assert valid_answer(parse_json("".join(c.choices[0].delta.content or "" for c in chunks)))


def test_strict_tools_under_auto_constrain_a_call_once_it_starts(ascii_model):
    """Free text stays free; after ``<tool_call>`` only a well-formed call of a strict tool may follow."""
    from lmforge.serve.grammar import Grammars, chat_constraint
    from lmforge.serve.protocol import ChatRequest

    _, tok = ascii_model
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    body = ChatRequest.model_validate({"messages": QUESTION, "tools": strict})
    [make] = Grammars(tok, len(tok), [tok.eos_token_id]).processors(chat_constraint(body))
    processor = make()

    def allowed_after(text: str) -> set[str]:  # the whole text so far (the processor feeds itself what is new)
        logits = torch.zeros(len(tok))
        processor.process(logits, [], tok.encode(text, add_special_tokens=False))
        return {tok.convert_ids_to_tokens(i) for i in torch.nonzero(logits == 0).flatten().tolist()}

    assert {"a", "Z", " ", "<", "<eos>"} <= allowed_after("Let me see")
    assert allowed_after('Let me see<tool_call>\n{"name": "') == {"m", "n"}
    processor = make()
    call = '<tool_call>\n{"name": "negate", "arguments": {"x": '
    assert allowed_after(call) == {"-", *"0123456789"}
    assert allowed_after(call + "12}}\n</tool_call>") >= {"<eos>", "<", "a"}  # free text; more calls may follow
    # a tool that is not strict is still called with a well-formed name, and any JSON object
    loose = ChatRequest.model_validate({"messages": QUESTION, "tools": TOOLS, "parallel_tool_calls": False})
    processor = Grammars(tok, len(tok), [tok.eos_token_id]).processors(chat_constraint(loose))[0]()
    call = '<tool_call>\n{"name": "negate", "arguments": {'
    assert allowed_after(call) == {'"', "}", " ", "\n"}
    assert allowed_after(call + '"y": []}}\n</tool_call>') == {"<eos>"}  # parallel_tool_calls false: one call
    assert not chat_constraint(ChatRequest.model_validate({"messages": QUESTION, "tools": TOOLS}))  # plain auto


def test_response_format_with_tools_is_the_json_or_calls(client):
    kinds = set()
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]  # bounded arguments
    for choice in ask(client, tools=strict, response_format=JSON_SCHEMA, seed=0, n=N, max_tokens=1000).choices:
        calls = calls_of(choice)
        assert calls or valid_answer(parse_json(choice.message.content)), choice.message.content
        kinds.add(bool(calls))
    assert kinds == {True, False}  # both branches taken


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format.json_schema.schema",
            'Unsupported type "objekt"',
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format.type"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "divide"}}},
            "tool_choice.function.name",
            "'divide', which is not among the tools",
        ),
        ({"tools": TOOLS, "tool_choice": {"name": "multiply"}}, "tool_choice", "a named tool_choice is"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", 'not one of "auto"'),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
            "cannot be compiled",
        ),
        ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, "ignore_eos", "ignore_eos"),
    ],
)
def test_what_cannot_be_decoded_is_a_400_naming_the_field(client, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param
    assert message in info.value.body["message"]


def test_without_xgrammar_a_structured_request_is_a_400_with_the_install(client, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, max_tokens=4, tools=TOOLS, tool_choice="required")
    assert info.value.body["param"] == "tool_choice"
    assert "pip install 'lmforge[grammar]'" in info.value.body["message"]
    assert ask(client, max_tokens=4).choices[0].finish_reason  # plain requests still work


# ------------------------------------------------------------------------------------------ clients


def test_langchain_structured_output_and_tool_choice_any(serve_model, ascii_model):
    chat_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        color: str = Field(json_schema_extra={"enum": ["red", "green"]})
        ok: bool

    server = serve_model(*ascii_model)
    llm = chat_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model="tiny-test",
        temperature=1.0,
        max_tokens=400,
        seed=0,
        max_retries=0,
    )
    answer = llm.with_structured_output(Answer).invoke("pick one")  # response_format json_schema, strict
    assert isinstance(answer, Answer) and answer.color in ("red", "green")
    message = llm.bind_tools([TOOLS[1]], tool_choice="any", parallel_tool_calls=False).invoke("negate 3")
    [call] = message.tool_calls  # tool_choice "any" is sent as "required"
    assert call["name"] == "negate" and type(call["args"]["x"]) is int


# ------------------------------------------------------------------------------------------ SmolLM2


@pytest.mark.smollm2
def test_smollm2_json_schema_and_required_call(serve_model, smollm2):
    server = serve_model(*smollm2)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Describe a traffic light as JSON."}]
    reply = client.chat.completions.create(
        model="tiny-test", messages=messages, temperature=1.0, seed=0, n=3, max_tokens=48, response_format=JSON_SCHEMA
    )
    for choice in reply.choices:
        assert valid_answer(parse_json(choice.message.content)), choice.message.content
    reply = client.chat.completions.create(
        model="tiny-test",
        messages=[{"role": "user", "content": "12*34?"}],
        temperature=1.0,
        seed=0,
        n=2,
        max_tokens=64,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and all(valid_call(*c) for c in calls_of(choice))
