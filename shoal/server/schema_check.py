"""What a request's JSON schema must be before anything compiles it: within the limits OpenAI
documents for strict structured outputs (configurable), matchable, and, in strict mode, made
only of what the grammar engine enforces. Each refusal names its rule.

- `check_limits`: object properties in all, nesting depth, enum values in all, the characters
  of property names, definition names, enum and const values, and of one string enum of more
  than 250 values. A schema past them could take the server's memory or minutes to compile.
- `check_strict`: xgrammar (0.2.8) compiles some keywords to nothing: `not`, `if`/`then`/
  `else`, `contains`, `dependentRequired`, `uniqueItems`, look-arounds in a `pattern`, ... An
  answer constrained without them can break them, so strict mode refuses them (non-strict
  mode compiles the rest, best effort). `UNENFORCED` and the checks below list them all.
- `check_matchable` (`schema_matchable`): a schema, or a part the output could enter, that no
  finite value matches ($ref loops, required properties that recur forever).

Pure functions over the parsed JSON, without recursion (a deep schema costs no stack).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shoal.errors import InvalidRequestError

LARGE_ENUM = 250  # OpenAI bounds the characters of a string enum with more values than this

# Subschemas by the keyword that holds them: a map of them, a list of them, or one.
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SINGLE = (
    "items",
    "additionalProperties",
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
NESTING = {"properties", "patternProperties", "additionalProperties", "items", "prefixItems"}

UNENFORCED = {
    "not": "not",
    "if": "if/then/else",
    "then": "if/then/else",
    "else": "if/then/else",
    "contains": "contains",
    "minContains": "contains",
    "maxContains": "contains",
    "dependentRequired": "dependentRequired",
    "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies",
    "$dynamicRef": "$dynamicRef",
    "$recursiveRef": "$recursiveRef",
}
# Standard string formats xgrammar does not check (unknown formats are annotations).
UNCHECKED_FORMATS = {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"}
# Keywords that constrain nothing: allowed next to `$ref`, `anyOf`, `oneOf` and `allOf`, whose
# other neighbours xgrammar drops.
ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$comment",
    "$schema",
    "$id",
    "$anchor",
    "$defs",
    "definitions",
    "discriminator",
}
COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_JSON_TYPES: dict[str, type] = {"string": str, "null": type(None), "array": list, "object": dict}


class SchemaRefusal(InvalidRequestError):
    """A schema shoal will not compile; `reason` is what `/metrics` counts it under."""

    def __init__(self, message: str, reason: str, param: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.param = param


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """OpenAI's documented limits for strict structured outputs (`--max-schema-*`)."""

    properties: int = 5000  # object properties in all
    depth: int = 10  # levels of nesting
    enum_values: int = 1000  # enum values in all
    chars: int = 120_000  # characters of property and definition names, enum and const values
    large_enum_chars: int = 15_000  # characters of one string enum of more than 250 values

    def __post_init__(self) -> None:
        if min(self.properties, self.depth, self.enum_values, self.chars) < 1:
            raise InvalidRequestError("schema limits must be positive")


def field_of(node: dict[str, Any], key: str, kind: type[Any]) -> Any:
    """`node[key]` if it is of `kind` (a dict or a list), else an empty one."""
    value = node.get(key)
    return value if isinstance(value, kind) else kind()


