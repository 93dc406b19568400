"""Registry credentials and the auth challenge flow.

Credentials come from a docker ``config.json`` (``$DOCKER_CONFIG/config.json``, else
``~/.docker/config.json``): ``auths.<host>.auth`` (base64 ``user:password``) or
``username``/``password``, or ``identitytoken`` (an OAuth2 refresh token, sent to the
token service as ``grant_type=refresh_token``).

Credential helpers, as docker runs them: ``credHelpers.<host>`` names the helper for one
registry, else ``credsStore`` the helper for all; a helper takes precedence over
``auths``. preheat runs ``docker-credential-<name> get`` (from ``PATH``) with the server
on stdin (the host, ``https://index.docker.io/v1/`` for Docker Hub) and reads
``{"Username": ..., "Secret": ...}`` (``Username`` ``<token>``: the secret is an identity
token). "credentials not found" means anonymous; a helper that is not installed, fails
or answers garbage is ``CredentialHelperError`` naming it (never its secret).

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
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from preheat.errors import ConfigError, CredentialHelperError

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
    names = {registry}
    if registry in ("docker.io", "registry-1.docker.io"):
        names |= {"docker.io", "index.docker.io", "registry-1.docker.io"}
    helper = _helper_for(doc, names, path)
    if helper is not None:
        hub = "docker.io" in names and len(names) > 1
        return run_helper(helper, "https://index.docker.io/v1/" if hub else registry)
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        return None
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


# --- credential helpers -------------------------------------------------------------------

_NOT_FOUND = "credentials not found"


def _helper_for(doc: object, names: set[str], path: Path) -> str | None:
    """The helper ``config.json`` names for one of ``names``: ``credHelpers``, else
    ``credsStore``."""
    if not isinstance(doc, dict):
        return None
    helpers = doc.get("credHelpers")
    if isinstance(helpers, dict):
        for key, name in helpers.items():
            host = re.sub(r"^https?://", "", str(key)).split("/", 1)[0]
            if host in names and name:
                return _helper_name(str(name), path)
    store = doc.get("credsStore")
    return _helper_name(str(store), path) if store else None


def _helper_name(name: str, path: Path) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ConfigError(
            f"docker config {path}: credential helper name {name!r} is not a plain name "
            "(docker runs docker-credential-<name> from PATH)"
        )
    return name


def run_helper(name: str, server: str, *, timeout: float = 30.0) -> Credentials | None:
    """``docker-credential-<name> get`` for ``server``; None when it has no credentials."""
    exe = f"docker-credential-{name}"
    found = shutil.which(exe)
    if found is None:
        raise CredentialHelperError(
            f"the docker config names credential helper {name!r} for {server}, but {exe} is "
            "not on PATH; install it or remove credsStore/credHelpers from config.json"
        )
    try:
        proc = subprocess.run(
            [found, "get"], input=server, capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CredentialHelperError(
            f"{exe} get for {server} failed: {type(exc).__name__}"
        ) from None
    if proc.returncode != 0:
        said = (proc.stdout.strip() or proc.stderr.strip()).splitlines()[:1]
        if said and _NOT_FOUND in said[0].lower():
            return None
        raise CredentialHelperError(
            f"{exe} get for {server} exited {proc.returncode}: {said[0][:200] if said else ''!r}"
        )
    try:
        doc = json.loads(proc.stdout)
        user, secret = str(doc["Username"]), str(doc["Secret"])
    except (ValueError, KeyError, TypeError):
        raise CredentialHelperError(
            f"{exe} get for {server} did not answer JSON with Username and Secret"
        ) from None
    if user == "<token>":
        return Credentials("", "", secret)
    return Credentials(user, secret)
