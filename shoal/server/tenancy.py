"""Tenants: who a request is for, and what of the server's state is theirs.

Without `--keys` there is one tenant, `default`, exactly as before tenants existed: every
caller (with the `--api-key`, when there is one) shares its stored objects, sessions and KV.
With `--keys FILE` (`keys.py`) every key names a tenant (`--api-key` names `default`), and:

- stored objects (files, batches, message batches, responses) carry their tenant; another
  tenant's are not found (`store`);
- session ids and cache keys are namespaced, `<tenant>/<id>` in the engine (`Tenant.scoped`);
- KV is salted with the tenant's name (`default` stays unsalted, so what it cached before
  keys existed still serves it), narrowed by a request's `cache_salt`; only a declared
  shared prefix is reused across tenants (`KVScope`);
- `--quota` budgets are kept per tenant (`quota_key`), with the tenant's own limits if set.

Keys are compared as SHA-256 digests, each with `hmac.compare_digest`, so the time an
answer takes says nothing about how close a wrong key came. SIGHUP reloads the file
(`Tenancy.reload`): a file that does not parse keeps the keys the server had.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import HTTPException, Request

from shoal.server.keys import KeysError, KeysFile, read_keys

if TYPE_CHECKING:
    from shoal.engine.hashing import Salt

log = logging.getLogger("shoal.server")
DEFAULT = "default"
TENANT = "shoal.tenant"  # where `Guard` keeps a request's `Tenant` in its ASGI scope


@dataclass(frozen=True, slots=True)
class SharedPrefixes:
    """Token ids of the prompt prefixes the operator declared shareable across tenants."""

    prompts: tuple[tuple[int, ...], ...] = ()

    def blocks(self, prompt: Sequence[int], block_size: int) -> int:
        """Full blocks at the start of `prompt` that hold only a declared prefix's tokens."""
        if not self.prompts:
            return 0
        from shoal.engine.sessions import common_prefix_len  # (the quota service loads no engine)

        head = list(prompt[: max(map(len, self.prompts))])
        best = max(common_prefix_len(list(p), head[: len(p)]) for p in self.prompts)
        return best // block_size


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str = DEFAULT
    namespaced: bool = False  # under --keys: its ids, cache keys and KV are its own
    quota_key: str | None = None  # its --quota budget; None: per bearer token, as before keys
    rpm: int | None = None  # its own budget, over the [serve] one
    tpm: int | None = None
    shared: SharedPrefixes = field(default_factory=SharedPrefixes)

    def scoped(self, name: str) -> str:
        """A session id or cache key as the engine knows it: in this tenant's namespace."""
        return f"{self.name}/{name}" if self.namespaced else name

    def own(self, scoped: str) -> str | None:
        """The caller's name for an engine-side name, or None when it is not this tenant's."""
        if not self.namespaced:
            return scoped
        head, sep, rest = scoped.partition("/")
        return rest if sep and head == self.name else None

    def kv_scope(self, cache_salt: str | None) -> KVScope:
        """What a request of this tenant with `cache_salt` may reuse."""
        tenant = self.name if self.namespaced and self.name != DEFAULT else None
        if tenant is None and cache_salt is None:
            return KVScope(None, self.shared)  # the KV everyone shared before tenants
        return KVScope(json.dumps([tenant, cache_salt]), self.shared)


@dataclass(frozen=True, slots=True)
class KVScope:
    """A request's salt text (None: unsalted) and the prefixes every salt shares."""

    salt: str | None
    shared: SharedPrefixes

    def salt_for(self, prompt: Sequence[int], block_size: int) -> Salt | None:
        if self.salt is None:
            return None
        from shoal.engine.hashing import Salt  # (the quota service imports this module)

        return Salt.of(self.salt, self.shared.blocks(prompt, block_size))


UNKEYED = Tenant()
UNSALTED = KVScope(None, SharedPrefixes())


