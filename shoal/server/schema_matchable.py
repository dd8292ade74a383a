"""Whether every part of a schema an output could enter matches some finite JSON value.

A `$ref` that leads back to itself, an empty `anyOf`, or an object that requires a property
whose schema requires the object again match nothing finite. Compiled anyway, such a part
lets the model start it and then allows no next token: the answer breaks off (or, at the root,
ends empty with finish reason `stop`). So shoal refuses them before compiling.

The analysis is the textbook one for "productive" grammar symbols, in linear time: a schema is
matchable once each of its requirements (every `allOf` part, its `$ref` target, each required
property's schema, the first `minItems` items, one branch of an `anyOf`/`oneOf`) is; start
from the schemas without requirements and propagate until nothing changes.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from shoal.server.schema_check import SchemaRefusal, Where, field_of, pointer


def _resolve(root: Any, ref: str) -> Any:
    """The local target of a `$ref` (`#`, `#/$defs/x`, ...), or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _entered(node: dict[str, Any], root: Any) -> list[tuple[str, Any]]:
    """(JSON-pointer step, schema object) of the schemas an output inside `node` can enter
    (`true` and `false` need no look: one matches anything, the other is never entered)."""
    out: list[tuple[str, Any]] = []
    for key in ("properties", "patternProperties"):
        if isinstance(node.get(key), dict):
            out += [(f"{key}/{k}", v) for k, v in node[key].items()]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            out += [(f"{key}/{i}", v) for i, v in enumerate(node[key])]
    for key in ("items", "additionalProperties"):
        out.append((key, node.get(key)))
    ref = node.get("$ref")
    if isinstance(ref, str):
        out.append(("$ref", _resolve(root, ref)))
    return [(step, child) for step, child in out if isinstance(child, dict)]


def _requirements(node: dict[str, Any], root: Any) -> list[list[Any]]:
    """What `node` needs: groups of schemas of which at least one must be matchable each
    (`false` never is, and an empty group can never be met; a group with `true` always is)."""
    groups: list[list[Any]] = [[x] for x in field_of(node, "allOf", list)]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            groups.append(list(node[key]))
    ref = node.get("$ref")
    if isinstance(ref, str) and (target := _resolve(root, ref)) is not None:
        groups.append([target])
    props = field_of(node, "properties", dict)
    for name in field_of(node, "required", list):
        if isinstance(name, str) and name in props:
            groups.append([props[name]])
    least = node.get("minItems", 0)
    if isinstance(least, int) and least > 0:
        prefix = field_of(node, "prefixItems", list)
        groups += [[x] for x in prefix[:least]]
        if least > len(prefix) and "items" in node:
            groups.append([node["items"]])
    return [
        [m for m in group if isinstance(m, dict)]
        for group in groups
        if not any(m is True for m in group)
    ]


def check_matchable(schema: Any) -> None:
    """Raises `SchemaRefusal` naming a part of `schema` that matches no finite value."""
    if not isinstance(schema, dict):
        return  # `true` matches anything; xgrammar itself refuses `false`
    ids: dict[int, int] = {}  # id(schema) -> index
    nodes: list[Any] = []
    places: list[Where] = []
    todo: deque[tuple[Any, Where]] = deque([(schema, (None, "#"))])
    while todo:  # breadth first: the shortest path to each part
        node, where = todo.popleft()
        if id(node) in ids:
            continue
        ids[id(node)] = len(nodes)
        nodes.append(node)
        places.append(where)
        if isinstance(node, dict):
            todo.extend((child, (where, step)) for step, child in _entered(node, schema))
    unmet = [0] * len(nodes)  # groups not yet met, per node
    waiting: dict[int, list[tuple[int, int]]] = {}  # member -> (node, group) it can meet
    met: set[tuple[int, int]] = set()
    ready: deque[int] = deque()
    for i, node in enumerate(nodes):
        groups = _requirements(node, schema)
        unmet[i] = len(groups)
        for g, group in enumerate(groups):
            for member in group:
                if id(member) in ids:
                    waiting.setdefault(ids[id(member)], []).append((i, g))
        if not groups:
            ready.append(i)
    matchable = [False] * len(nodes)
    while ready:
        i = ready.popleft()
        matchable[i] = True
        for node_group in waiting.get(i, []):
            if node_group not in met:
                met.add(node_group)
                unmet[node_group[0]] -= 1
                if unmet[node_group[0]] == 0:
                    ready.append(node_group[0])
    for i, ok in enumerate(matchable):
        if not ok:
            what = "the schema" if i == 0 else f"the schema at {pointer(places[i])}"
            raise SchemaRefusal(
                f"{what} matches no finite JSON value (a $ref that leads back to itself, an "
                "empty anyOf, or required properties that recur forever)",
                "unmatchable",
            )
