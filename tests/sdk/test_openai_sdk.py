"""The real `openai` SDK against Flare's OpenAI-compatible endpoints."""

from __future__ import annotations

import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from conftest import (
    MODEL,
    TIME_TOOL,
    TOOL_NAMES,
    WEATHER_TOOL,
    assert_openai_error,
    echo_history,
    http,
    nonce,
    stop_string,
    text_history,
    tool_history,
    wait_until_idle,
)

USER = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
# Temperature 0 (greedy) is not a prepared sampling mode and is rejected (see the errors below);
# a low temperature makes the simulated copy model (nearly) deterministic.
LOW_TEMPERATURE = 0.01
FINISH = {"stop", "length", "tool_calls"}


def check_usage(usage, max_completion: int | None = None) -> None:
    assert usage is not None, "response has no usage"
    assert isinstance(usage.prompt_tokens, int) and usage.prompt_tokens > 0
    assert isinstance(usage.completion_tokens, int) and usage.completion_tokens >= 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if max_completion is not None:
        assert usage.completion_tokens <= max_completion
    details = usage.prompt_tokens_details
    assert details is not None, "usage lacks prompt_tokens_details"
    assert isinstance(details.cached_tokens, int) and 0 <= details.cached_tokens <= usage.prompt_tokens


def collect_stream(stream) -> dict[str, Any]:
    """Reads a chat stream and checks per-chunk invariants; returns what it assembled."""
    ids, finish, usage_chunks, roles = set(), {}, [], {}
    texts: dict[int, str] = {}
    tool_calls: dict[int, dict[int, dict[str, Any]]] = {}
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        assert chunk.model == MODEL
        assert isinstance(chunk.created, int)
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage_chunks.append(chunk)
        for choice in chunk.choices:
            i = choice.index
            assert i not in finish, f"choice {i} got content after its finish_reason"
            delta = choice.delta
            if delta.role is not None:
                assert delta.role == "assistant"
                roles[i] = delta.role
            if delta.content:
                texts[i] = texts.get(i, "") + delta.content
            for tc in delta.tool_calls or []:
                slot = tool_calls.setdefault(i, {}).setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert slot["id"] in (None, tc.id), "tool call id changed mid-stream"
                    slot["id"] = tc.id
                if tc.function is not None:
                    if tc.function.name:
                        slot["name"] += tc.function.name
                    if tc.function.arguments:
                        slot["arguments"] += tc.function.arguments
            if choice.finish_reason is not None:
                finish[i] = choice.finish_reason
    assert len(ids) == 1, f"chunks carry several ids: {ids}"
    (cid,) = ids
    assert isinstance(cid, str) and cid
    return {
        "id": cid,
        "texts": texts,
        "finish": finish,
        "usage_chunks": usage_chunks,
        "tool_calls": tool_calls,
        "roles": roles,
    }


# --- models -------------------------------------------------------------------------------------


def test_models_lists_flare_sim(oai):
    models = oai.models.list()
    ids = [m.id for m in models.data]
    assert MODEL in ids, ids
    for m in models.data:
        assert m.object == "model"
        assert isinstance(m.id, str) and m.id


def test_models_retrieve_by_id(oai):
    model = oai.models.retrieve(MODEL)
    assert model.id == MODEL
    assert model.object == "model"
    assert model.owned_by == "flare"
    assert model == next(m for m in oai.models.list().data if m.id == MODEL)
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("no-such-model")
    assert assert_openai_error(info.value, 404, "not_found_error")["code"] == "model_not_found"


# --- chat completions: shapes ------------------------------------------------------------------


def test_chat_non_stream_shape_and_request_id(oai):
    raw = oai.chat.completions.with_raw_response.create(model=MODEL, messages=USER, max_tokens=16)
    rid = raw.headers.get("x-request-id")
    assert rid, "generation response lacks x-request-id"
    resp = raw.parse()
    assert isinstance(resp.id, str) and resp.id
    assert resp.object == "chat.completion"
    assert resp.model == MODEL
    assert isinstance(resp.created, int) and resp.created > 1_600_000_000
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in {"stop", "length"}
    check_usage(resp.usage, 16)
    if choice.finish_reason == "length":
        assert resp.usage.completion_tokens == 16

    again = oai.chat.completions.with_raw_response.create(model=MODEL, messages=USER, max_tokens=4)
    assert again.headers.get("x-request-id") not in (None, rid), "x-request-id must differ per request"


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_token_limit_gives_length(oai, param):
    resp = oai.chat.completions.create(model=MODEL, messages=USER, extra_body={"ignore_eos": True}, **{param: 5})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5


