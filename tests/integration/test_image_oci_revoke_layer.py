"""Revoking a tar layer's digest removes the `oci://` snapshots unpacked from it (real
registry, real store, the CLI and the node agent's cluster-list apply)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from click.testing import CliRunner

from preheat.cli import main
from preheat.errors import Revoked
from preheat.runtime.kubernetes.revocations import AgentRevocations
from preheat.store.store import NodeStore
from preheat.testing.registry import ModelLayer, registry, tar_layer

WEIGHT = "application/vnd.cncf.model.weight.v1.tar+gzip"
CONFIG = "application/vnd.cncf.model.weight.config.v1.tar"


def test_a_revoked_tar_layer_removes_the_snapshots_built_from_it(tmp_path: Path) -> None:
    """`preheat image revoke LAYER` removes every unheld snapshot unpacked from the layer
    (two revisions share it), keeps a held one until its holder lets go (then the agent's
    next apply removes it), leaves a model without the layer alone, and refuses a new
    pull that needs the layer with "revoked"."""
    bad = tar_layer([("w.safetensors", b"w" * 50_000)], "gzip")
    good = tar_layer([("w.safetensors", b"g" * 50_000)], "gzip")
    digest = "sha256:" + hashlib.sha256(bad).hexdigest()
    with registry(tmp_path / "reg") as reg:
        for tag, weights, n in (("v1", bad, 1), ("v2", bad, 2), ("v3", good, 3)):
            cfg = tar_layer([("config.json", b'{"n": %d}' % n)])
            reg.push_model_layers(
                f"models/m:{tag}", [ModelLayer(WEIGHT, weights), ModelLayer(CONFIG, cfg)]
            )
        store = NodeStore(tmp_path / "store")
        v1, v2, v3 = (store.pull(f"oci://{reg.ref(f'models/m:{t}')}") for t in ("v1", "v2", "v3"))
        store.lease(v2.manifest_digest, "replica-7")
        out = CliRunner().invoke(
            main, ["image", "revoke", digest, "--store", str(store.root), "--reason", "CVE-0001"]
        )
        assert out.exit_code == 0, out.output
        assert not store.has(v1.revision)
        assert store.has(v2.revision) and store.has(v3.revision)  # held; no such layer
        assert v3.snapshot.is_dir() and not v1.snapshot.exists()
        agent = AgentRevocations(store, store.root)
        agent.sync({digest: "CVE-0001"})
        assert store.has(v2.revision)  # still held
        store.release(v2.manifest_digest, "replica-7")
        agent.sync({digest: "CVE-0001"})  # the next pass: the held copy goes now
        assert not store.has(v2.revision) and store.has(v3.revision)
        fresh = NodeStore(tmp_path / "store")
        try:
            fresh.pull(f"oci://{reg.ref('models/m:v1')}")
        except Revoked as exc:
            assert "revoked" in str(exc) and digest in str(exc)
        else:
            raise AssertionError("a pull of a model with the revoked layer was not refused")
