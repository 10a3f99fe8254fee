"""The real `openai` and `anthropic` SDKs against a server started with an API key (the
`keyed_url` fixture): the key as each SDK sends it, wrong keys, open routes and model aliases."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from conftest import ALIAS, API_KEY, assert_openai_error, http

# Sent through both SDKs, whose message types differ: a plain JSON-shaped list.
USER: list[Any] = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]
MODEL = "flare-sim"


def oai_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def claude_client(url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def test_openai_sdk_with_the_key(keyed_url):
    oai = oai_client(keyed_url, API_KEY)
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    # An alias retrieves the same model, under its first name.
    assert oai.models.retrieve(ALIAS).id == MODEL
    chat = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert chat.model == MODEL and chat.usage is not None and chat.usage.prompt_tokens > 0
    completion = oai.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=4)
    assert completion.model == MODEL


def test_openai_sdk_with_a_wrong_or_no_key_is_401(keyed_url):
    with pytest.raises(openai.AuthenticationError) as info:
        oai_client(keyed_url, "sk-wrong").chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert assert_openai_error(info.value, 401, "invalid_request_error")["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as info:
        oai_client(keyed_url, "sk-wrong").models.retrieve(MODEL)
    assert_openai_error(info.value, 401)
    resp = http(keyed_url, "GET", "/v1/models")
    assert resp.status == 401 and resp.json()["error"]["code"] == "missing_api_key", resp.body[:300]


def test_anthropic_sdk_with_the_key(keyed_url):
    claude = claude_client(keyed_url, API_KEY)
    msg = claude.messages.create(model=ALIAS, max_tokens=4, messages=USER)
    assert msg.model == MODEL
    counted = claude.messages.count_tokens(model=MODEL, messages=USER)
    assert counted.input_tokens == msg.usage.input_tokens
    # Bearer auth (`auth_token`) works as well as `x-api-key`.
    bearer = anthropic.Anthropic(base_url=keyed_url, auth_token=API_KEY, max_retries=0, timeout=120)
    assert bearer.messages.count_tokens(model=MODEL, messages=USER).input_tokens == counted.input_tokens


def test_anthropic_sdk_with_a_wrong_key_is_401_in_its_envelope(keyed_url):
    claude = claude_client(keyed_url, "wrong-key")
    for call in (
        lambda: claude.messages.create(model=MODEL, max_tokens=4, messages=USER),
        lambda: claude.messages.count_tokens(model=MODEL, messages=USER),
    ):
        with pytest.raises(anthropic.AuthenticationError) as info:
            call()
        body = info.value.response.json()
        assert body["type"] == "error", body
        assert body["error"]["type"] == "authentication_error", body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def test_health_and_metrics_need_no_key(keyed_url):
    assert http(keyed_url, "GET", "/health").status == 200
    resp = http(keyed_url, "GET", "/metrics")
    assert resp.status == 200
    assert f'model_name="{MODEL}"' in resp.body.decode()
