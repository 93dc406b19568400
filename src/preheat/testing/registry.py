"""A real OCI registry on 127.0.0.1 for tests and benchmarks, and OCI layouts to push to it.

``registry()`` starts Debian's ``docker-registry`` (distribution 2.8) with filesystem
storage in a temp dir, on a free port, with its access log in ``Registry.log`` (count
requests with ``Registry.requests``). ``token_registry()`` is the same registry behind
distribution's own token auth (``auth.token``): it answers 401 with a
``WWW-Authenticate: Bearer realm=...,service=...,scope=...`` challenge, and the realm is
``TokenIssuer``, a small issuer here that checks Basic credentials and signs RS256 JWTs
carrying an ``x5c`` header the registry verifies against its ``rootcertbundle``::

    layout = write_layout(tmp / "img", [4 << 20, 1 << 20], platforms=("linux/amd64",))
    with registry(tmp / "reg") as reg:
        reg.push(layout.path, "team/app:v1")
        ref = reg.ref("team/app:v1")      # "127.0.0.1:PORT/team/app:v1"

Images are pushed the way a user would: ``skopeo copy --all oci:DIR:latest docker://...``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from .origins import AppInThread
from .procs import start_server

__all__ = [
    "REGISTRY",
    "SKOPEO",
    "ImageInfo",
    "ModelLayer",
    "OciLayout",
    "Registry",
    "TokenIssuer",
    "image_mirror",
    "registry",
    "skopeo",
    "tar_info",
    "tar_layer",
    "token_registry",
    "write_layout",
]

REGISTRY = os.environ.get("PREHEAT_REGISTRY", "/usr/bin/docker-registry")
SKOPEO = os.environ.get("PREHEAT_SKOPEO", shutil.which("skopeo") or "/usr/bin/skopeo")

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


# --- OCI layouts ------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageInfo:
    """One platform's image in a layout: its manifest, config and layers (digest, size)."""

    platform: str
    manifest: str
    manifest_size: int
    config: str
    layers: tuple[tuple[str, int], ...]

    @property
    def size(self) -> int:
        return sum(s for _, s in self.layers)


