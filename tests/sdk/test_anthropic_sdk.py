"""The real `anthropic` SDK against Flare's /v1/messages."""

from __future__ import annotations

import itertools
import json
from typing import Any

import anthropic
import pytest
from conftest import ECHO_TEXT, MODEL, echo_history, http, nonce, post_json, stop_string, wait_until_idle

USER = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {
    "name": "get_time",
    "description": "Current local time in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
NAMES = {"get_weather", "get_time"}
# Temperature 0 (greedy) is not a prepared sampling mode and is rejected; a low temperature
# makes the simulated copy model (nearly) deterministic.
GREEDY = {"temperature": 0.01}


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def check_message(msg, max_tokens: int) -> None:
    assert isinstance(msg.id, str) and msg.id
    assert msg.type == "message"
    assert msg.role == "assistant"
    assert msg.model == MODEL
    assert msg.stop_reason in STOP_REASONS
    assert isinstance(msg.content, list)
    for block in msg.content:
        assert block.type in {"text", "tool_use", "thinking"}, block
    assert isinstance(msg.usage.input_tokens, int) and msg.usage.input_tokens > 0
    assert isinstance(msg.usage.output_tokens, int) and 0 <= msg.usage.output_tokens <= max_tokens
    if msg.stop_reason == "max_tokens":
        assert msg.usage.output_tokens == max_tokens


def tool_history(question: str = "What is the weather in Paris?", tool: str = "get_weather") -> list[dict[str, Any]]:
    """The assistant already answered `question` with a call to `tool`; the question comes again."""
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_0", "name": tool, "input": {"city": "Paris"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_0", "content": json.dumps({"city": "Paris", "value": 18})}
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "It is 18 degrees in Paris."}]},
        {"role": "user", "content": question},
    ]


def check_tool_use(msg, allowed=NAMES) -> list[Any]:
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses, f"no tool_use block (stop_reason {msg.stop_reason}, content {msg.content})"
    assert msg.stop_reason == "tool_use"
    for u in uses:
        assert isinstance(u.id, str) and u.id
        assert u.name in allowed, u.name
        assert isinstance(u.input, dict)
    assert len({u.id for u in uses}) == len(uses)
    return uses


def test_messages_non_stream_shape(claude):
    raw = claude.messages.with_raw_response.create(model=MODEL, max_tokens=16, messages=USER)
    assert raw.headers.get("x-request-id"), "generation response lacks x-request-id"
    msg = raw.parse()
    check_message(msg, 16)
    assert msg.stop_reason in {"end_turn", "max_tokens"}
    assert msg.content and msg.content[0].type == "text"


def test_max_tokens_limit(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=3, messages=echo_history(), extra_body=GREEDY)
    check_message(msg, 3)
    assert msg.stop_reason == "max_tokens"


def test_system_prompt_counts_as_input(claude):
    plain = claude.messages.create(model=MODEL, max_tokens=4, messages=USER)
    with_system = claude.messages.create(
        model=MODEL, max_tokens=4, messages=USER, system="You are a poet who writes about the sea and ships."
    )
    check_message(with_system, 4)
    assert with_system.usage.input_tokens > plain.usage.input_tokens
    blocks = claude.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=USER,
        system=[{"type": "text", "text": "You are a poet who writes about the sea and ships."}],
    )
    assert blocks.usage.input_tokens == with_system.usage.input_tokens


def test_stop_sequences(claude):
    base = dict(model=MODEL, max_tokens=80, messages=echo_history(), extra_body=GREEDY)
    full = text_of(claude.messages.create(**base))
    stop, expected = stop_string(full)
    msg = claude.messages.create(stop_sequences=[stop], **base)
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == stop
    assert text_of(msg) == expected


def test_stream_event_order_and_text(claude):
    events = list(claude.messages.create(model=MODEL, max_tokens=16, messages=USER, stream=True, extra_body=GREEDY))
    types = [e.type for e in events]
    assert types[0] == "message_start", types
    assert types[-1] == "message_stop", types
    assert types.count("message_delta") == 1 and types.index("message_delta") == len(types) - 2, types
    start = events[0].message
    assert start.role == "assistant" and start.model == MODEL and start.content == []
    assert start.usage.input_tokens > 0
    open_blocks, text = set(), ""
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert e.index not in open_blocks
            open_blocks.add(e.index)
        elif e.type == "content_block_delta":
            assert e.index in open_blocks
            if e.delta.type == "text_delta":
                text += e.delta.text
        elif e.type == "content_block_stop":
            assert e.index in open_blocks
            open_blocks.remove(e.index)
        else:
            assert e.type == "ping", e.type
    assert not open_blocks, "a content block was never stopped"
    delta = events[-2]
    assert delta.delta.stop_reason in {"end_turn", "max_tokens"}
    assert 0 < delta.usage.output_tokens <= 16

    plain = claude.messages.create(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY)
    assert text_of(plain) == text
    assert plain.stop_reason == delta.delta.stop_reason


def test_stream_helper_final_message(claude):
    with claude.messages.stream(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    check_message(final, 16)
    assert text_of(final) == streamed


def test_tool_use_repeats_the_earlier_call(claude):
    msg = claude.messages.create(
        model=MODEL, max_tokens=64, tools=[WEATHER, TIME], messages=tool_history(), extra_body=GREEDY
    )
    check_message(msg, 64)
    uses = check_tool_use(msg)
    assert uses[0].name == "get_weather"


def test_tool_choice_any_and_named(claude):
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        tools=[WEATHER, TIME],
        tool_choice={"type": "any"},
        messages=tool_history(),
        extra_body=GREEDY,
    )
    check_tool_use(msg)
    named = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_time"},
        messages=tool_history(tool="get_time"),
        extra_body=GREEDY,
    )
    uses = check_tool_use(named, allowed={"get_time"})
    assert all(u.name == "get_time" for u in uses)


