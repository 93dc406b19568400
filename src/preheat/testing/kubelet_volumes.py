"""The kubelet stand-in's volumes (``preheat.testing.kubelet``): what each volume of a pod
is on this machine, and the credentials a pod's ServiceAccount gives its containers.

Volumes map to directories (the pods' processes share one filesystem, so nothing is
mounted; each container's ``mountPath`` is replaced by the directory wherever it appears
in its command, args, env values and ``workingDir``):

- ``hostPath`` ``/x/y`` -> ``<node dir>/x/y`` (two nodes have separate "disks");
- ``emptyDir`` -> a per-pod directory;
- ``secret`` / ``configMap`` -> files written from the API: every key, or the ``items``
  (``key`` -> ``path``) named; with ``optional: true`` a missing object (404) is an empty
  directory, as the kubelet makes it; without, the pod does not start;
- ``projected`` -> the files of its ``serviceAccountToken`` (a token from the TokenRequest
  API, ``audience`` and ``expirationSeconds`` honoured, bound to the pod), ``secret``,
  ``configMap`` and ``downwardAPI`` (``metadata.name``/``namespace``/``uid``) sources.

An env var's ``valueFrom.secretKeyRef`` / ``configMapKeyRef`` is read from the API the
same way (``env_value``): a missing object or key leaves the variable unset when the ref
says ``optional: true``, and otherwise keeps the container from starting.

**ServiceAccount credentials.** v1.20's ServiceAccount admission gives every pod a
``secret`` volume with its ServiceAccount's token Secret (``token``, ``ca.crt``,
``namespace``) mounted at ``/var/run/secrets/kubernetes.io/serviceaccount``; a pod that
asks for a ``projected`` token there gets that. A real process reads that fixed path,
which cannot differ per pod on one shared filesystem, so for a container that mounts it
the stand-in writes a kubeconfig from the volume's ``token`` and ``ca.crt`` (the API
server's real address: there is no kube-proxy to reach the ``kubernetes`` Service) and
sets ``KUBECONFIG`` to it, with ``KUBERNETES_SERVICE_HOST``/``PORT`` as the kubelet sets
them. A ``KUBECONFIG`` in the container's own ``env`` still wins.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from preheat.testing.kube import Rest, write_kubeconfig

__all__ = ["SA_MOUNT", "PodConfigError", "pod_volumes", "service_account_env"]

#: Where Kubernetes mounts a pod's ServiceAccount credentials.
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class PodConfigError(ValueError):
    """A pod uses something the stand-in cannot run; the message names it."""


def _object_files(
    rest: Rest, namespace: str, kind: str, src: dict[str, Any], volume: str
) -> dict[str, bytes] | None:
    """The files of a ``secret``/``configMap`` source (None: absent and optional)."""
    plural, name_key = ("secrets", "secretName") if kind == "secret" else ("configmaps", "name")
    ref = src.get(name_key) or src.get("name")
    status, data = rest.call("GET", f"/api/v1/namespaces/{namespace}/{plural}/{ref}")
    if status == 404 and src.get("optional"):
        return None
    if status != 200:
        raise PodConfigError(f"volume {volume}: {kind} {ref!r} answered {status}")
    values = {
        k: base64.b64decode(v) if kind == "secret" else str(v).encode()
        for k, v in (data.get("data") or {}).items()
    }
    items = src.get("items")
    if not items:
        return values
    out = {}
    for item in items:
        if item["key"] not in values:
            if src.get("optional"):
                continue
            raise PodConfigError(f"volume {volume}: {kind} {ref!r} has no key {item['key']!r}")
        out[item["path"]] = values[item["key"]]
    return out


def env_value(rest: Rest, namespace: str, name: str, value_from: dict[str, Any]) -> str | None:
    """The value of env var ``name`` from a ``secretKeyRef``/``configMapKeyRef`` (None:
    absent and optional)."""
    kind = "secret" if "secretKeyRef" in value_from else "configMap"
    ref = value_from["secretKeyRef" if kind == "secret" else "configMapKeyRef"]
    src = {"name": ref.get("name"), "optional": bool(ref.get("optional")),
           "items": [{"key": ref["key"], "path": ref["key"]}]}  # fmt: skip
    files = _object_files(rest, namespace, kind, src, f"(env {name})")
    if files is None or ref["key"] not in files:
        return None
    return files[ref["key"]].decode()


def _token(rest: Rest, obj: dict[str, Any], src: dict[str, Any], volume: str) -> bytes:
    """A token for the pod's ServiceAccount from the TokenRequest API, bound to the pod."""
    meta = obj["metadata"]
    sa = obj["spec"].get("serviceAccountName") or "default"
    spec: dict[str, Any] = {
        "expirationSeconds": int(src.get("expirationSeconds") or 3600),
        "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                           "uid": meta["uid"]},
    }  # fmt: skip
    if src.get("audience"):
        spec["audiences"] = [src["audience"]]
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token"
    status, data = rest.call("POST", path, body)
    if status != 201 or not (data.get("status") or {}).get("token"):
        raise PodConfigError(f"volume {volume}: TokenRequest for {sa} answered {status}")
    return str(data["status"]["token"]).encode()