@dataclass(frozen=True)
class OciLayout:
    """An OCI image layout on disk (``oci-layout``, ``index.json``, ``blobs/sha256``).

    ``digest`` names the top-level object of this layout: the image index of a
    multi-platform layout, else the one manifest (skopeo pushes a manifest as it is; it
    may re-encode an index, so ask the registry for a pushed index's digest)."""

    path: Path
    digest: str
    images: Mapping[str, ImageInfo]

    def blob(self, digest: str) -> Path:
        return self.path / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _write_blob(root: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    p = root / "blobs" / "sha256" / digest
    if not p.exists():
        p.write_bytes(data)
    return f"sha256:{digest}", len(data)


def _write_layer(root: Path, name: str, size: int, rng: random.Random) -> tuple[str, int, str]:
    """A gzip stream (stored blocks: level 0, so fast) of a tar holding one file ``name``
    of ``size`` random bytes. Compressed, because skopeo gzips an uncompressed layer on
    its way into a registry (the pushed digest would not be the layout's)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    tmp = root / "blobs" / f".layer-{uuid.uuid4().hex}"
    diff = hashlib.sha256()  # the uncompressed tar's digest: the config's diff_id
    with (
        open(tmp, "wb") as raw,
        gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=0, mtime=0) as f,
    ):

        def put(b: bytes) -> None:
            f.write(b)
            diff.update(b)

        put(info.tobuf(format=tarfile.USTAR_FORMAT))
        left = size
        while left:
            n = min(left, 8 << 20)
            put(rng.randbytes(n))
            left -= n
        put(b"\0" * ((-size) % 512) + b"\0" * 1024)
    h = hashlib.sha256()
    with open(tmp, "rb") as done:
        while b := done.read(8 << 20):
            h.update(b)
    digest = h.hexdigest()
    dest = root / "blobs" / "sha256" / digest
    if dest.exists():
        tmp.unlink()
    else:
        os.replace(tmp, dest)
    return f"sha256:{digest}", dest.stat().st_size, f"sha256:{diff.hexdigest()}"


def _canonical(doc: object) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def write_layout(
    path: Path,
    layer_sizes: Sequence[int],
    *,
    platforms: Sequence[str] = ("linux/amd64",),
    seed: int = 0,
    layer_media_type: str = OCI_LAYER,
    config_media_type: str = OCI_CONFIG,
    tag: str = "latest",
) -> OciLayout:
    """Write an OCI layout with one image per platform, each of ``len(layer_sizes)``
    layers (tar files of random bytes). Layer ``i`` of a platform depends only on
    (``seed``, platform, ``i``, size), so two layouts written with the same seed share
    the layers they have in common. More than one platform: ``index.json`` points at an
    image index listing each platform's manifest (push it with ``skopeo copy --all``)."""
    path = Path(path)
    (path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    images: dict[str, ImageInfo] = {}
    for plat in platforms:
        os_name, arch, *variant = plat.split("/")
        layers, diff_ids = [], []
        for i, size in enumerate(layer_sizes):
            rng = random.Random(f"{seed}/{plat}/{i}/{size}")
            d, s, diff_id = _write_layer(path, f"layer-{i}.bin", size, rng)
            layers.append((d, s))
            diff_ids.append(diff_id)
        config = {
            "architecture": arch,
            "os": os_name,
            **({"variant": variant[0]} if variant else {}),
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        cfg_digest, cfg_size = _write_blob(path, _canonical(config))
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": config_media_type, "digest": cfg_digest, "size": cfg_size},
            "layers": [{"mediaType": layer_media_type, "digest": d, "size": s} for d, s in layers],
        }
        m_digest, m_size = _write_blob(path, _canonical(manifest))
        images[plat] = ImageInfo(plat, m_digest, m_size, cfg_digest, tuple(layers))
    refname = {"org.opencontainers.image.ref.name": tag}
    if len(platforms) == 1:
        (info,) = images.values()
        top = {"mediaType": OCI_MANIFEST, "digest": info.manifest, "size": info.manifest_size}
    else:
        entries = []
        for plat, info in images.items():
            os_name, arch, *variant = plat.split("/")
            p = {
                "os": os_name,
                "architecture": arch,
                **({"variant": variant[0]} if variant else {}),
            }
            entries.append(
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": info.manifest,
                    "size": info.manifest_size,
                    "platform": p,
                }
            )
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
        i_digest, i_size = _write_blob(path, _canonical(index))
        top = {"mediaType": OCI_INDEX, "digest": i_digest, "size": i_size}
    (path / "index.json").write_bytes(
        _canonical(
            {
                "schemaVersion": 2,
                "mediaType": OCI_INDEX,
                "manifests": [{**top, "annotations": refname}],
            }
        )
    )
    return OciLayout(path, str(top["digest"]), images)


# --- tar layers (ModelPack ``...v1.tar``, modelcars) --------------------------------


@dataclass(frozen=True)
class ModelLayer:
    """One layer of a ModelPack artifact to push: media type, bytes, annotations."""

    media_type: str
    data: bytes
    annotations: Mapping[str, str] | None = None


TarMember = tuple[str, bytes] | tarfile.TarInfo


def tar_layer(members: Sequence[TarMember], compression: str = "") -> bytes:
    """A tar of ``members`` (``(name, bytes)`` is a regular file; a ``TarInfo`` is written
    as it is: directories, links, devices, whiteouts), then gzip or zstd when asked.
    Deterministic: the same members always give the same bytes (and layer digest)."""
    import io

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m)
                continue
            name, data = m
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    if compression == "gzip":
        return gzip.compress(raw, mtime=0)
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdCompressor().compress(raw)
    return raw