def test_chat_stream_with_usage_matches_non_stream(oai):
    kwargs = dict(model=MODEL, messages=USER, max_tokens=24, temperature=LOW_TEMPERATURE, seed=11)
    with oai.chat.completions.with_streaming_response.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ) as raw:
        assert raw.headers.get("x-request-id"), "streaming response lacks x-request-id"
        assert raw.headers.get("content-type", "").startswith("text/event-stream")
        got = collect_stream(raw.parse())
    assert got["roles"].get(0) == "assistant", "no delta carried role=assistant"
    assert set(got["finish"]) == {0} and got["finish"][0] in {"stop", "length"}
    assert len(got["usage_chunks"]) == 1, "include_usage must add exactly one usage chunk"
    final = got["usage_chunks"][0]
    assert final.choices == [], "the usage chunk must have empty choices"
    check_usage(final.usage, 24)

    plain = oai.chat.completions.create(**kwargs)
    assert plain.choices[0].message.content == got["texts"].get(0, ""), "greedy stream and non-stream differ"
    assert plain.choices[0].finish_reason == got["finish"][0]
    assert plain.usage.completion_tokens == final.usage.completion_tokens
    assert plain.usage.prompt_tokens == final.usage.prompt_tokens


def test_chat_stream_without_include_usage_has_no_usage(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, stream=True)
    got = collect_stream(stream)
    assert got["usage_chunks"] == []
    assert got["finish"].get(0) in {"stop", "length"}


def test_n_choices(oai):
    resp = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, n=3, temperature=1.0, seed=5)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    for c in resp.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert c.finish_reason in {"stop", "length"}
    check_usage(resp.usage, 3 * 8)

    stream = oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, n=2, stream=True, stream_options={"include_usage": True}
    )
    got = collect_stream(stream)
    assert set(got["finish"]) == {0, 1}
    assert len(got["usage_chunks"]) == 1


def test_stop_sequence_truncates_before_the_stop(oai):
    base = dict(model=MODEL, messages=echo_history(), max_tokens=80, temperature=LOW_TEMPERATURE, seed=12)
    full = oai.chat.completions.create(**base).choices[0].message.content
    stop, expected = stop_string(full)
    resp = oai.chat.completions.create(stop=[stop, "\u2603never\u2603"], **base)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == expected, (stop, full)

    stream = oai.chat.completions.create(stream=True, stop=stop, **base)
    got = collect_stream(stream)
    assert got["finish"][0] == "stop"
    assert got["texts"].get(0, "") == expected


def test_same_seed_same_output(oai):
    kwargs = dict(model=MODEL, messages=USER, max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    a = oai.chat.completions.create(**kwargs)
    b = oai.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == b.usage.completion_tokens


def test_sampling_parameters_are_accepted(oai):
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=7,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert resp.choices[0].finish_reason in {"stop", "length"}
    check_usage(resp.usage, 8)


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"temperature": 2.5},
        {"top_p": 2},
        {"n": 0},
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"max_completion_tokens": 0},
        {"presence_penalty": 3},
        {"frequency_penalty": -3},
        {"messages": []},
    ],
    ids=lambda d: next(iter(d.items())).__repr__(),
)
def test_invalid_parameters_are_400(oai, bad):
    kwargs = dict(model=MODEL, messages=USER, max_tokens=8)
    kwargs.update(bad)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**kwargs)
    assert_openai_error(info.value, 400, "invalid_request_error")
    assert info.value.response.headers.get("x-request-id"), "error response lacks x-request-id"


def test_invalid_parameters_with_stream_fail_before_the_stream(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=-1, stream=True)
    assert_openai_error(info.value, 400, "invalid_request_error")


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="no-such-model", messages=USER, max_tokens=4)
    assert_openai_error(info.value, 404)


def test_malformed_json_body_is_400(base_url):
    resp = http(base_url, "POST", "/v1/chat/completions", b'{"model": "flare-sim", "messages": [', "application/json")
    assert resp.status == 400, resp.body[:300]
    err = resp.json()["error"]
    assert err["type"] and err["code"] and isinstance(err["message"], str)


def test_huge_prompt_is_400(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello " * 60_000}], max_tokens=4
        )
    assert_openai_error(info.value, 400, "invalid_request_error")


