"""``kv_events_options`` (``--kv-events-options`` and the config key): how every
instance's engine hashes prompts, given once; checked at the edge with errors that name
the bad key or value, applied under each instance's own setting, shown by the admin API
and stable when its document is PUT back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from preheat.cli import main
from preheat.router.config import load_config
from preheat.runtime.procs import free_port
from preheat.testing.routers import launch_router
from tests.integration.test_router_faults import RawEngine

TOKEN = "kv-options-admin-token"


async def _never(body: bytes, writer: object) -> None:
    raise AssertionError("no completion is sent in these tests")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("topic=kv", "unknown key 'topic'; known: tokenizer, hash, hash_seed, block_size"),
        ("replay=tcp://127.0.0.1:5558", "replay is each instance's own"),
        ("silence_s=3", "the silence timeout is kv_events_silence_s"),
        ("hash=sha256_cbor", "hash_seed"),
        ("hash=xxhash&hash_seed=0", "'xxhash' is not supported"),
        ("block_size=0", "block_size '0' must be 1-1024"),
        ("tokenizer=/nowhere", "has no tokenizer.json"),
        ("garbage", "is not key=value pairs"),
    ],
)
def test_bad_kv_events_options_are_refused_naming_the_key(options: str, message: str) -> None:
    """Each bad --kv-events-options is a usage error (exit 2) that names the bad key or
    value and the fix, before anything listens."""
    args = ["router", "serve", "--port", "1", "--backend", "http://127.0.0.1:9"]
    out = CliRunner().invoke(main, [*args, "--kv-events-options", options])
    assert out.exit_code == 2, out.output
    assert "--kv-events-options" in out.output and message in out.output, out.output


def test_the_config_key_is_checked_and_applied_and_not_given_twice(tmp_path: Path) -> None:
    """``kv_events_options:`` in a config file fills every instance's kv_events (its own
    fields win), a bad key is refused naming the file and the key, and the file's and
    the flag's options together are refused; --help documents the flag."""
    cfg = {
        "kv_events_options": {"hash": "sha256_cbor", "hash_seed": 0},
        "variants": [
            {
                "name": "default",
                "strategy": "prefix_aware",
                "instances": [
                    {"url": "http://127.0.0.1:8001", "kv_events": "tcp://127.0.0.1:5557"},
                    {
                        "url": "http://127.0.0.1:8002",
                        "kv_events": {"endpoint": "tcp://127.0.0.1:5558", "hash": "builtin"},
                    },
                ],
            }
        ],
    }
    path = tmp_path / "router.json"
    path.write_text(json.dumps(cfg))
    loaded = load_config(path)
    assert dict(loaded.variants[0].kv_events) == {
        "http://127.0.0.1:8001": "tcp://127.0.0.1:5557?hash=sha256_cbor&hash_seed=0",
        "http://127.0.0.1:8002": "tcp://127.0.0.1:5558?hash=builtin&hash_seed=0",
    }
    assert loaded.to_dict()["kv_events_options"] == {"hash": "sha256_cbor", "hash_seed": "0"}
    runner = CliRunner()
    both = runner.invoke(
        main, ["router", "serve", "--port", "1", "--config", str(path), "--kv-events-options",
               "block_size=32"],
    )  # fmt: skip
    assert both.exit_code == 2 and "not both" in both.output, both.output
    path.write_text(json.dumps({**cfg, "kv_events_options": {"topic": "x"}}))
    bad = runner.invoke(main, ["router", "serve", "--port", "1", "--config", str(path)])
    assert bad.exit_code == 2, bad.output
    assert str(path) in bad.output and "unknown key 'topic'" in bad.output, bad.output
    helped = runner.invoke(main, ["router", "serve", "--help"])
    assert "--kv-events-options" in helped.output and "hash_seed" in helped.output


def test_cli_options_reach_every_instance_and_survive_a_put_back(tmp_path: Path) -> None:
    """A router started with --kv-events for two instances, --kv-events-options and
    --kv-events-silence shows each instance's merged setting (its own block_size kept)
    and the silence in GET /admin/config; PUT of that document changes nothing."""
    p1, p2 = free_port(), free_port()
    with RawEngine(_never) as b1, RawEngine(_never) as b2:
        r = launch_router(
            backends=[b1.url, b2.url],
            strategy="prefix_aware",
            admin_token=TOKEN,
            log_path=tmp_path / "router.log",
            extra_args=[
                "--kv-events", f"{b1.url}=tcp://127.0.0.1:{p1}",
                "--kv-events", f"{b2.url}=tcp://127.0.0.1:{p2}?block_size=32",
                "--kv-events-options", "hash=sha256_cbor&hash_seed=0&block_size=16",
                "--kv-events-silence", "2.5",
            ],
        )  # fmt: skip
        try:
            doc = r.admin("GET", "/admin/config")
            inst = {i["url"]: i for i in doc["variants"][0]["instances"]}
            opts = "hash=sha256_cbor&hash_seed=0"
            assert inst[b1.url]["kv_events"] == f"tcp://127.0.0.1:{p1}?{opts}&block_size=16"
            assert inst[b2.url]["kv_events"] == f"tcp://127.0.0.1:{p2}?{opts}&block_size=32"
            assert doc["kv_events_options"] == {
                "hash": "sha256_cbor",
                "hash_seed": "0",
                "block_size": "16",
            }
            assert doc["kv_events_silence_s"] == 2.5
            put = {k: v for k, v in doc.items() if k != "variants"}
            put["variants"] = [
                {**v, "instances": [{"url": i["url"], "kv_events": i["kv_events"]}
                                    for i in v["instances"]]}
                for v in doc["variants"]
            ]  # fmt: skip
            r.admin("PUT", "/admin/config", put)
            again = r.admin("GET", "/admin/config")
            assert {i["url"]: i["kv_events"] for i in again["variants"][0]["instances"]} == {
                u: i["kv_events"] for u, i in inst.items()
            }
        finally:
            r.stop()
