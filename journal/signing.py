"""Ed25519 signatures on the audit trail's documents (export manifests, checkpoints).

A signed document is a JSON object holding ``public_key`` (the 32 raw bytes of the Ed25519
public key, as lowercase hex) and ``signature`` (the 64-byte signature, as lowercase hex). The
bytes signed are the canonical JSON of the object without its ``signature`` member: keys sorted,
no whitespace, UTF-8 (:func:`signed_bytes`). A document is written to a file as
:func:`document_bytes` gives it (sorted keys, two-space indent, a final line feed), so a file can
also be held to be byte for byte the one written.

The keys and signatures come from the ``cryptography`` package (the extra ``sign``); without it
every function here that needs it raises :class:`SigningUnavailable`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from .errors import JournalError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "INSTALL",
    "KeyProblem",
    "SigningKey",
    "SigningUnavailable",
    "document_bytes",
    "load_public_key",
    "new_private_key",
    "read_document",
    "signature_problem",
    "signed_bytes",
]

INSTALL = "pip install 'airlock-journal[sign]'"

_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")
_HEX_SIGNATURE = re.compile(r"[0-9a-f]{128}")
_SORTED = orjson.OPT_SORT_KEYS


class SigningUnavailable(JournalError):
    """Signing or checking a signature needs the ``cryptography`` package, which is not installed."""


class KeyProblem(JournalError):
    """A key file or a public key cannot be used: the message says why."""


def _ed25519() -> Any:
    """The ``ed25519`` module of ``cryptography``, imported only when a key is needed."""
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:
        raise SigningUnavailable(f"signing needs the cryptography package: {INSTALL}") from e
    return ed25519


def _serialization() -> Any:
    _ed25519()  # the same clear error when cryptography is missing
    from cryptography.hazmat.primitives import serialization

    return serialization


def _public_hex(key: Ed25519PublicKey) -> str:
    serialization = _serialization()
    raw: bytes = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()


def new_private_key() -> tuple[bytes, str]:
    """A new Ed25519 key: its private half as an unencrypted PKCS#8 PEM, and its public key as hex."""
    ed25519, serialization = _ed25519(), _serialization()
    key = ed25519.Ed25519PrivateKey.generate()
    pem: bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())
    return pem, _public_hex(key.public_key())


def signed_bytes(document: Mapping[str, Any]) -> bytes:
    """The bytes a document's signature covers: the canonical JSON of every member but ``signature``."""
    return orjson.dumps({k: v for k, v in document.items() if k != "signature"}, option=_SORTED)


def document_bytes(document: Mapping[str, Any]) -> bytes:
    """The bytes of a document's file: sorted keys, indented by two spaces, a final line feed."""
    return orjson.dumps(dict(document), option=_SORTED | orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)


class SigningKey:
    """An Ed25519 private key that signs documents; :attr:`public_key` is its public key as hex."""

    __slots__ = ("_key", "public_key")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key = _public_hex(key.public_key())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        """The key in the PEM file at ``path`` (as ``airlock journal keygen`` writes it).

        Raises :class:`KeyProblem` for a file that cannot be read or holds no unencrypted Ed25519
        private key, :class:`SigningUnavailable` without ``cryptography``.
        """
        ed25519, serialization = _ed25519(), _serialization()
        try:
            pem = Path(path).read_bytes()
        except OSError as e:
            raise KeyProblem(f"cannot read the key {path}: {e.strerror or e}") from e
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except TypeError as e:  # a key protected by a password
            raise KeyProblem(f"the key {path} is encrypted; give an unencrypted Ed25519 key "
                             "(airlock journal keygen writes one)") from e
        except ValueError as e:
            if b"PUBLIC KEY" in pem:
                raise KeyProblem(f"{path} holds a public key; signing needs the private key") from e
            raise KeyProblem(f"{path} is not a PEM private key (airlock journal keygen writes one)") from e
        except Exception as e:  # cryptography's UnsupportedAlgorithm, say: a key of a kind it cannot read
            raise KeyProblem(f"{path} holds no key that can be used here ({e})") from e
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise KeyProblem(f"the key {path} is a {type(key).__name__.removesuffix('PrivateKey') or 'other'} key, "
                             "not Ed25519 (airlock journal keygen writes one)")
        return cls(key)

    def sign(self, document: Mapping[str, Any]) -> dict[str, Any]:
        """``document`` with this key's ``public_key`` and the ``signature`` over :func:`signed_bytes`."""
        signed = {k: v for k, v in document.items() if k != "signature"}
        signed["public_key"] = self.public_key
        signature: bytes = self._key.sign(signed_bytes(signed))
        signed["signature"] = signature.hex()
        return signed


