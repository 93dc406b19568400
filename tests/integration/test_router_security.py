"""Router security and bad input, against real processes: the admin token, prompt text
never in logs, metrics or the decision log, and fuzzed request bodies (hypothesis)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preheat.testing.engines import simulated_engines
from preheat.testing.routers import start_fast_backend, start_router

from .test_router_faults import TOKEN, get_text, post, router_for, rss_kb

ADMIN_ROUTES = (
    ("GET", "/admin/config"),
    ("PUT", "/admin/config"),
    ("POST", "/admin/instances/add"),
    ("POST", "/admin/instances/remove"),
    ("POST", "/admin/instances/drain"),
    ("PATCH", "/admin/variants/default"),
)


def _call(url: str, method: str, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=b"{}", method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code


def test_the_admin_api_refuses_without_a_token_and_with_a_wrong_one(tmp_path: Path) -> None:
    """Every admin route answers 401 without a token, with a wrong one or a non-Bearer
    scheme; a router started without a token answers 403 to everyone."""
    with start_fast_backend() as backend:
        with router_for(tmp_path, [backend.url]) as r:
            for method, path in ADMIN_ROUTES:
                for headers in (
                    {},
                    {"Authorization": "Bearer wrong-token"},
                    {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": f"Bearer {TOKEN}x"},
                ):
                    assert _call(r.url + path, method, headers) == 401, (method, path, headers)
            ok = {"Authorization": f"Bearer {TOKEN}"}
            assert _call(r.url + "/admin/config", "GET", ok) == 200
        with start_router(backends=[backend.url]) as open_router:
            for method, path in ADMIN_ROUTES:
                assert _call(open_router.url + path, method, {"Authorization": "Bearer x"}) == 403


def test_no_prompt_text_in_logs_metrics_or_the_decision_log(tmp_path: Path) -> None:
    """A unique marker sent in prompts and chat messages on every path (answered, streamed,
    engine error, engine dying mid-stream, timeout, bad JSON, too large) appears in none of
    the router's log (at DEBUG), /metrics or decision log."""
    marker = "ZQX-PROMPT-MARKER-7781"
    text = f"{marker} " * 300
    decisions = tmp_path / "decisions.jsonl"
    with (
        start_fast_backend() as backend,
        router_for(
            tmp_path,
            [backend.url],
            decision_log=decisions,
            upstream_timeout_s=0.5,
            max_body_bytes=65536,
            variant={"strategy": "prefix_aware"},
        ) as r,
    ):
        url = r.url + "/v1/completions"
        chat = r.url + "/v1/chat/completions"
        statuses = [
            post(url, {"prompt": text})[0],
            post(url, {"prompt": text, "stream": True})[0],
            post(chat, {"messages": [{"role": "user", "content": text}]})[0],
            post(url, {"prompt": text, "preheat_test": {"status": 500}})[0],
            post(url, {"prompt": text, "preheat_test": {"hang_s": 2}})[0],
            post(url, f'{{"prompt": "{marker}'.encode())[0],
            post(url, {"prompt": text * 30})[0],
            # last: an instance that dies mid-stream is marked down
            post(url, {"prompt": text, "stream": True, "preheat_test": {"die_after": 1}})[0],
        ]
        assert statuses == [200, 200, 200, 500, 504, 400, 413, 200]
        metrics = get_text(r.url + "/metrics")
        config = json.dumps(r.admin("GET", "/admin/config"))
    rows = decisions.read_text()
    assert len(rows.splitlines()) >= 5
    log = (tmp_path / "router.log").read_text()
    for where, content in (("log", log), ("metrics", metrics), ("decisions", rows)):
        assert marker not in content, where
        assert marker.lower() not in content.lower(), where
    assert marker not in config


def _json_values() -> st.SearchStrategy[Any]:
    leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


MARK = "FUZZ-MARKER-5521"
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | _json_values()},
    optional={
        "content": st.text().map(lambda t: MARK + t) | _json_values(),
        "name": _json_values(),
    },
)
_bodies = st.one_of(
    st.binary(max_size=200),
    _json_values().map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {},
        optional={
            "prompt": st.text().map(lambda t: MARK + t) | _json_values(),
            "messages": st.lists(_message, max_size=4) | _json_values(),
            "stream": st.booleans() | _json_values(),
            "max_tokens": st.integers(min_value=-5, max_value=40) | _json_values(),
            "model": st.just("preheat/tiny") | _json_values(),
        },
    ).map(lambda d: json.dumps(d).encode()),
)


def test_fuzzed_request_bodies_never_crash_500_or_leak(tmp_path: Path) -> None:
    """200 fuzzed bodies (bytes, any JSON, OpenAI-shaped objects with wrong types) on both
    endpoints of a prefix_aware router over a simulated engine: never a 5xx, the router
    stays up, its RSS stays within 30 MB, and no prompt text reaches its log."""
    with (
        simulated_engines(1, profile="tiny", time_scale=0.0) as engines,
        router_for(
            tmp_path, [engines[0].url], variant={"strategy": "prefix_aware", "prefix_length": 1024}
        ) as r,
    ):
        rss0 = rss_kb(r.pid)
        seen: list[int] = []

        @settings(
            max_examples=200,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(body=_bodies, chat=st.booleans())
        def one(body: bytes, chat: bool) -> None:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            status, _, answer = post(r.url + path, body, timeout=30)
            seen.append(status)
            assert status < 500, (status, body[:200], answer[:300])

        one()
        assert get_text(r.url + "/health")
        grown_mb = (rss_kb(r.pid) - rss0) / 1024
    assert len(seen) >= 200 and 400 in seen and 200 in seen
    assert grown_mb < 30, grown_mb
    assert MARK not in (tmp_path / "router.log").read_text()
