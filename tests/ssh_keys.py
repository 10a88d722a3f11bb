"""Real SSH key pairs for tests, made with the cryptography package (no fixed strings that only look
like keys): ``key_pair()`` answers (private key in OpenSSH PEM, public key line)."""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa


def _pair(private, comment: str) -> tuple[bytes, str]:
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = private.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return pem, f"{public.decode()} {comment}".strip()


def key_pair(kind: str = "ed25519", comment: str = "me@laptop", bits: int = 2048) -> tuple[bytes, str]:
    if kind == "ed25519":
        return _pair(ed25519.Ed25519PrivateKey.generate(), comment)
    if kind == "ecdsa":
        return _pair(ec.generate_private_key(ec.SECP256R1()), comment)
    if kind == "rsa":
        return _pair(rsa.generate_private_key(public_exponent=65537, key_size=bits), comment)
    raise ValueError(kind)


def public_key(kind: str = "ed25519", comment: str = "me@laptop", bits: int = 2048) -> str:
    return key_pair(kind, comment, bits)[1]
