"""`shoal keys hash`: what a `--keys` file keeps of an API key (its SHA-256), never the key."""

from __future__ import annotations

import argparse
import getpass
import sys

from shoal.cli.formatting import examples


def add_keys(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser(
        "keys",
        help="API keys for shoal serve --keys (one tenant each)",
        description="The keys file of `shoal serve --keys` names each key's tenant and keeps "
        "only its SHA-256 (docs/tenancy.md).",
    )
    verbs = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    h = verbs.add_parser(
        "hash",
        help="read a key and print its keys-file entry",
        description="Read an API key from stdin (or the terminal, not echoed) and print the "
        "line a keys file keeps of it, or a whole [[key]] entry for a tenant.",
        epilog=examples(
            "printf '%s' \"$KEY\" | shoal keys hash --tenant acme >> keys.toml",
            'shoal keys hash                     # asks for the key; prints sha256 = "..."',
        ),
    )
    h.add_argument("--tenant", default=None, metavar="NAME", help="print a whole [[key]] entry")
    h.set_defaults(func=_hash)


def _hash(args: argparse.Namespace) -> int:
    from shoal.server.keys import TENANT_NAME, hash_key

    key = sys.stdin.readline() if not sys.stdin.isatty() else getpass.getpass("API key: ")
    if not key.strip():
        print("shoal keys hash: no key given", file=sys.stderr)
        return 2
    if args.tenant is None:
        print(f'sha256 = "{hash_key(key)}"')
        return 0
    if not TENANT_NAME.fullmatch(args.tenant):
        print("shoal keys hash: a tenant name is 1-64 letters, digits, '.', '_' or '-'",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f'[[key]]\nsha256 = "{hash_key(key)}"\ntenant = "{args.tenant}"')
    return 0