def test_tool_results_across_turns(claude):
    messages = tool_history()
    messages[0]["content"] = f"(session {nonce()}) " + messages[0]["content"]
    inputs = []
    for turn in range(3):
        msg = claude.messages.create(
            model=MODEL,
            max_tokens=64,
            tools=[WEATHER, TIME],
            tool_choice={"type": "any"},
            messages=messages,
            extra_body=GREEDY,
        )
        uses = check_tool_use(msg)
        inputs.append(msg.usage.input_tokens)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        results = [
            {"type": "tool_result", "tool_use_id": u.id, "content": json.dumps({"turn": turn, "temp_c": 10 + turn})}
            for u in uses
        ]
        # Ask again: the copy model answers the way the question was answered last time.
        messages.append(
            {"role": "user", "content": [*results, {"type": "text", "text": "What is the weather in Paris?"}]}
        )
    assert all(a < b for a, b in itertools.pairwise(inputs)), inputs


def test_streamed_tool_use(claude):
    events = list(
        claude.messages.create(
            model=MODEL,
            max_tokens=64,
            tools=[WEATHER, TIME],
            tool_choice={"type": "any"},
            messages=tool_history(),
            stream=True,
            extra_body=GREEDY,
        )
    )
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert starts, [e.type for e in events]
    for s in starts:
        assert s.content_block.name in NAMES and s.content_block.id
        partial = "".join(
            e.delta.partial_json
            for e in events
            if e.type == "content_block_delta" and e.index == s.index and e.delta.type == "input_json_delta"
        )
        assert isinstance(json.loads(partial), dict)
    assert next(e for e in events if e.type == "message_delta").delta.stop_reason == "tool_use"


# --- count_tokens -----------------------------------------------------------------------------------


def test_count_tokens_equals_the_input_tokens_of_a_message(claude):
    cases: list[dict[str, Any]] = [
        {"messages": USER},
        {"system": "You are a weather assistant.", "messages": tool_history(), "tools": [WEATHER, TIME]},
        {"messages": tool_history(), "tools": [WEATHER, TIME], "tool_choice": {"type": "any"}},
    ]
    counts = []
    for case in cases:
        counted = claude.messages.count_tokens(model=MODEL, **case)
        assert isinstance(counted.input_tokens, int) and counted.input_tokens > 0
        msg = claude.messages.create(model=MODEL, max_tokens=4, **case, extra_body=GREEDY)
        assert counted.input_tokens == msg.usage.input_tokens, case
        counts.append(counted.input_tokens)
    assert len(set(counts)) == len(counts), counts


def test_count_tokens_of_an_unknown_model_is_not_found(claude):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.count_tokens(model="no-such-model", messages=USER)
    assert_anthropic_error(404, info.value.response.json(), "not_found_error")


# --- errors -----------------------------------------------------------------------------------------


def assert_anthropic_error(status: int, body, error_type: str | None = None) -> None:
    assert isinstance(body, dict) and body.get("type") == "error", body
    err = body.get("error")
    assert isinstance(err, dict), body
    assert isinstance(err.get("type"), str) and err["type"], body
    assert isinstance(err.get("message"), str) and err["message"], body
    if error_type is not None:
        assert err["type"] == error_type, body


def test_missing_max_tokens_is_400(base_url):
    resp = post_json(
        base_url, "/v1/messages", {"model": MODEL, "messages": USER}, headers={"anthropic-version": "2023-06-01"}
    )
    assert resp.status == 400, resp.body[:300]
    assert_anthropic_error(400, resp.json(), "invalid_request_error")


@pytest.mark.parametrize(
    "bad", [{"max_tokens": 0}, {"messages": []}, {"temperature": -1}, {"temperature": 2.5}], ids=str
)
def test_invalid_parameters_raise_bad_request(claude, bad):
    kwargs = dict(model=MODEL, max_tokens=8, messages=USER)
    extra = {}
    for k, v in bad.items():
        if k in kwargs:
            kwargs[k] = v
        else:
            extra[k] = v
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(extra_body=extra or None, **kwargs)
    assert info.value.status_code == 400
    assert_anthropic_error(400, info.value.response.json(), "invalid_request_error")


def test_unknown_model_is_not_found(claude):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=USER)
    assert_anthropic_error(404, info.value.response.json(), "not_found_error")


def test_malformed_json_is_400(base_url):
    resp = http(base_url, "POST", "/v1/messages", b'{"model": ', "application/json")
    assert resp.status == 400, resp.body[:300]
    assert_anthropic_error(400, resp.json())


# --- cancellation -----------------------------------------------------------------------------------


def test_closing_a_stream_cancels_it(claude, base_url):
    wait_until_idle(base_url, timeout=10)
    long_text = " ".join([ECHO_TEXT] * 12)
    with claude.messages.stream(
        model=MODEL, max_tokens=4000, messages=echo_history(long_text), extra_body=GREEDY
    ) as stream:
        pieces = 0
        for _ in stream.text_stream:
            pieces += 1
            if pieces >= 3:
                break
    assert pieces == 3
    wait_until_idle(base_url, timeout=5)
    msg = claude.messages.create(model=MODEL, max_tokens=4, messages=USER)
    check_message(msg, 4)
