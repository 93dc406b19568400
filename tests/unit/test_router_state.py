"""The router's routing state (variants, instances, config changes) without HTTP."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from preheat.errors import ConfigError
from preheat.router.config import parse_config
from preheat.router.state import RoutingState

SALT = b"0123456789abcdef-test-salt"
A, B, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


def _state(**variant: object) -> RoutingState:
    cfg = parse_config({"variants": [{"name": "chat", "instances": [A, B], **variant}]})
    return RoutingState(cfg, salt=SALT, rng=random.Random(0))


def test_the_state_module_imports_no_http_stack() -> None:
    """Importing the routing state loads neither aiohttp nor asyncio's event loop machinery."""
    code = (
        "import sys, preheat.router.state\n"
        "bad = sorted(m for m in ('aiohttp', 'preheat.router.upstream') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_a_config_change_keeps_instances_and_the_learned_policy() -> None:
    """Instances that stay keep state and in-flight count; a same-shape change keeps the policy."""
    s = _state(strategy="prefix_aware", concurrency_threshold=8)
    a = s.find(A)
    assert a is not None
    a.in_flight = 3
    s.set_state(a, "draining")
    policy = s.variants["chat"].policy
    new = s.config.to_dict()
    new["variants"][0]["instances"] = [A, C]
    new["variants"][0]["concurrency_threshold"] = 4
    s.replace_config(parse_config(new))
    rt = s.variants["chat"]
    assert rt.policy is policy and policy.params.concurrency_threshold == 4  # type: ignore[attr-defined]
    assert s.find(A) is a and a.in_flight == 3 and a.state == "draining"
    assert s.find(B) is None
    assert [u.id for u in rt.live] == [C]
    new["variants"][0]["prefix_length"] = 4096
    s.replace_config(parse_config(new))
    assert s.variants["chat"].policy is not policy


def test_states_and_variant_choice() -> None:
    """Only healthy instances are live; an unknown variant name is a ConfigError naming it."""
    s = _state()
    b = s.find(B)
    assert b is not None
    s.set_state(b, "unhealthy")
    assert [u.id for u in s.variants["chat"].live] == [A]
    with pytest.raises(ConfigError, match="sleeping"):
        s.set_state(b, "sleeping")
    assert s.variant_for(None).config.name == "chat"
    with pytest.raises(ConfigError, match="'nope' is unknown"):
        s.variant_for("nope")
    snap = s.snapshot()
    assert snap["variants"][0]["instances"] == [
        {"url": A, "state": "healthy", "in_flight": 0},
        {"url": B, "state": "unhealthy", "in_flight": 0},
    ]


@pytest.mark.parametrize("path", ["health", "@evil/x", "//other/x", "/a b", "/h?x=1", 7])
def test_a_health_path_that_would_leave_the_instance_is_refused(path: object) -> None:
    """health.path is appended to instance URLs, so only a plain absolute path is accepted."""
    with pytest.raises(ConfigError, match=r"health\.path"):
        parse_config({"variants": [{"name": "v"}], "health": {"path": path}})


def test_restart_only_fields_are_refused_and_the_config_stays() -> None:
    """A new max_body_bytes is refused by name; timeouts in the same document are not applied."""
    s = _state()
    new = s.config.to_dict()
    new["max_body_bytes"] = 4096
    new["upstream_timeout_s"] = 1.0
    with pytest.raises(ConfigError, match=r"max_body_bytes 8388608 -> 4096.*restart"):
        s.replace_config(parse_config(new))
    assert s.config.max_body_bytes == 8388608 and s.config.upstream_timeout_s == 300


def test_defaults_and_bounds_come_from_policy_params_and_the_dataclasses() -> None:
    """An empty variant gets exactly PolicyParams(); every PolicyParams field round-trips
    through to_dict, and PolicyParams' own bound is the one the config enforces."""
    from dataclasses import fields

    from preheat.router.config import HealthConfig, RouterConfig
    from preheat.router.policies import PolicyParams

    cfg = parse_config({"variants": [{"name": "v"}]})
    assert cfg.variants[0].params == PolicyParams()
    assert cfg.health == HealthConfig()
    assert cfg.upstream_timeout_s == RouterConfig(variants=()).upstream_timeout_s
    doc = cfg.to_dict()["variants"][0]
    assert {f.name for f in fields(PolicyParams)} <= set(doc)
    assert parse_config(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="concurrency_threshold 2000 is outside 1-1024"):
        parse_config({"variants": [{"name": "v", "concurrency_threshold": 2000}]})
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_config({"variants": [{"name": "v", "block_chars": 2048.5}]})
