"""Namespace keys: ``DATA/ns/<namespace>/keys/<key_id hex>`` holds JSON
{"namespace", "role", "secret" hex}, written atomically, mode 0600."""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass

from sos_wire.names import BadName, validate_namespace

from .durable import makedirs_durable, write_file_durable

__all__ = ["ROLES", "ROLE_APPEND", "ROLE_READ", "ROLE_TOKEN", "KeyRecord", "KeyStore"]

log = logging.getLogger("sos_server.storage")

ROLE_APPEND = "append"
ROLE_READ = "read"
#: a gateway client's key: AUTH succeeds (so ``sos gateway`` can check it and issue an append
#: bearer token), every later request but PING is FORBIDDEN (protocol.md 1.6)
ROLE_TOKEN = "token"
ROLES = (ROLE_APPEND, ROLE_READ, ROLE_TOKEN)


@dataclass
class KeyRecord:
    key_id: bytes
    secret: bytes
    role: str
    namespace: str



class KeyStore:
    """The key files of every namespace under a data directory (a mixin of Storage)."""

    def ns_path(self, namespace: str) -> str:
        raise NotImplementedError

    def keygen(self, namespace: str, role: str) -> str:
        """Create a key for *namespace* with *role*; returns ``<key_id hex>.<secret hex>``."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        validate_namespace(namespace)
        key_id, secret = secrets.token_bytes(8), secrets.token_bytes(32)
        kdir = os.path.join(self.ns_path(namespace), "keys")
        makedirs_durable(kdir)
        makedirs_durable(os.path.join(self.ns_path(namespace), "objects"))
        body = json.dumps({"role": role, "secret": secret.hex(), "namespace": namespace}).encode()
        write_file_durable(os.path.join(kdir, key_id.hex()), body, mode=0o600)
        return f"{key_id.hex()}.{secret.hex()}"

    def get_key(self, namespace: str, key_id: bytes) -> KeyRecord | None:
        """The key *key_id* of *namespace*, read from disk (so keygen works while serving)."""
        try:
            validate_namespace(namespace)
        except BadName:
            return None
        path = os.path.join(self.ns_path(namespace), "keys", bytes(key_id).hex())
        try:
            with open(path, "rb") as f:
                rec = json.loads(f.read())
            return KeyRecord(bytes(key_id), bytes.fromhex(rec["secret"]), rec["role"], namespace)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.error("unreadable key file %s: %s", path, exc)
            return None

    def _key_path(self, namespace: str, key_id: bytes) -> str:
        """The key file's path, built once per key (sessions stat it before every request)."""
        paths: dict[tuple[str, bytes], str] = self.__dict__.setdefault("_key_paths", {})
        k = (namespace, bytes(key_id))
        path = paths.get(k)
        if path is None:
            if len(paths) >= 4096:
                paths.clear()
            path = paths[k] = os.path.join(self.ns_path(namespace), "keys", k[1].hex())
        return path

    def key_state(self, namespace: str, key_id: bytes) -> tuple[int, ...] | None:
        """A fingerprint of the key's file (one stat), None if it is gone. Sessions compare it
        before each request, so that removing or rewriting a key ends the sessions opened with it."""
        try:
            st = os.stat(self._key_path(namespace, key_id))
        except (BadName, OSError):
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