def tar_info(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    """A header-only member: ``tarfile.DIRTYPE``, ``SYMTYPE``, ``LNKTYPE``, ``CHRTYPE``,
    ``FIFOTYPE``... (``linkname`` for links)."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mtime = kind, linkname, 0
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info


def _decompress(b: bytes) -> bytes:
    if b[:2] == b"\x1f\x8b":
        return gzip.decompress(b)
    if b[:4] == b"\x28\xb5\x2f\xfd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(b)
    return b


def _image_layer_type(b: bytes) -> str:
    if b[:2] == b"\x1f\x8b":
        return "application/vnd.oci.image.layer.v1.tar+gzip"
    if b[:4] == b"\x28\xb5\x2f\xfd":
        return "application/vnd.oci.image.layer.v1.tar+zstd"
    return "application/vnd.oci.image.layer.v1.tar"


# --- skopeo -----------------------------------------------------------------------------


def skopeo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run skopeo (plain HTTP for 127.0.0.1 registries); raises with its stderr on failure."""
    if not Path(SKOPEO).exists():
        raise RuntimeError(f"skopeo not found at {SKOPEO}; run scripts/install-sysdeps.sh")
    argv = [SKOPEO, "--insecure-policy", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc


# --- the registry -----------------------------------------------------------------------


@dataclass
class Registry:
    """A running distribution registry at ``host`` (``127.0.0.1:PORT``)."""

    port: int
    root: Path
    log: Path
    creds: tuple[str, str] | None = None
    pid: int = 0
    _proc: object = field(default=None, repr=False)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def ref(self, name: str) -> str:
        return f"{self.host}/{name}"

    def push(self, layout: Path, name: str, *, tag: str = "latest") -> None:
        """``skopeo copy --all oci:LAYOUT:TAG docker://HOST/NAME`` (every platform)."""
        creds = ["--dest-creds", f"{self.creds[0]}:{self.creds[1]}"] if self.creds else []
        skopeo(
            "copy",
            "--all",
            "--dest-tls-verify=false",
            *creds,
            f"oci:{layout}:{tag}",
            f"docker://{self.ref(name)}",
        )

    def put_blob(self, name: str, data: bytes) -> str:
        """Upload one blob (monolithic: POST then PUT ?digest=); returns its digest."""
        import urllib.request

        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        post = urllib.request.Request(
            f"{self.url}/v2/{name}/blobs/uploads/", method="POST", data=b""
        )
        with urllib.request.urlopen(post, timeout=30) as resp:
            loc = resp.headers["Location"]
        loc = self.url + loc if loc.startswith("/") else loc
        sep = "&" if "?" in loc else "?"
        put = urllib.request.Request(
            f"{loc}{sep}digest={digest}",
            method="PUT",
            data=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        urllib.request.urlopen(put, timeout=30).close()
        return digest

    def put_manifest(self, name: str, body: bytes, media_type: str = OCI_MANIFEST) -> str:
        """PUT a manifest at ``name`` (``repo:tag``); returns its digest."""
        import urllib.request

        repo, _, tag = name.partition(":")
        put = urllib.request.Request(
            f"{self.url}/v2/{repo}/manifests/{tag or 'latest'}",
            method="PUT",
            data=body,
            headers={"Content-Type": media_type},
        )
        urllib.request.urlopen(put, timeout=30).close()
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def push_model(
        self,
        name: str,
        files: Mapping[str, bytes],
        *,
        media_type: str = "application/vnd.cncf.model.weight.v1.raw",
        artifact_type: str | None = "application/vnd.cncf.model.manifest.v1+json",
    ) -> str:
        """Push a CNCF ModelPack artifact (``name`` is ``repo:tag``): one layer per file,
        its path in the ``org.cncf.model.filepath`` annotation. Returns the manifest
        digest. (skopeo copies images; an artifact goes up over the registry API.)"""
        layers = [
            ModelLayer(media_type, data, {"org.cncf.model.filepath": path})
            for path, data in files.items()
        ]
        return self.push_model_layers(name, layers, artifact_type=artifact_type)

    def push_model_layers(
        self,
        name: str,
        layers: Sequence[ModelLayer],
        *,
        artifact_type: str | None = "application/vnd.cncf.model.manifest.v1+json",
    ) -> str:
        """Push a ModelPack artifact from its layers as given (raw or tar, any media
        type and annotations). Returns the manifest digest."""
        repo = name.partition(":")[0]
        config = _canonical({"descriptor": {"name": repo}, "modelfs": {"type": "layers"}})
        descs = []
        for layer in layers:
            desc: dict[str, object] = {
                "mediaType": layer.media_type,
                "digest": self.put_blob(repo, layer.data),
                "size": len(layer.data),
            }
            if layer.annotations:
                desc["annotations"] = dict(layer.annotations)
            descs.append(desc)
        manifest: dict[str, object] = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {
                "mediaType": "application/vnd.cncf.model.config.v1+json",
                "digest": self.put_blob(repo, config),
                "size": len(config),
            },
            "layers": descs,
        }
        if artifact_type:
            manifest["artifactType"] = artifact_type
        return self.put_manifest(name, _canonical(manifest))

    def push_image(
        self, name: str, layers: Sequence[bytes], *, media_types: Sequence[str] | None = None
    ) -> str:
        """Push an ordinary container image (``name`` is ``repo:tag``) of these layer
        blobs (tars from ``tar_layer``), as written, over the registry API (skopeo would
        recompress them). Media types default from each blob's compression. Returns the
        manifest digest."""
        repo = name.partition(":")[0]
        types = list(media_types or [_image_layer_type(b) for b in layers])
        diff_ids = ["sha256:" + hashlib.sha256(_decompress(b)).hexdigest() for b in layers]
        config = _canonical(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {},
                "rootfs": {"type": "layers", "diff_ids": diff_ids},
            }
        )
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {
                "mediaType": OCI_CONFIG,
                "digest": self.put_blob(repo, config),
                "size": len(config),
            },
            "layers": [
                {"mediaType": t, "digest": self.put_blob(repo, b), "size": len(b)}
                for t, b in zip(types, layers, strict=True)
            ],
        }
        return self.put_manifest(name, _canonical(manifest))

    def requests(self, pattern: str = "") -> list[str]:
        """Access-log request lines (``GET /v2/... HTTP/1.1``) that contain ``pattern``."""
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        lines = re.findall(r'"((?:GET|HEAD|PUT|POST|PATCH|DELETE) /v2/[^"]*)"', text)
        return [x for x in lines if pattern in x]

    def stop(self, *, sig: int = signal.SIGTERM) -> None:
        """Stop it (``sig=SIGKILL``: a registry that dies mid-request)."""
        proc = self._proc
        if proc is not None:
            proc.stop(10, sig=sig)  # type: ignore[attr-defined]
            self._proc = None

    def blob_file(self, digest: str) -> Path:
        """Where the registry's filesystem storage keeps a blob (tests corrupt it)."""
        hexd = digest.removeprefix("sha256:")
        return self.root / "storage/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def start(self) -> None:
        """Start it again on the same port and storage (after ``stop``: a registry that
        went down mid-pull and came back)."""
        self._proc, _ = _start(self.root, self.port, self.log)
        self.pid = self._proc.pid  # type: ignore[attr-defined]


