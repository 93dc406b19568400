"""`preheat router serve --kubernetes` with `--front aiohttp` and `--kv-events-options`, on
the real v1.20.2 control plane: the server asked for is the one listening, and the
endpoint-wide hash options reach each discovered instance's KV-event setting."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from preheat.runtime.kubernetes.api_client import discovery_version
from preheat.runtime.kubernetes.discovery_slices import variant_service_name
from preheat.runtime.kubernetes.render import endpoint_manifests
from preheat.runtime.kubernetes.resources import load_endpoint_file
from preheat.runtime.procs import start_process
from preheat.testing.kube import KubeCluster
from preheat.testing.kubespace import kube_share
from preheat.testing.procs import free_port
from tests.integration.test_router_faults import RawEngine

pytestmark = pytest.mark.kubernetes

NS = "k8s-rfront"

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "router-front-admin-token"


async def _answer(body: bytes, writer: Any) -> None:
    out = b'{"choices": [{"text": "ok"}]}'
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
    writer.write(b"Content-Length: %d\r\n\r\n%b" % (len(out), out))
    await writer.drain()


def _config(url: str) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/admin/config", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        doc: dict[str, Any] = json.loads(r.read())
    return doc


def test_kubernetes_mode_serves_with_the_front_asked_for_and_the_kv_options(
    kube_session: KubeCluster, tmp_path: Path
) -> None:
    """With --front aiohttp the router in Kubernetes mode listens with aiohttp (a request
    with a bad Content-Length gets aiohttp's plain-text 400, not the raw front's JSON),
    routes a completion to the instance of the variant's EndpointSlice, and shows that
    instance's KV-event publisher with the --kv-events-options merged in."""
    with (
        kube_share(kube_session, namespaces=[NS]) as kube,
        RawEngine(_answer) as engine,
    ):
        spec, pod = load_endpoint_file(ROOT / "examples" / "endpoint.yaml")
        (ie,) = [
            o
            for o in endpoint_manifests(spec, namespace=NS, pod=pod)
            if o["kind"] == "InferenceEndpoint"
        ]
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(ie))
        from kubernetes import config

        with config.new_client_from_config(config_file=str(kube.kubeconfig)) as api:
            version = discovery_version(api)
        kube.rest().must(
            "POST",
            f"/apis/discovery.k8s.io/{version}/namespaces/{NS}/endpointslices",
            {
                "apiVersion": f"discovery.k8s.io/{version}",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": "chat-main-test",
                    "labels": {"kubernetes.io/service-name": variant_service_name("chat", "main")},
                },
                "addressType": "IPv4",
                "ports": [
                    {"name": "http", "port": engine.port, "protocol": "TCP"},
                    {"name": "kv-events", "port": free_port(), "protocol": "TCP"},
                ],
                "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
            },
        )
        port = free_port()
        log = tmp_path / "router.log"
        env = {**os.environ, "PREHEAT_ADMIN_TOKEN": TOKEN, "PREHEAT_ROUTER_SALT": "s" * 20}
        proc = start_process(
            [
                str(Path(sys.executable).parent / "preheat"), "router", "serve", "--kubernetes",
                "--endpoint", "chat", "--namespace", NS,
                "--kubeconfig", str(kube.kubeconfig), "--port", str(port),
                "--front", "aiohttp", "--kv-events-options", "hash=sha256_cbor&hash_seed=0",
            ],
            log,
            env=env,
            inherit_env=False,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                assert proc.running, log.read_text()
                try:
                    (main,) = _config(url)["variants"]
                    if main["instances"]:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            (inst,) = main["instances"]
            assert inst["url"] == engine.url
            assert inst["kv_events"].endswith("?hash=sha256_cbor&hash_seed=0"), inst
            assert "(front aiohttp)" in log.read_text()
            body = json.dumps({"model": "chat", "prompt": "hello"}).encode()
            req = urllib.request.Request(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.headers["X-Preheat-Instance"] == engine.url
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: x\r\n\r\n")
                answer = s.recv(65536)
            assert answer.split(b" ", 2)[1] == b"400" and b'"error"' not in answer, answer
        finally:
            proc.stop()
