"""The metrics adapter's serving certificate and client-certificate check.

The aggregator calls an extension API server over TLS and, with ``caBundle`` in the
``APIService``, verifies its certificate for ``SERVICE.NAMESPACE.svc``. The adapter serves
the certificate it is given (``--tls-cert-file``/``--tls-private-key-file``) or one it
generates: self-signed, ECDSA P-256, valid for a year, with the Service's DNS names and
the listen address as subject alternative names, written to ``--cert-dir`` (mode 0600
for the key) so ``caBundle`` can be filled from it.

The aggregator authenticates itself with its front-proxy client certificate (the API
server's ``--proxy-client-cert-file``). The context asks for a client certificate and
verifies it against the ``requestheader-client-ca-file`` the API server publishes in
``kube-system/extension-apiserver-authentication``; a connection without one still
completes, and the server answers its requests 401 (:func:`front_proxy_user`).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from preheat.errors import ConfigError

__all__ = ["ServingCert", "generate_self_signed", "peer_common_name", "server_context"]


@dataclass(frozen=True)
class ServingCert:
    """PEM files of the serving certificate and its key."""

    cert: Path
    key: Path


def generate_self_signed(out_dir: Path, names: Sequence[str]) -> ServingCert:
    """Write ``tls.crt`` and ``tls.key`` for ``names`` (DNS names or IP addresses; the
    first is the common name) under ``out_dir``; returns their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not names:
        raise ConfigError("a serving certificate needs at least one name; give --tls-san")
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        # Its own CA (caBundle is this certificate) and a TLS server certificate.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    key_path, cert_path = out_dir / "tls.key", out_dir / "tls.crt"
    key_path.touch(mode=0o600)
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return ServingCert(cert_path, key_path)


def server_context(serving: ServingCert, client_ca_pem: str | None) -> ssl.SSLContext:
    """A TLS server context with ``serving``; with ``client_ca_pem`` it asks for (and
    verifies) a client certificate signed by that CA, without requiring one."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(serving.cert), str(serving.key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the serving certificate {serving.cert} / key {serving.key}: {exc}; "
            "give a PEM certificate and its key, or neither (one is generated)"
        ) from None
    if client_ca_pem:
        ctx.verify_mode = ssl.CERT_OPTIONAL
        try:
            ctx.load_verify_locations(cadata=client_ca_pem)
        except ssl.SSLError as exc:
            raise ConfigError(f"the requestheader client CA does not load: {exc}") from None
    return ctx


def peer_common_name(peercert: Mapping[str, Any] | None) -> str | None:
    """The common name of a verified client certificate (``SSLSocket.getpeercert()``), or
    ``None`` when the client sent none."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
