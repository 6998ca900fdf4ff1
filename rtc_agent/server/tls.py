"""HTTPS: a given certificate, or a self-signed one for phones on a LAN (getUserMedia needs a secure context)."""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import socket
import ssl
from pathlib import Path

from ..config import Settings

log = logging.getLogger(__name__)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rtc-agent" / "tls"


def server_context(settings: Settings) -> ssl.SSLContext | None:
    if settings.cert and settings.key:
        cert, key = Path(settings.cert), Path(settings.key)
    elif settings.self_signed:
        cert, key = self_signed(settings.host)
    else:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def _names(host: str) -> tuple[list[str], list[str]]:
    dns = {"localhost", socket.gethostname()}
    ips = {"127.0.0.1", "::1"}
    candidates = [host] if host not in ("0.0.0.0", "::", "") else []
    try:
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    try:  # the address used to reach other machines: what a phone on the LAN will type
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            candidates.append(s.getsockname()[0])
    except OSError:
        pass
    for name in candidates:
        try:
            ips.add(str(ipaddress.ip_address(name)))
        except ValueError:
            dns.add(name)
    return sorted(dns), sorted(ips)


def self_signed(host: str) -> tuple[Path, Path]:
    """A certificate for this machine's names and addresses, made once and kept in ~/.cache/rtc-agent/tls."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    dns, ips = _names(host)
    tag = hashlib.sha256(" ".join(dns + ips).encode()).hexdigest()[:10]
    cert_path, key_path = CACHE / f"self-signed-{tag}.pem", CACHE / f"self-signed-{tag}.key"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rtc-agent self-signed")])
    now = datetime.datetime.now(datetime.timezone.utc)
    san = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    CACHE.mkdir(parents=True, exist_ok=True)
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    log.info("made a self-signed certificate for %s (%s); browsers will ask to accept it once",
             ", ".join(dns + ips), cert_path)
    return cert_path, key_path