_CONFIG = """version: 0.1
log:
  level: warn
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
  secret: preheat-test-secret
{auth}"""


def _start(root: Path, port: int | None, log: Path, auth: str = "") -> tuple[object, int]:
    if not Path(REGISTRY).exists():
        raise RuntimeError(
            f"docker-registry not found at {REGISTRY}; run scripts/install-sysdeps.sh "
            "(Debian docker-registry)"
        )

    def argv(p: int) -> list[str]:
        conf = root / "config.yml"
        conf.write_text(_CONFIG.format(storage=root / "storage", port=p, auth=auth))
        return [REGISTRY, "serve", str(conf)]

    with open(log, "a") as f:
        f.write("")
    proc, p = start_server(argv, port=port, health="/v2/", log=log, timeout=30, what="registry")
    return proc, p


@contextlib.contextmanager
def registry(root: Path | None = None, *, _auth: str = "") -> Iterator[Registry]:
    """A distribution registry with filesystem storage under ``root`` (a temp dir when
    None), stopped by PID on exit."""
    own = root is None
    base = Path(tempfile.mkdtemp(prefix="preheat-registry-")) if root is None else Path(root)
    base.mkdir(parents=True, exist_ok=True)
    log = base / "registry.log"
    proc, port = _start(base, None, log, _auth)
    reg = Registry(port=port, root=base, log=log, pid=proc.pid, _proc=proc)  # type: ignore[attr-defined]
    try:
        yield reg
    finally:
        reg.stop()
        if own:
            shutil.rmtree(base, ignore_errors=True)


# --- the node mirror (``preheat image serve``) ------------------------------------------


