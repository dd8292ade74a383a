"""The keys file and the tenants it names (no server): what parses, the one line a bad file
gets, who a key opens the server to, namespaces and KV salts, reloads that keep the old keys
when the new file is bad, and `shoal keys hash`."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from shoal.cli import main as shoal_main
from shoal.engine.hashing import Salt
from shoal.server.keys import KeysError, hash_key, read_keys
from shoal.server.tenancy import DEFAULT, UNKEYED, SharedPrefixes, Tenancy, Tenant

A, B = hash_key("key-a"), hash_key("key-b")
GOOD = f"""
shared_prefix = "You are helpful."
shared_prefix_tokens = [[1, 2, 3]]
[[key]]
sha256 = "{A}"
tenant = "acme"
[[key]]
sha256 = "{B.upper()}"
tenant = "beta.team-2"
[tenant.acme]
quota_key = "team:acme"
rpm = 10
tpm = 5000
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return path


def test_a_good_file_parses(tmp_path: Path) -> None:
    f = read_keys(write(tmp_path, GOOD))
    assert f.keys == {bytes.fromhex(A): "acme", bytes.fromhex(B): "beta.team-2"}
    assert f.tenants["acme"].quota_key == "team:acme" and f.tenants["acme"].rpm == 10
    assert f.shared_texts == ["You are helpful."] and f.shared_tokens == [[1, 2, 3]]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[[key]\n", "Expected"),  # not TOML
        ("", "no [[key]] entries"),
        ('[[key]]\nsha256 = "abc"\ntenant = "a"\n', "64 hex digits"),
        (f'[[key]]\nsha256 = "{A}"\ntenant = "a b"\n', "tenant name"),
        (
            f'[[key]]\nsha256 = "{A}"\ntenant = "a"\n[[key]]\nsha256 = "{A}"\ntenant = "b"\n',
            "two tenants",
        ),
        (f'[[key]]\nsha256 = "{A}"\ntenant = "a"\nrole = "admin"\n', "unknown field 'role'"),
        (f'[[key]]\nsha256 = "{A}"\ntenant = "a"\n[tenant.a]\nrpm = 0\n', "positive integer"),
        (f'[[key]]\nsha256 = "{A}"\ntenant = "a"\n[tenant.a]\nquota_key = "a b"\n', "ASCII"),
        (f'shared_prefix = [""]\n[[key]]\nsha256 = "{A}"\ntenant = "a"\n', "non-empty texts"),
        (f'shared_prefix_tokens = [[-1]]\n[[key]]\nsha256 = "{A}"\ntenant = "a"\n', "token id"),
    ],
)
def test_a_bad_file_is_refused_in_one_line(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(KeysError) as e:
        read_keys(write(tmp_path, text))
    message = str(e.value)
    assert why in message and "\n" not in message and str(tmp_path) in message


def test_who_a_key_opens_the_server_to(tmp_path: Path) -> None:
    assert Tenancy().authenticate(None) is UNKEYED  # no key, no file: everyone, as before
    single = Tenancy("sekrit")
    assert single.authenticate(b"sekrit") is UNKEYED
    assert single.authenticate(b"wrong") is None and single.authenticate(None) is None
    keyed = Tenancy("operator", write(tmp_path, GOOD))
    acme = keyed.authenticate(b"key-a")
    assert acme is not None and acme.namespaced
    assert (acme.name, acme.quota_key, acme.rpm) == ("acme", "team:acme", 10)
    beta = keyed.authenticate(b" key-b\n")  # surrounding blanks are not part of a key
    assert beta is not None and (beta.name, beta.quota_key) == ("beta.team-2", "beta.team-2")
    operator = keyed.authenticate(b"operator")
    assert operator is not None and operator.name == DEFAULT and operator.namespaced
    assert keyed.authenticate(b"key-c") is None and keyed.authenticate(None) is None
    gone = keyed.tenant("left")  # a batch's owner the file no longer names
    assert (gone.name, gone.namespaced, gone.quota_key) == ("left", True, "left")


def test_the_api_key_cannot_be_another_tenants(tmp_path: Path) -> None:
    with pytest.raises(KeysError, match="--api-key"):
        Tenancy("key-a", write(tmp_path, GOOD))


def test_names_and_salts_are_the_tenants_own() -> None:
    acme = Tenant("acme", namespaced=True)
    assert acme.scoped("s1") == "acme/s1" and acme.own("acme/s1") == "s1"
    assert acme.own("beta/s1") is None and acme.own("acme") is None
    assert UNKEYED.scoped("s1") == "s1" and UNKEYED.own("x/y") == "x/y"
    assert UNKEYED.kv_scope(None).salt is None  # no keys: the KV everyone shared before
    assert Tenant(DEFAULT, namespaced=True).kv_scope(None).salt is None
    salts = {
        Tenant("acme", True).kv_scope(None).salt,
        Tenant("beta", True).kv_scope(None).salt,
        Tenant("acme", True).kv_scope("x").salt,
        Tenant("beta", True).kv_scope("x").salt,
        UNKEYED.kv_scope("x").salt,
        UNKEYED.kv_scope("acme").salt,  # a cache_salt is never a tenant's name
    }
    assert None not in salts and len(salts) == 6


def test_a_declared_prefix_covers_the_full_blocks_it_agrees_with() -> None:
    shared = SharedPrefixes(((1, 2, 3, 4, 5, 6, 7, 8, 9),))
    assert shared.blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4) == 2
    assert shared.blocks([1, 2, 3, 4, 5, 0, 7, 8, 9, 10], 4) == 1  # agrees for 5 tokens
    assert shared.blocks([0, 1, 2, 3], 4) == 0
    scope = Tenant("acme", True, shared=shared).kv_scope(None)
    salt = scope.salt_for([1, 2, 3, 4, 5, 6, 7, 8, 42], 4)
    assert isinstance(salt, Salt) and salt.shared_blocks == 2


def test_a_reload_takes_a_good_file_and_keeps_the_keys_over_a_bad_one(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    tenancy = Tenancy(keys_path=path)
    path.write_text("not = [toml")
    with pytest.raises(KeysError):
        tenancy.reload()
    assert tenancy.authenticate(b"key-a") is not None
    path.write_text(f'[[key]]\nsha256 = "{hash_key("key-new")}"\ntenant = "acme"\n')
    tenancy.reload()
    assert tenancy.authenticate(b"key-a") is None
    new = tenancy.authenticate(b"key-new")
    assert new is not None and new.quota_key == "acme"  # its settings left with the old file


def test_shoal_keys_hash_prints_an_entry_the_file_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("key-a\n"))
    assert shoal_main(["keys", "hash", "--tenant", "acme"]) == 0
    entry = capsys.readouterr().out
    assert read_keys(write(tmp_path, entry)).keys == {bytes.fromhex(A): "acme"}
    monkeypatch.setattr("sys.stdin", io.StringIO("key-a\n"))
    assert shoal_main(["keys", "hash"]) == 0
    assert capsys.readouterr().out.strip() == f'sha256 = "{A}"'
