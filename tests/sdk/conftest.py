"""Shared fixtures for the SDK compatibility tests.

The tests drive a running Flare server (normally `flare run --sim`, started by
scripts/ci-sdk-tests) whose root URL is in $FLARE_URL. They use the real `openai` and
`anthropic` SDKs and assert protocol properties: shapes, types, finish reasons, ids, usage
consistency, cached tokens, errors and cancellation. Generated text is never compared with a
fixed string; where a test needs a specific continuation it relies on the simulated model being
an induction/copy model (it continues a context the way that context continued earlier in the
prompt) and on determinism of greedy decoding.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

MODEL = os.environ.get("FLARE_MODEL", "flare-sim")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_NAMES = {"get_weather", "get_time"}


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("FLARE_URL"):
        raise pytest.UsageError(
            "FLARE_URL is not set: start `flare run --sim` and export FLARE_URL=http://127.0.0.1:PORT "
            "(scripts/ci-sdk-tests does both)"
        )


@pytest.fixture(scope="session")
def base_url() -> str:
    return os.environ["FLARE_URL"].rstrip("/")


@pytest.fixture(scope="session")
def oai(base_url: str) -> openai.OpenAI:
    # No retries: a retried 5xx would hide exactly the errors these tests look for.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-flare-test", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="flare-test", max_retries=0, timeout=120)


# The key and the extra served name of the keyed server (`keyed_url`).
API_KEY = "sk-flare-sdk-" + uuid.uuid4().hex
ALIAS = "flare-sim-alias"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def flare_binary() -> str:
    """$FLARE_BIN (as scripts/ci-sdk-tests and CI set it), else target/debug/flare."""
    given = os.environ.get("FLARE_BIN")
    for path in [given, os.path.join(ROOT, given)] if given else [os.path.join(ROOT, "target/debug/flare")]:
        if os.access(path, os.X_OK):
            return os.path.abspath(path)
    if given:
        pytest.fail(f"FLARE_BIN={given} is not an executable")
    pytest.skip("no flare binary to start a keyed server (set FLARE_BIN or build target/debug/flare)")


@pytest.fixture(scope="session")
def keyed_url() -> Iterator[str]:
    """A second server, started here: the embedded simulated core behind an API key (given
    through FLARE_API_KEY) and served as MODEL plus ALIAS."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [flare_binary(), "run", "--sim", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--served-model-name", f"flare-sim,{ALIAS}"]
    with tempfile.NamedTemporaryFile(prefix="flare-sdk-keyed-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            argv, env={**os.environ, "FLARE_API_KEY": API_KEY}, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 60
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    with open(log.name) as f:
                        pytest.fail(f"the keyed flare server did not become healthy; its output:\n{f.read()}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            os.unlink(log.name)


def _healthy(url: str) -> bool:
    try:
        return http(url, "GET", "/health", timeout=2).status == 200
    except OSError:  # not listening yet
        return False


def nonce() -> str:
    """A string no earlier request contained, so its tokens cannot be cached."""
    return uuid.uuid4().hex


class RawResponse:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


def http(
    base_url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    content_type: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60,
) -> RawResponse:
    """A plain HTTP request (no SDK), returning status, lower-cased headers and body."""
    req = urllib.request.Request(base_url + path, data=body, method=method)
    if content_type is not None:
        req.add_header("Content-Type", content_type)
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return RawResponse(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as e:
        return RawResponse(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def post_json(base_url: str, path: str, payload: Any, **kw: Any) -> RawResponse:
    return http(base_url, "POST", path, json.dumps(payload).encode(), "application/json", **kw)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format → {metric name: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name = line[: line.index("{")]
            rest = line[line.rindex("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        value = rest.split()[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def metrics(base_url: str) -> dict[str, float]:
    resp = http(base_url, "GET", "/metrics")
    assert resp.status == 200, f"GET /metrics -> {resp.status}: {resp.body[:300]!r}"
    return parse_metrics(resp.body.decode())


def wait_until_idle(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    """Polls /metrics until flare_running_requests is 0; fails with the last reading otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base_url)
        assert "flare_running_requests" in m, f"/metrics lacks flare_running_requests: {sorted(m)}"
        if m["flare_running_requests"] == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"flare_running_requests still {m['flare_running_requests']} after {timeout} s: {m}")
        time.sleep(0.1)


def assert_openai_error(err: openai.APIStatusError, status: int, error_type: str | None = None) -> dict[str, Any]:
    """The response is `status` with the OpenAI error object {"error": {message, type, param, code}}."""
    assert err.status_code == status, f"expected HTTP {status}, got {err.status_code}: {err.response.text[:300]}"
    body = err.response.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"not an OpenAI error object: {body}"
    e: dict[str, Any] = body["error"]
    for key in ("message", "type", "param", "code"):
        assert key in e, f"error object lacks {key!r}: {body}"
    assert isinstance(e["message"], str) and e["message"], body
    assert isinstance(e["type"], str) and e["type"], body
    assert e["code"] not in (None, ""), body
    if error_type is not None:
        assert e["type"] == error_type, body
    return e


def tool_history(question: str = "What is the weather in Paris?", tool: str = "get_weather") -> list[dict[str, Any]]:
    """A conversation in which the assistant already answered `question` with a call to `tool`,
    got the tool result, replied, and is asked the same question again. A copy model continues
    the new assistant turn the way the earlier one went: with the same tool call."""
    return [
        {"role": "system", "content": "You are a weather assistant. Always use the tools."},
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": tool, "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": json.dumps({"city": "Paris", "value": 18})},
        {"role": "assistant", "content": "It is 18 degrees in Paris."},
        {"role": "user", "content": question},
    ]


def text_history(question: str = "What is the weather in Paris?") -> list[dict[str, Any]]:
    """The assistant answered `question` in plain text before; the question comes again."""
    return [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "It is sunny and 18 degrees in Paris today."},
        {"role": "user", "content": question},
    ]


ECHO_TEXT = (
    "The keeper climbed the spiral stairs at dusk, wound the great brass clockwork, trimmed the wick, "
    "polished every pane of the lantern room, and watched the beam sweep across the dark grey water "
    "until the fishing boats were safely home."
)


def echo_history(text: str = ECHO_TEXT) -> list[dict[str, Any]]:
    """The user asked for `text` to be repeated, the assistant repeated it, and the user asks again.
    A copy model answers with `text` once more: a long, deterministic continuation that ends
    with EOS, without needing `ignore_eos`."""
    ask = f"Repeat after me: {text}"
    return [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": text},
        {"role": "user", "content": ask},
    ]


def stop_string(full: str) -> tuple[str, str]:
    """A 3-character stop string from the middle of `full` (no whitespace at its ends) and the
    text a server must return when it stops there."""
    assert len(full) >= 12, f"need a longer greedy output to place a stop string: {full!r}"
    start = len(full) // 2
    while start < len(full) - 3 and (full[start].isspace() or full[start + 2].isspace()):
        start += 1
    stop = full[start : start + 3]
    return stop, full[: full.index(stop)]
