"""Tool calling's text side: the plan, the prompt (a template with and without tool syntax), the
grammar llguidance compiles, and the parser, whole and streamed in arbitrary pieces."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.processor import InputProcessor
from service.responses import ReplyStream
from service.tools import parse, plan_from_request, render_messages

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "now", "description": "the time"}},
]
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\""}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
LLAMA3_CALLS = (
    '{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\""}}; '
    '{"name": "now", "parameters": {}}'
)
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]  # fmt: skip


def test_plans_and_their_grammars_compile() -> None:
    import llguidance

    for choice in ("auto", "required", {"type": "function", "function": {"name": "now"}}):
        for parallel in (True, False):
            plan = plan_from_request(TOOLS, choice, parallel)
            assert plan is not None
            assert llguidance.LLMatcher.validate_grammar(plan.grammar()) == ""
    assert plan_from_request(TOOLS, "none", True) is None
    assert plan_from_request(None, None, True) is None
    named = plan_from_request(TOOLS, {"type": "function", "function": {"name": "now"}}, True)
    assert (named.choice, named.name, named.parallel) == ("named", "now", False)
    assert "get_weather" not in named.grammar()  # only the named function can be called


def test_without_tool_syntax_lumen_writes_tools_calls_and_results_as_text() -> None:
    plan = plan_from_request(TOOLS, "auto", True)
    out = render_messages(HISTORY, plan, native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and "<tools>" in out[0]["content"]
    assert json.dumps({"type": "function", "function": TOOLS[0]["function"]}) in out[0]["content"]
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert out[3]["content"] == (
        "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    )
    # tool_choice none: the history still renders, the tools stay out of the prompt.
    assert "<tools>" not in render_messages(HISTORY, None, native=False)[0]["content"]


def test_a_template_with_tool_syntax_renders_them_itself(tiny_model_path: Path) -> None:
    processor = InputProcessor.for_model(str(tiny_model_path), None)  # type: ignore[arg-type]
    assert not processor.template_takes_tools  # SmolLM2's template knows no tools
    template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}"
        "({{ c.function.arguments.city }}){% endfor %}\n{% endfor %}"
    )
    processor.chat_template = template
    assert processor.template_takes_tools
    messages = render_messages(HISTORY, None, native=True)
    ids = processor.apply_chat_template(messages, tools=TOOLS)
    text = processor.tokenizer.decode(ids)
    assert "TOOL get_weather\nTOOL now\n" in text
    assert "CALL get_weather(Paris)" in text  # arguments handed over as an object
    assert "tool: 18 C" in text


def test_a_llama3_template_takes_its_own_format(tiny_model_path: Path) -> None:
    from tests.helpers.models import LLAMA3_TOOL_TEMPLATE

    processor = InputProcessor.for_model(str(tiny_model_path), None)  # type: ignore[arg-type]
    assert not processor.template_writes_llama3_calls
    processor.chat_template = LLAMA3_TOOL_TEMPLATE
    assert processor.template_takes_tools and processor.template_writes_llama3_calls
    ids = processor.apply_chat_template(render_messages(HISTORY, None, native=True), tools=TOOLS)
    text = processor.tokenizer.decode(ids)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert "ipython<|end_header_id|>\n\n18 C" in text and "<tool_call>" not in text


def test_parse_reads_calls_only_at_the_start() -> None:
    content, calls = parse(CALLS)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": 'Paris, "FR"'}), ("now", {}),
    ]  # fmt: skip
    assert len({c["id"] for c in calls}) == 2
    assert parse("Sure. " + CALLS) == ("Sure. " + CALLS, [])
    cut = CALLS[:-20]  # max_tokens cut the second call: it stays text
    content, calls = parse(cut)
    assert len(calls) == 1 and content == cut[cut.index("<tool_call>", 10) :]


def test_llama3_calls_are_json_objects_with_parameters() -> None:
    content, calls = parse(LLAMA3_CALLS, fmt="llama3_json")
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": 'Paris, "FR"'}), ("now", {}),
    ]  # fmt: skip
    tagged = parse("<|python_tag|>" + LLAMA3_CALLS, fmt="llama3_json")
    assert tagged[0] is None and len(tagged[1]) == 2
    assert parse("Sure. " + LLAMA3_CALLS, fmt="llama3_json") == ("Sure. " + LLAMA3_CALLS, [])
    content, calls = parse(LLAMA3_CALLS[:-5], fmt="llama3_json")  # the second call cut short
    assert len(calls) == 1 and content == '{"name": "now", "parameters"'
    assert parse(CALLS, fmt="llama3_json") == (CALLS, [])  # Hermes blocks are text here


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_a_stream_in_any_pieces_gives_what_parse_gives(fmt: str, seed: int) -> None:
    rng = random.Random(seed)
    think = "<think>\nThe user wants </b> weather.\n</think>\n\n"
    calls = CALLS if fmt == "hermes" else LLAMA3_CALLS
    for text in (calls, "Plain <b>text</b> reply", calls[:-20], calls[:12], think + calls,
                 think + "Just text.", "<think>cut short", "<thx not a block",
                 "<|python_tag|>" + calls, calls + " and then text", "{not json"):  # fmt: skip
        stream, deltas, i = ReplyStream.of(None, True, fmt), [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            deltas += stream.feed(text[i : i + n])
            i += n
        deltas += stream.finish()
        content = "".join(d.get("content", "") for d in deltas) or None
        args: dict[int, str] = {}
        for d in deltas:
            for t in d.get("tool_calls", []):
                args[t["index"]] = args.get(t["index"], "") + t["function"].get("arguments", "")
        want_content, want_calls = parse(text, fmt=fmt)
        assert content == want_content, text
        assert [args[i] for i in sorted(args)] == [c["function"]["arguments"] for c in want_calls]
        assert stream.tools is not None
        assert [c["function"]["name"] for c in stream.tools.calls] == [
            c["function"]["name"] for c in want_calls
        ]


def test_calls_may_follow_a_think_block_in_every_mode(tiny_model_path: Path) -> None:
    """A thinking model opens its reply with <think>...</think>: the grammar lets calls (or,
    in auto, text) follow it, and parse reads them there, the block staying content (a
    reasoning parser takes it out first: service/reasoning.py)."""
    import llguidance

    think = "<think>\nweather, so get_weather </b>\n</think>\n\n"
    content, calls = parse(think + CALLS)
    assert content == think and [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    content, calls = parse("\n\n" + CALLS, after_think=True)
    assert content == "\n\n" and len(calls) == 2  # what came before the calls, as streamed
    assert parse("\n\n" + CALLS) == ("\n\n" + CALLS, [])  # no block: text
    tokenizer = llguidance.LLTokenizer(
        (tiny_model_path / "tokenizer.json").read_text(), n_vocab=49152, eos_token=[2]
    )
    from tokenizers import Tokenizer

    encode = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json")).encode

    def allowed(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        ids = encode(text, add_special_tokens=False).ids
        return all(matcher.consume_token(t) for t in ids) and not matcher.is_error()

    auto = plan_from_request(TOOLS, "auto", True)
    required = plan_from_request(TOOLS, "required", True)
    assert auto is not None and required is not None
    for plan in (auto, required):
        assert allowed(plan.grammar(), think + CALLS) and allowed(plan.grammar(), CALLS)
        assert not allowed(plan.grammar(), "<bad")
    assert allowed(auto.grammar(), think + "Sunny.")
    assert not allowed(required.grammar(), think + "Sunny.")
    # Llama 3's format: JSON objects with parameters, "; " between them; text not "{".
    for plan in (auto, required):
        plan.fmt = "llama3_json"
        assert allowed(plan.grammar(), LLAMA3_CALLS) and not allowed(plan.grammar(), CALLS)
        assert not allowed(plan.grammar(), '{"name": "get_weather", "arguments": {}}')
    assert allowed(auto.grammar(), "Sunny.") and not allowed(auto.grammar(), "{Sunny.")
    assert not allowed(required.grammar(), "Sunny.")
    # One block: a second </think> is text in auto (then no call follows), refused in required.
    assert not allowed(required.grammar(), "<think>a</think>b</think>" + CALLS)


def test_parameters_with_defs_keep_their_references() -> None:
    """Pydantic-made parameters refer to their own $defs; inside the grammar they still do."""
    import llguidance

    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    params = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
              "required": ["to"], "$defs": {"Address": address}}  # fmt: skip
    tools = [
        {"type": "function", "function": {"name": "ship", "parameters": params}},
        {"type": "function", "function": {"name": "bill", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/definitions/Address"}},
            "definitions": {"Address": {"type": "integer"}}}}},
    ]  # fmt: skip
    grammar = plan_from_request(tools, "required", True).grammar()
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert '"#/$defs/f0.Address"' in grammar and '"#/$defs/f1.Address"' in grammar