def load_public_key(given: str) -> str:
    """A public key as lowercase hex, from ``given``: 64 hex digits, or the path of a file holding
    them or a PEM public key. Raises :class:`KeyProblem` naming what is wrong, and
    :class:`SigningUnavailable` without ``cryptography`` (no signature could be checked with it)."""
    _ed25519()
    text = given.strip()
    if _HEX_KEY.fullmatch(text):
        return text.lower()
    try:
        content = Path(given).read_bytes()
    except FileNotFoundError as e:
        raise KeyProblem(f"the public key {given!r} is neither 64 hex digits nor a file") from e
    except OSError as e:
        raise KeyProblem(f"cannot read the public key {given}: {e.strerror or e}") from e
    stripped = content.strip()
    if _HEX_KEY.fullmatch(stripped.decode("ascii", "replace")):
        return stripped.decode("ascii").lower()
    if b"PRIVATE KEY" in content:
        raise KeyProblem(f"{given} holds a private key: give the public key (the hex that keygen printed)")
    if b"-----BEGIN PUBLIC KEY-----" not in content:
        raise KeyProblem(f"{given} holds no public key: 64 hex digits or a PEM public key")
    ed25519, serialization = _ed25519(), _serialization()
    try:
        key = serialization.load_pem_public_key(content)
    except Exception as e:  # ValueError, or cryptography's UnsupportedAlgorithm
        raise KeyProblem(f"{given} holds no PEM public key that can be read ({e})") from e
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise KeyProblem(f"{given} holds a public key that is not Ed25519")
    return _public_hex(key)


def signature_problem(document: Mapping[str, Any], public_key: str) -> str | None:
    """Why ``document`` is not signed by ``public_key`` (hex), as a phrase; None when it is."""
    signer, signature = document.get("public_key"), document.get("signature")
    if signer is None and signature is None:
        return "it is not signed"
    if not isinstance(signer, str) or not isinstance(signature, str):
        return "its public_key and signature are not texts"
    if signer != public_key:
        return f"it is signed by another key ({signer}), not by {public_key}"
    if not _HEX_SIGNATURE.fullmatch(signature):
        return "its signature is not 128 lowercase hex digits"
    ed25519 = _ed25519()
    from cryptography.exceptions import InvalidSignature

    try:
        ed25519.Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key)).verify(
            bytes.fromhex(signature), signed_bytes(document))
    except InvalidSignature:
        return "its signature does not match its contents"
    except ValueError as e:
        return f"its public key cannot be used ({e})"
    return None


def read_document(raw: bytes, *, exact: bool) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object in ``raw``, and why it cannot be taken as a document (None when it can).

    With ``exact`` the bytes must be those :func:`document_bytes` writes for the object: a file
    whose layout was changed by as much as one space is not the file that was written.
    """
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return None, f"it is not JSON ({e})"
    if not isinstance(document, dict):
        return None, f"it is not a JSON object but {type(document).__name__}"
    if exact:
        try:
            written = document_bytes(document)
        except TypeError as e:  # a number orjson does not write back: not a file this wrote
            return None, f"it holds a value that is not written back as read ({e})"
        if written != raw:
            return None, "its bytes are not those written (its text was changed, if only in layout)"
    return document, None