def _projected(rest: Rest, obj: dict[str, Any], vol: dict[str, Any]) -> dict[str, bytes]:
    name, meta = vol["name"], obj["metadata"]
    fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
              "metadata.uid": meta["uid"]}  # fmt: skip
    out: dict[str, bytes] = {}
    for src in vol["projected"].get("sources") or ():
        if "serviceAccountToken" in src:
            tok = src["serviceAccountToken"]
            out[tok.get("path") or "token"] = _token(rest, obj, tok, name)
        elif "secret" in src or "configMap" in src:
            kind = "secret" if "secret" in src else "configMap"
            out.update(_object_files(rest, meta["namespace"], kind, src[kind], name) or {})
        elif "downwardAPI" in src:
            for item in src["downwardAPI"].get("items") or ():
                path = (item.get("fieldRef") or {}).get("fieldPath")
                if path not in fields:
                    raise PodConfigError(f"volume {name}: downwardAPI {path} is not supported")
                out[item["path"]] = fields[path].encode()
        else:
            kinds = sorted(src)
            raise PodConfigError(f"volume {name}: projected {kinds} is not supported")
    return out


def _write(target: Path, files: dict[str, bytes]) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return target


def pod_volumes(
    rest: Rest, node_root: Path, node: str, obj: dict[str, Any], pod_dir: Path
) -> dict[str, Path]:
    """volume name -> the directory (or file) behind it, for the pod ``obj``."""
    out: dict[str, Path] = {}
    namespace = obj["metadata"]["namespace"]
    for vol in obj["spec"].get("volumes") or ():
        name = vol["name"]
        target = pod_dir / "volumes" / name
        if "hostPath" in vol:
            hp = vol["hostPath"]
            path = node_root / hp["path"].lstrip("/")
            kind = hp.get("type") or ""
            if kind in ("Directory", "File") and not path.exists():
                raise PodConfigError(
                    f"hostPath {hp['path']} (type {kind}) does not exist on node "
                    f"{node} (looked at {path})"
                )
            if kind in ("", "DirectoryOrCreate", "Directory"):
                path.mkdir(parents=True, exist_ok=True)
            out[name] = path
        elif "emptyDir" in vol:
            out[name] = _write(target, {})
        elif "secret" in vol or "configMap" in vol:
            kind = "secret" if "secret" in vol else "configMap"
            out[name] = _write(target, _object_files(rest, namespace, kind, vol[kind], name) or {})
        elif "projected" in vol:
            out[name] = _write(target, _projected(rest, obj, vol))
        else:
            kinds = sorted(set(vol) - {"name"})
            raise PodConfigError(f"volume {name}: {kinds} is not supported by the stand-in")
    return out


def service_account_env(
    rest: Rest, container: dict[str, Any], mounts: dict[str, Path], pod_dir: Path
) -> dict[str, str]:
    """The env the stand-in gives a container for the API (see the module docstring)."""
    parts = urlsplit(rest.server)
    env = {"KUBERNETES_SERVICE_HOST": parts.hostname or "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": str(parts.port or 443)}  # fmt: skip
    for m in container.get("volumeMounts") or ():
        if m["mountPath"].rstrip("/") != SA_MOUNT or m["name"] not in mounts:
            continue
        creds = mounts[m["name"]] / (m.get("subPath") or "")
        if not (creds / "token").is_file() or not (creds / "ca.crt").is_file():
            continue
        conf = pod_dir / f"{container['name']}.serviceaccount.kubeconfig"
        write_kubeconfig(conf, server=rest.server, ca_file=creds / "ca.crt",
                         token=(creds / "token").read_text().strip(), user="serviceaccount")  # fmt: skip
        env["KUBECONFIG"] = str(conf)
    return env