@dataclass(frozen=True, slots=True)
class _Keys:
    """One reading of the keys file, swapped whole on a reload."""

    digests: tuple[tuple[bytes, str], ...] = ()  # (SHA-256 of a key, its tenant's name)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    shared: SharedPrefixes = field(default_factory=SharedPrefixes)


class Tenancy:
    """The server's tenants: `default` alone, or the keys file's (reloadable)."""

    def __init__(self, api_key: str | None = None, keys_path: Path | None = None) -> None:
        self.api_key = hashlib.sha256(api_key.strip().encode()).digest() if api_key else None
        self.path = keys_path
        self._encode: Callable[[str], list[int]] | None = None
        self._file = read_keys(keys_path) if keys_path is not None else None
        self._keys = self._read(self._file)

    @property
    def keyed(self) -> bool:
        """Whether tenants are kept apart (`--keys`)."""
        return self.path is not None

    def tokenize(self, encode: Callable[[str], list[int]]) -> None:
        """Turn the declared shared prefixes into token ids (once the engine is loaded)."""
        self._encode = encode
        self._keys = self._read(self._file)

    def reload(self) -> None:
        """Read the keys file again (SIGHUP); raises `KeysError`, keeping the old keys."""
        if self.path is None:
            return
        file = read_keys(self.path)
        self._keys, self._file = self._read(file), file
        log.info("keys reloaded: %d keys, %d tenants", len(file.keys), len(self._keys.tenants))

    def _read(self, file: KeysFile | None) -> _Keys:
        if file is None:
            return _Keys()
        if self.api_key is not None and file.keys.get(self.api_key, DEFAULT) != DEFAULT:
            raise KeysError(f"keys file {self.path}: --api-key is given to another tenant")
        prompts = [tuple(ids) for ids in file.shared_tokens]
        if self._encode is not None:
            prompts += [tuple(self._encode(text)) for text in file.shared_texts]
        shared = SharedPrefixes(tuple(p for p in prompts if p))
        names = {DEFAULT, *file.keys.values(), *file.tenants}
        tenants = {name: _tenant(file, name, shared) for name in names}
        return _Keys(tuple(file.keys.items()), tenants, shared)

    def tenant(self, name: str) -> Tenant:
        """The tenant called `name` (a batch's owner, run later): one the keys file no longer
        names keeps its namespace, salt and quota key."""
        return self._tenant_of(self._keys, name)

    def _tenant_of(self, keys: _Keys, name: str) -> Tenant:
        if not self.keyed:
            return UNKEYED
        return keys.tenants.get(name) or Tenant(name, True, name, shared=keys.shared)

    def authenticate(self, key: bytes | None) -> Tenant | None:
        """The tenant whose key was presented; None when it opens nothing."""
        if not self.keyed and self.api_key is None:
            return UNKEYED
        if key is None:
            return None
        keys = self._keys  # one reading, whatever a reload does meanwhile
        digest = hashlib.sha256(key.strip()).digest()
        found = None
        if self.api_key is not None and hmac.compare_digest(digest, self.api_key):
            found = DEFAULT
        for known, name in keys.digests:
            if hmac.compare_digest(digest, known):  # every entry compared: no early exit
                found = name
        return None if found is None else self._tenant_of(keys, found)


def _tenant(file: KeysFile, name: str, shared: SharedPrefixes) -> Tenant:
    settings = file.tenants.get(name)
    return Tenant(
        name,
        namespaced=True,
        quota_key=(settings.quota_key if settings else None) or name,
        rpm=settings.rpm if settings else None,
        tpm=settings.tpm if settings else None,
        shared=shared,
    )


def get_tenant(request: Request) -> Tenant:
    """The request's tenant, as `Guard` found it (a FastAPI dependency)."""
    tenant = request.scope.get(TENANT)
    if not isinstance(tenant, Tenant):  # never authenticated: refuse rather than guess
        raise HTTPException(401, "Incorrect API key provided.")
    return tenant
