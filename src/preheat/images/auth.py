"""Registry credentials and the auth challenge flow.

Credentials come from a docker ``config.json`` (``$DOCKER_CONFIG/config.json``, else
``~/.docker/config.json``): ``auths.<host>.auth`` (base64 ``user:password``) or
``username``/``password``, or ``identitytoken`` (an OAuth2 refresh token, sent to the
token service as ``grant_type=refresh_token``). Credential helpers (``credsStore``,
``credHelpers``) are not run.

A registry that wants auth answers 401 with ``WWW-Authenticate``:

- ``Basic realm="..."``: resend with ``Authorization: Basic``.
- ``Bearer realm="R",service="S",scope="repository:NAME:pull"``: GET
  ``R?service=S&scope=...`` (with Basic credentials when we have some), read ``token``
  (or ``access_token``) and ``expires_in`` from the JSON, then send
  ``Authorization: Bearer <token>``; a token is reused for its scope until it expires.

Nothing here ever puts a credential in a message.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from preheat.errors import ConfigError

_PARAM = re.compile(r'([A-Za-z_][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


@dataclass(frozen=True)
class Credentials:
    username: str = ""
    password: str = ""
    identity_token: str = ""

    def basic(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")

    def __repr__(self) -> str:  # never show the secret
        return f"Credentials(username={self.username!r}, password=REDACTED)"


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "bearer" | "basic"
    params: Mapping[str, str]


def parse_challenge(header: str) -> Challenge | None:
    """The first Bearer or Basic challenge of a ``WWW-Authenticate`` value."""
    m = re.match(r"\s*([A-Za-z]+)\s*(.*)", header or "")
    if m is None:
        return None
    scheme = m.group(1).lower()
    if scheme not in ("bearer", "basic"):
        return None
    params = {}
    for p in _PARAM.finditer(m.group(2)):
        quoted = p.group(2)
        value = quoted.replace('\\"', '"') if quoted is not None else p.group(3)
        params[p.group(1).lower()] = value
    return Challenge(scheme, params)


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("DOCKER_CONFIG")
    if base:
        return Path(base) / "config.json"
    return Path(env.get("HOME", str(Path.home()))) / ".docker" / "config.json"


def load_credentials(registry: str, path: Path | None = None) -> Credentials | None:
    """The credentials ``config.json`` holds for ``registry`` (``host[:port]``), or None.

    Keys may be written as ``host``, ``https://host`` or ``https://host/v1/`` (what
    ``docker login`` writes for Docker Hub: ``https://index.docker.io/v1/``)."""
    path = config_path() if path is None else path
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read docker config {path}: {exc}; fix or remove it") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        return None
    names = {registry}
    if registry in ("docker.io", "registry-1.docker.io"):
        names |= {"docker.io", "index.docker.io", "registry-1.docker.io"}
    for key, entry in auths.items():
        host = re.sub(r"^https?://", "", str(key)).split("/", 1)[0]
        if host not in names or not isinstance(entry, dict):
            continue
        if entry.get("identitytoken"):
            return Credentials(str(entry.get("username", "")), "", str(entry["identitytoken"]))
        if entry.get("auth"):
            try:
                user, _, pw = base64.b64decode(str(entry["auth"])).decode().partition(":")
            except ValueError:
                raise ConfigError(
                    f"docker config {path}: auths[{key!r}].auth is not base64 user:password"
                ) from None
            return Credentials(user, pw)
        if entry.get("username"):
            return Credentials(str(entry["username"]), str(entry.get("password", "")))
    return None