def test_overload_answers_are_typed_503(oai):
    """A burst of concurrent streams: each one either streams to completion or is refused with a
    typed 503 before any SSE header; nothing else (500s, broken streams) is acceptable."""

    def one(i: int) -> str:
        try:
            stream = oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Burst {i}: tell me a story."}],
                max_tokens=200,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        except openai.APIStatusError as e:
            assert_openai_error(e, 503)
            return "refused"
        got = collect_stream(stream)
        assert got["finish"].get(0) == "length", got["finish"]
        return "done"

    with ThreadPoolExecutor(max_workers=64) as pool:
        outcomes = list(pool.map(one, range(64)))
    assert outcomes.count("done") > 0, outcomes


# --- tools ----------------------------------------------------------------------------------------


def check_tool_calls(message, finish_reason, allowed=TOOL_NAMES) -> list[Any]:
    calls = message.tool_calls or []
    assert calls, f"no tool call (finish_reason {finish_reason}, content {message.content!r})"
    assert finish_reason == "tool_calls"
    for call in calls:
        assert isinstance(call.id, str) and call.id
        assert call.type == "function"
        assert call.function.name in allowed, call.function.name
        args = json.loads(call.function.arguments)
        assert isinstance(args, dict)
    assert len({c.id for c in calls}) == len(calls), "tool call ids repeat"
    return calls


def test_tool_choice_auto_repeats_the_earlier_call(oai):
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=tool_history(),
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="auto",
        max_tokens=64,
        temperature=LOW_TEMPERATURE,
    )
    calls = check_tool_calls(resp.choices[0].message, resp.choices[0].finish_reason)
    assert calls[0].function.name == "get_weather"


def test_tool_choice_required(oai):
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=tool_history(),
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        max_tokens=64,
        temperature=LOW_TEMPERATURE,
    )
    check_tool_calls(resp.choices[0].message, resp.choices[0].finish_reason)


def test_tool_choice_required_is_enforced_while_sampling(oai):
    """Without a history to copy, `required` and a named tool still produce a well-formed call
    to an offered tool (the grammar allows nothing else), never an error or plain text. The
    cities are an enum: the simulated model would write a free string until the output limit."""

    def bounded(tool: dict[str, Any]) -> dict[str, Any]:
        f = json.loads(json.dumps(tool["function"]))
        f["parameters"]["properties"]["city"]["enum"] = ["Paris", "Lisbon", "Oslo"]
        f["parameters"]["additionalProperties"] = False
        return {"type": "function", "function": f}

    for choice, allowed in (
        ("required", TOOL_NAMES),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ):
        for seed in range(3):
            resp = oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a story about a lighthouse."}],
                tools=[bounded(WEATHER_TOOL), bounded(TIME_TOOL)],
                tool_choice=choice,
                max_tokens=200,
                seed=seed,
            )
            check_tool_calls(resp.choices[0].message, resp.choices[0].finish_reason, allowed)


def test_tool_choice_named(oai):
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=tool_history(tool="get_time"),
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=64,
        temperature=LOW_TEMPERATURE,
    )
    calls = check_tool_calls(resp.choices[0].message, resp.choices[0].finish_reason, allowed={"get_time"})
    assert all(c.function.name == "get_time" for c in calls)


def test_tool_choice_none_never_calls(oai):
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=text_history(),
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="none",
        max_tokens=48,
        temperature=LOW_TEMPERATURE,
    )
    choice = resp.choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason in {"stop", "length"}
    assert isinstance(choice.message.content, str)


def test_unknown_named_tool_is_400(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "not_declared"}},
            max_tokens=8,
        )
    assert_openai_error(info.value, 400)


def test_streamed_tool_call_assembles(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=tool_history(),
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        max_tokens=64,
        temperature=LOW_TEMPERATURE,
        stream=True,
        stream_options={"include_usage": True},
    )
    got = collect_stream(stream)
    assert got["finish"].get(0) == "tool_calls"
    calls = got["tool_calls"].get(0)
    assert calls, "no tool_calls deltas in the stream"
    for slot in calls.values():
        assert slot["id"], "streamed tool call has no id"
        assert slot["name"] in TOOL_NAMES
        assert isinstance(json.loads(slot["arguments"]), dict)
    assert len(got["usage_chunks"]) == 1