def subschemas(node: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(keyword, JSON-pointer step, subschema) of every schema directly inside `node`."""
    for key in MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, child in value.items():
                yield key, f"{key}/{name}", child
    for key in LISTS:
        value = node.get(key)
        if isinstance(value, list):
            for i, child in enumerate(value):
                yield key, f"{key}/{i}", child
    for key in SINGLE:
        value = node.get(key)
        if isinstance(value, dict | bool):
            yield key, key, value


Where = tuple["Where | None", str]  # (the parent's place, the step from it): a JSON pointer


def pointer(where: Where | None) -> str:
    """The JSON pointer of a place, built only when a message needs it (building each one
    while walking would cost the square of a deep schema's depth)."""
    steps: list[str] = []
    while where is not None:
        where, step = where
        steps.append(step)
    return "/".join(reversed(steps))


def walk(schema: Any) -> Iterator[tuple[dict[str, Any], int, Where]]:
    """Every schema object in `schema` with its nesting depth and place."""
    stack: list[tuple[Any, int, Where]] = [(schema, 0, (None, "#"))]
    while stack:
        node, depth, where = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, depth, where
        for key, step, child in subschemas(node):
            stack.append((child, depth + (key in NESTING), (where, step)))


def _chars(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value))


def check_limits(schema: Any, limits: SchemaLimits) -> None:
    """Raises `SchemaRefusal` naming the first limit `schema` is past."""
    properties = enum_values = chars = 0

    def refuse(what: str, name: str) -> None:
        raise SchemaRefusal(f"{what} (the {name} limit)", "limit")

    for node, depth, where in walk(schema):
        if depth > limits.depth:
            refuse(
                f"the schema nests deeper than {limits.depth} levels at {pointer(where)}",
                "max_schema_depth",
            )
        props = node.get("properties")
        if isinstance(props, dict):
            properties += len(props)
            chars += sum(map(len, props))
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                chars += sum(map(len, node[key]))
        if "const" in node:
            chars += _chars(node["const"])
        enum = node.get("enum")
        if isinstance(enum, list):
            enum_values += len(enum)
            enum_chars = sum(map(_chars, enum))
            chars += enum_chars
            strings = all(isinstance(v, str) for v in enum)
            if strings and len(enum) > LARGE_ENUM and enum_chars > limits.large_enum_chars:
                refuse(
                    f"the enum at {pointer(where)} has {len(enum)} values of more than "
                    f"{limits.large_enum_chars} characters in all",
                    "max_schema_large_enum_chars",
                )
        if properties > limits.properties:
            refuse(
                f"the schema has more than {limits.properties} object properties",
                "max_schema_properties",
            )
        if enum_values > limits.enum_values:
            refuse(
                f"the schema has more than {limits.enum_values} enum values",
                "max_schema_enum_values",
            )
        if chars > limits.chars:
            refuse(
                "the schema's property names, definition names, enum and const values have "
                f"more than {limits.chars} characters",
                "max_schema_chars",
            )


def _is_type(value: Any, name: str) -> bool:
    """Whether a JSON value is of a JSON Schema type."""
    if isinstance(value, bool):
        return name == "boolean"
    if isinstance(value, int | float):
        return name == "number" or (name == "integer" and float(value).is_integer())
    return isinstance(value, _JSON_TYPES.get(name, ()))


def _unenforced(node: dict[str, Any]) -> str | None:
    """The first keyword of this schema object xgrammar would not enforce, or None."""
    for key in node:
        if key in UNENFORCED:
            return UNENFORCED[key]
    if node.get("uniqueItems") is True:
        return "uniqueItems"
    for key in ("allOf", "oneOf"):
        if isinstance(node.get(key), list) and len(node[key]) > 1:
            return f"{key} with several subschemas"
    combinator = next((k for k in COMBINATORS if k in node), None)
    if combinator is not None:
        extra = sorted(node.keys() - ANNOTATIONS - set(COMBINATORS))
        if extra:
            return f"{extra[0]} next to {combinator}"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"$ref to another document ({ref})"
    if "multipleOf" in node and not (
        node.get("type") == "integer" and isinstance(node["multipleOf"], int)
    ):
        return "multipleOf of a number that is not an integer"
    if node.get("format") in UNCHECKED_FORMATS:
        return f"format {node['format']}"
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    patterns += list(field_of(node, "patternProperties", dict))
    if any(_LOOKAROUND.search(p) for p in patterns):
        return "look-arounds in a pattern"
    if {"pattern", "format"} & node.keys() and {"minLength", "maxLength"} & node.keys():
        return "minLength/maxLength together with pattern or format"
    properties = field_of(node, "properties", dict)
    missing = [r for r in field_of(node, "required", list) if r not in properties]
    if missing:
        return f"required {missing[0]!r}, which properties does not define"
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    values = list(node.get("enum") or []) + ([node["const"]] if "const" in node else [])
    if types and any(not any(_is_type(v, t) for t in types) for v in values):
        return "enum or const values that its type excludes"
    return None


def check_strict(schema: Any) -> None:
    """Raises `SchemaRefusal` naming the first keyword strict mode cannot enforce."""
    for node, _, where in walk(schema):
        what = _unenforced(node)
        if what is not None:
            raise SchemaRefusal(
                f"strict mode cannot enforce {what} (at {pointer(where)}): remove it, or set "
                "strict to false to have it ignored",
                "strict",
            )


def check_arguments_schema(schema: dict[str, Any] | None) -> None:
    """A tool's arguments are a JSON object: its schema's type must say so."""
    if schema and schema.get("type") != "object":
        raise SchemaRefusal(
            'a tool\'s arguments are a JSON object: its schema needs "type": "object" '
            f"(got {json.dumps(schema.get('type'))})",
            "not_object",
        )
