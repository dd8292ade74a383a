"""`shoal serve --keys FILE`: named API keys, each a tenant's, kept only as hashes.

```toml
# Who may call this server, and as which tenant. `shoal keys hash` prints a key's line.
shared_prefix = ["<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n"]  # optional

[[key]]
sha256 = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"
tenant = "acme"

[tenant.acme]          # optional: its quota under `--quota` (else the [serve] budget)
quota_key = "acme"     # the budget's name; tenants naming one key share it (default: the name)
rpm = 60
tpm = 100000
```

`shared_prefix` (texts, or `shared_prefix_tokens`: token id lists) declares prompt prefixes
whose KV every tenant may reuse (a common system prompt); everything else a tenant computes
is salted with its name (`tenancy.py`). A file that does not parse, or says something
invalid, is refused whole with one line (`KeysError`): the server does not start, and a
reload keeps the keys it had.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
QUOTA_KEY = re.compile(r"[!-~]{1,120}")  # printable ASCII, no spaces (quota limit keys)
DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_SHARED_PREFIXES = 64


class KeysError(ShoalError):
    """The keys file cannot be used; the message is one line naming the problem."""


def hash_key(key: str) -> str:
    """The keys file's form of an API key: its SHA-256, in hex."""
    return hashlib.sha256(key.strip().encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class TenantSettings:
    quota_key: str | None = None
    rpm: int | None = None
    tpm: int | None = None


@dataclass(slots=True)
class KeysFile:
    keys: dict[bytes, str] = field(default_factory=dict)  # SHA-256 digest -> tenant name
    tenants: dict[str, TenantSettings] = field(default_factory=dict)
    shared_texts: list[str] = field(default_factory=list)
    shared_tokens: list[list[int]] = field(default_factory=list)


def _fail(path: Path, what: str) -> KeysError:
    return KeysError(f"keys file {path}: {' '.join(what.split())}")


def _check(table: Mapping[str, Any], allowed: set[str], where: str, path: Path) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _fail(path, f"{where}: unknown field {unknown[0]!r}")


def _count(table: Mapping[str, Any], name: str, where: str, path: Path) -> int | None:
    value = table.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _fail(path, f"{where}.{name} must be a positive integer")
    return value


def _tenant_name(value: Any, where: str, path: Path) -> str:
    if not isinstance(value, str) or not TENANT_NAME.fullmatch(value):
        raise _fail(path, f"{where}: a tenant name is 1-64 letters, digits, '.', '_' or '-'")
    return value


def _shared(data: Mapping[str, Any], path: Path) -> tuple[list[str], list[list[int]]]:
    texts, tokens = data.get("shared_prefix", []), data.get("shared_prefix_tokens", [])
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
        raise _fail(path, "shared_prefix must be a text or a list of non-empty texts")
    if not isinstance(tokens, list) or not all(
        isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)
        for ids in tokens
    ):
        raise _fail(path, "shared_prefix_tokens must be a list of token id lists")
    if len(texts) + len(tokens) > MAX_SHARED_PREFIXES:
        raise _fail(path, f"at most {MAX_SHARED_PREFIXES} shared prefixes")
    return texts, tokens


def read_keys(path: str | Path) -> KeysFile:
    """The keys file at `path`, checked whole; raises `KeysError`."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise _fail(path, str(e)) from None
    _check(data, {"key", "tenant", "shared_prefix", "shared_prefix_tokens"}, "top level", path)
    found = KeysFile()
    found.shared_texts, found.shared_tokens = _shared(data, path)
    entries = data.get("key", [])
    if not isinstance(entries, list) or not entries:
        raise _fail(path, "no [[key]] entries")
    for i, entry in enumerate(entries):
        where = f"key {i + 1}"
        if not isinstance(entry, dict):
            raise _fail(path, f"{where} must be a table")
        _check(entry, {"sha256", "tenant"}, where, path)
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest.lower()):
            raise _fail(path, f"{where}: sha256 must be 64 hex digits (`shoal keys hash`)")
        tenant = _tenant_name(entry.get("tenant"), where, path)
        raw = bytes.fromhex(digest)
        if found.keys.get(raw, tenant) != tenant:
            raise _fail(path, f"{where}: the same key is given to two tenants")
        found.keys[raw] = tenant
    tenants = data.get("tenant", {})
    if not isinstance(tenants, dict):
        raise _fail(path, "[tenant.NAME] tables hold each tenant's settings")
    for name, table in tenants.items():
        where = f"tenant.{_tenant_name(name, f'tenant {name!r}', path)}"
        if not isinstance(table, dict):
            raise _fail(path, f"{where} must be a table")
        _check(table, {"quota_key", "rpm", "tpm"}, where, path)
        quota_key = table.get("quota_key")
        if quota_key is not None and not (
            isinstance(quota_key, str) and QUOTA_KEY.fullmatch(quota_key)
        ):
            raise _fail(path, f"{where}.quota_key must be printable ASCII without spaces")
        rpm, tpm = _count(table, "rpm", where, path), _count(table, "tpm", where, path)
        found.tenants[name] = TenantSettings(quota_key, rpm, tpm)
    return found