def test_multi_turn_tool_loop_grows_and_hits_the_cache(oai):
    messages = tool_history()
    messages[0]["content"] += f" Session {nonce()}."
    prompt_tokens, cached = [], []
    for turn in range(4):
        resp = oai.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice="required",
            max_tokens=64,
            temperature=LOW_TEMPERATURE,
        )
        choice = resp.choices[0]
        calls = check_tool_calls(choice.message, choice.finish_reason)
        check_usage(resp.usage)
        prompt_tokens.append(resp.usage.prompt_tokens)
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        messages.append(
            {
                "role": "assistant",
                "content": choice.message.content,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in calls
                ],
            }
        )
        for call in calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": json.dumps({"result": f"turn {turn}", "temp_c": 10 + turn}),
                }
            )
        # Ask again: the copy model answers the way the question was answered last time.
        messages.append({"role": "user", "content": "What is the weather in Paris?"})
    assert all(a < b for a, b in itertools.pairwise(prompt_tokens)), prompt_tokens
    assert all(c > 0 for c in cached[1:]), f"later turns reuse the earlier prefix: cached {cached}"


# --- cached tokens ----------------------------------------------------------------------------------


def test_repeated_conversation_reports_cached_tokens(oai):
    system = f"Session {nonce()}. " + " ".join(
        f"Note {i}: the harbour light turns every {i % 7 + 2} seconds." for i in range(40)
    )
    conv = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the notes."}]
    first = oai.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, temperature=LOW_TEMPERATURE)
    second = oai.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, temperature=LOW_TEMPERATURE)
    check_usage(first.usage)
    check_usage(second.usage)
    c1 = first.usage.prompt_tokens_details.cached_tokens
    c2 = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    assert c2 > c1, f"repeat must hit the cache: first {c1}, second {c2}"
    assert c2 >= second.usage.prompt_tokens // 2, f"most of a {second.usage.prompt_tokens}-token prompt: {c2}"

    longer = [
        *conv,
        {"role": "assistant", "content": second.choices[0].message.content or "ok"},
        {"role": "user", "content": "And now in one word?"},
    ]
    third = oai.chat.completions.create(model=MODEL, messages=longer, max_tokens=8, temperature=LOW_TEMPERATURE)
    check_usage(third.usage)
    assert third.usage.prompt_tokens > second.usage.prompt_tokens
    assert third.usage.prompt_tokens_details.cached_tokens >= c2


# --- structured output -------------------------------------------------------------------------------


def test_response_format_json_object(oai):
    for seed in range(3):
        resp = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Give the weather in Paris as a JSON object."}],
            response_format={"type": "json_object"},
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        choice = resp.choices[0]
        content = choice.message.content or ""
        assert content.lstrip().startswith("{"), f"constrained output does not start a JSON object: {content!r}"
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(content), dict)


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temp_c": {"type": "integer"}, "sunny": {"type": "boolean"}},
    "required": ["city", "temp_c", "sunny"],
    "additionalProperties": False,
}


def test_response_format_json_schema(oai):
    for seed in range(3):
        resp = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather report for Paris."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
            },
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        choice = resp.choices[0]
        content = choice.message.content or ""
        assert content.lstrip().startswith("{"), content
        if choice.finish_reason == "stop":
            obj = json.loads(content)
            assert set(obj) == {"city", "temp_c", "sunny"}, obj
            assert isinstance(obj["city"], str)
            assert isinstance(obj["temp_c"], int) and not isinstance(obj["temp_c"], bool)
            assert isinstance(obj["sunny"], bool)


def test_invalid_response_format_is_400(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=8, response_format={"type": "json_schema", "json_schema": {}}
        )
    assert_openai_error(info.value, 400)


# --- completions and responses ------------------------------------------------------------------------


def test_completions_endpoint(oai):
    raw = oai.completions.with_raw_response.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert raw.headers.get("x-request-id")
    resp = raw.parse()
    assert resp.object == "text_completion"
    assert resp.model == MODEL
    assert isinstance(resp.id, str) and resp.id
    assert len(resp.choices) == 1 and resp.choices[0].index == 0
    assert isinstance(resp.choices[0].text, str)
    assert resp.choices[0].finish_reason in {"stop", "length"}
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert 0 < resp.usage.completion_tokens <= 8

    stream = oai.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        temperature=LOW_TEMPERATURE,
        seed=13,
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert finish in {"stop", "length"}
    assert usage is not None and usage.completion_tokens <= 8
    greedy = oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=LOW_TEMPERATURE, seed=13
    )
    assert greedy.choices[0].text == text