@contextlib.contextmanager
def image_mirror(
    store: Path, upstream: str | None, log: Path, *, tag_ttl: float | None = None
) -> Iterator[int]:
    """Run ``preheat image serve --store STORE`` (a real process) on a free port; yields
    the port, stops the process by PID on exit. ``tag_ttl``: its ``--tag-ttl``."""
    import sys

    def argv(p: int) -> list[str]:
        cmd = [
            sys.executable,
            "-c",
            "import sys; from preheat.cli import main; sys.exit(main())",
            "image",
            "serve",
            "--store",
            str(store),
            "--port",
            str(p),
        ]
        ttl = ["--tag-ttl", str(tag_ttl)] if tag_ttl is not None else []
        return cmd + (["--upstream", upstream] if upstream else []) + ttl

    proc, port = start_server(argv, health="/v2/", log=log, timeout=30, what="image mirror")
    try:
        yield port
    finally:
        proc.stop(10)


# --- token auth -------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenIssuer(AppInThread):
    """A Docker/distribution token server: ``GET /token?service=S&scope=repository:N:A``
    with Basic credentials answers ``{"token", "access_token", "expires_in"}``: a JWT
    (RS256, ``x5c`` header) granting the requested actions. Wrong credentials: 401.
    ``issued`` counts the tokens handed out; ``lifetime`` is their ``expires_in``."""

    def __init__(self, users: Mapping[str, str], service: str, *, lifetime: int = 300) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        super().__init__(self._handle)
        self.users = dict(users)
        self.service = service
        self.issuer = "preheat-test-issuer"
        self.lifetime = lifetime
        self.issued = 0
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "preheat test token issuer")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self._der = self.cert.public_bytes(serialization.Encoding.DER)
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def _sign(self, claims: dict[str, object]) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(self._der).decode()]}
        signing = f"{_b64(_canonical(header))}.{_b64(_canonical(claims))}"
        sig = self._key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{_b64(sig)}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path != "/token":
            return web.Response(status=404)
        user = ""
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            try:
                user, _, pw = base64.b64decode(auth[6:]).decode().partition(":")
            except ValueError:
                return web.Response(status=400)
            if self.users.get(user) != pw:
                return web.json_response({"details": "bad credentials"}, status=401)
        elif self.users:
            return web.json_response({"details": "credentials required"}, status=401)
        access = []
        for scope in request.query.getall("scope", []):
            for one in scope.split(" "):
                kind, _, rest = one.partition(":")
                name, _, actions = rest.rpartition(":")
                if kind == "repository" and name:
                    access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        token = self._sign(
            {
                "iss": self.issuer,
                "sub": user,
                "aud": request.query.get("service", self.service),
                "exp": now + self.lifetime,
                "nbf": now - 10,
                "iat": now,
                "jti": uuid.uuid4().hex,
                "access": access,
            }
        )
        self.issued += 1
        return web.json_response(
            {"token": token, "access_token": token, "expires_in": self.lifetime}
        )


@contextlib.contextmanager
def token_registry(
    root: Path | None = None, *, users: Mapping[str, str] | None = None
) -> Iterator[tuple[Registry, TokenIssuer]]:
    """A registry behind distribution's token auth, with ``TokenIssuer`` as its realm.
    ``users`` (default ``{"preheat": "s3cret"}``) may pull and push."""
    users = dict(users or {"preheat": "s3cret"})
    base = Path(tempfile.mkdtemp(prefix="preheat-registry-")) if root is None else Path(root)
    base.mkdir(parents=True, exist_ok=True)
    service = "preheat-test-registry"
    with TokenIssuer(users, service) as issuer:
        bundle = base / "token-root.pem"
        bundle.write_bytes(issuer.cert_pem)
        auth = (
            "auth:\n  token:\n"
            f"    realm: {issuer.realm}\n    service: {service}\n"
            f"    issuer: {issuer.issuer}\n    rootcertbundle: {bundle}\n"
        )
        with registry(base, _auth=auth) as reg:
            user, pw = next(iter(users.items()))
            reg.creds = (user, pw)
            yield reg, issuer
    if root is None:
        shutil.rmtree(base, ignore_errors=True)
