"""The rendered operator and agents take the origin credentials Secret as their env."""

from __future__ import annotations

from preheat.runtime.kubernetes.render import ORIGIN_CREDENTIALS_SECRET, system_manifests


def test_operator_and_agent_take_every_key_of_the_optional_origin_secret() -> None:
    """Both the operator Deployment and the agent DaemonSet have envFrom the optional
    preheat-origin-credentials Secret (HF_TOKEN, HF_ENDPOINT, AWS_*), so a private hf://
    or s3:// source resolves and warms without editing the rendered objects."""
    want = [{"secretRef": {"name": ORIGIN_CREDENTIALS_SECRET, "optional": True}}]
    found = {}
    for m in system_manifests():
        if m["kind"] in {"Deployment", "DaemonSet"} and m["metadata"]["name"] in {
            "preheat-operator",
            "preheat-agent",
        }:
            (c,) = m["spec"]["template"]["spec"]["containers"]
            found[m["metadata"]["name"]] = c.get("envFrom")
    assert found == {"preheat-operator": want, "preheat-agent": want}
    assert ORIGIN_CREDENTIALS_SECRET == "preheat-origin-credentials"