def test_responses_non_stream(oai):
    raw = oai.responses.with_raw_response.create(model=MODEL, input="Say hello to the harbour.", max_output_tokens=16)
    assert raw.headers.get("x-request-id")
    resp = raw.parse()
    assert isinstance(resp.id, str) and resp.id
    assert resp.object == "response"
    assert resp.model == MODEL
    assert resp.status in {"completed", "incomplete"}
    messages = [item for item in resp.output if item.type == "message"]
    assert messages, resp.output
    parts = [p for p in messages[0].content if p.type == "output_text"]
    assert parts and all(isinstance(p.text, str) for p in parts)
    assert resp.output_text == "".join(p.text for m in messages for p in m.content if p.type == "output_text")
    assert resp.usage.input_tokens > 0
    assert 0 < resp.usage.output_tokens <= 16
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_responses_stream_events(oai):
    stream = oai.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Say hello to the harbour."}],
        instructions="Be brief.",
        max_output_tokens=16,
        stream=True,
    )
    events = list(stream)
    types = [e.type for e in events]
    assert types[0] == "response.created", types
    assert types[-1] in {"response.completed", "response.incomplete"}, types
    assert types.count(types[-1]) == 1
    seqs = [getattr(e, "sequence_number", None) for e in events]
    numbered = [s for s in seqs if s is not None]
    if len(numbered) == len(seqs):
        assert numbered == sorted(numbered) and len(set(numbered)) == len(numbered), seqs
    delta_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.id == events[0].response.id
    assert final.output_text == delta_text
    assert final.usage is not None and final.usage.output_tokens > 0


def responses_tool_history() -> list[dict[str, Any]]:
    """`tool_history()` as Responses input items: the assistant called get_weather before, so
    the copy model calls it again."""
    question = "What is the weather in Paris?"
    return [
        {"role": "system", "content": "You are a weather assistant. Always use the tools."},
        {"role": "user", "content": question},
        {"type": "function_call", "call_id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_0", "output": '{"city": "Paris", "value": 18}'},
        {"role": "assistant", "content": "It is 18 degrees in Paris."},
        {"role": "user", "content": question},
    ]


def test_responses_stream_items_match_the_final_output(oai):
    """Whatever the model writes (reasoning, text, calls), the streamed items carry the indexes
    and ids the final response lists them under, and each item's done event holds its final
    text or arguments."""
    function: dict[str, Any] = dict(WEATHER_TOOL["function"])  # type: ignore[arg-type]
    tool = {"type": "function", **function}
    calls_seen = False
    for prompt in (responses_tool_history(), "Say hello to the harbour."):
        stream = oai.responses.create(
            model=MODEL, input=prompt, tools=[tool], max_output_tokens=96, temperature=LOW_TEMPERATURE, stream=True
        )
        events = list(stream)
        assert events[-1].type in {"response.completed", "response.incomplete"}, events[-1]
        final = events[-1].response
        added = [(e.output_index, e.item.id, e.item.type) for e in events if e.type == "response.output_item.added"]
        done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
        listed = [(i, item.id, item.type) for i, item in enumerate(final.output)]
        assert added == listed, (added, listed)
        assert sorted(done) == [i for i, _, _ in listed], sorted(done)
        for i, item in enumerate(final.output):
            assert done[i].model_dump() == item.model_dump(), i
        texts = {e.output_index: e.text for e in events if e.type == "response.output_text.done"}
        args = {e.output_index: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
        for i, item in enumerate(final.output):
            if item.type == "message":
                assert texts[i] == "".join(p.text for p in item.content), i
            if item.type == "function_call":
                assert args[i] == item.arguments, i
                calls_seen = True
    assert calls_seen, "the copy model repeated no call"


# --- cancellation -----------------------------------------------------------------------------------


def test_closing_a_stream_cancels_it(oai, base_url):
    wait_until_idle(base_url, timeout=10)
    stream = oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    seen = 0
    for chunk in stream:
        if any(c.delta.content for c in chunk.choices):
            seen += 1
        if seen >= 3:
            break
    stream.close()
    assert seen == 3
    t0 = time.monotonic()
    wait_until_idle(base_url, timeout=5)
    assert time.monotonic() - t0 < 5
    # The server still answers normally.
    resp = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert resp.choices[0].finish_reason in {"stop", "length"}
    health = http(base_url, "GET", "/health")
    assert health.status == 200
