"""What issue 18's acceptance run asks for: 22 answer schemas (nested objects, arrays, enums,
required fields, bounded numbers), two tools and the pydantic models the SDK helpers parse into.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

S = {"type": "string", "maxLength": 40}
I = {"type": "integer"}  # noqa: E741
B = {"type": "boolean"}


def obj(required: bool = True, **props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required else []}


# (what to ask for, the schema the answer must follow)
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", obj(name=S, age={"type": "integer", "minimum": 0, "maximum": 120})),
    ("a book", obj(title=S, author=S, year={"type": "integer", "minimum": 1450, "maximum": 2030})),
    ("a city", obj(name=S, country=S, population={"type": "integer", "minimum": 0})),
    ("a product", obj(name=S, price={"type": "number", "minimum": 0, "maximum": 10000})),
    ("a colour", obj(name=S, hex={"type": "string", "pattern": "^#[0-9a-f]{6}$"})),
    ("a weather report", obj(city=S, celsius={"type": "number", "minimum": -60, "maximum": 60})),
    ("a task", obj(title=S, done=B, priority={"enum": ["low", "medium", "high"]})),
    ("a pet", obj(name=S, species={"enum": ["cat", "dog", "fish", "bird"]}, age=I)),
    ("a movie", obj(title=S, genres={"type": "array", "items": S, "minItems": 1, "maxItems": 3})),
    ("a shopping list", obj(items={"type": "array", "items": S, "maxItems": 5})),
    ("a point", obj(x={"type": "number"}, y={"type": "number"})),
    ("a rectangle", obj(top_left=obj(x=I, y=I), bottom_right=obj(x=I, y=I))),
    (
        "a user account",
        obj(
            user=obj(name=S, email=S),
            roles={
                "type": "array",
                "items": {"enum": ["admin", "editor", "viewer"]},
                "maxItems": 3,
            },
        ),
    ),
    ("an address", obj(street=S, city=S, zip={"type": "string", "pattern": "^[0-9]{5}$"})),
    (
        "a date",
        obj(
            year={"type": "integer", "minimum": 1900, "maximum": 2100},
            month={"type": "integer", "minimum": 1, "maximum": 12},
            day={"type": "integer", "minimum": 1, "maximum": 31},
        ),
    ),
    (
        "a recipe",
        obj(
            name=S,
            ingredients={
                "type": "array",
                "items": obj(item=S, grams={"type": "integer", "minimum": 1, "maximum": 5000}),
                "minItems": 1,
                "maxItems": 4,
            },
        ),
    ),
    ("a review", obj(stars={"type": "integer", "minimum": 1, "maximum": 5}, text=S, recommend=B)),
    ("a song", obj(title=S, artist=S, seconds={"type": "integer", "minimum": 30, "maximum": 900})),
    (
        "a flight",
        obj(
            origin={"type": "string", "pattern": "^[A-Z]{3}$"},
            destination={"type": "string", "pattern": "^[A-Z]{3}$"},
            stops={"type": "integer", "minimum": 0, "maximum": 3},
        ),
    ),
    (
        "a team",
        obj(
            name=S,
            members={"type": "array", "items": obj(name=S, lead=B), "minItems": 1, "maxItems": 3},
        ),
    ),
    (
        "a planet",
        obj(
            name=S,
            moons={"type": "integer", "minimum": 0, "maximum": 100},
            rings=B,
            optional_note=S,
            required=False,
        ),
    ),
    (
        "an order",
        obj(
            id={"type": "integer", "minimum": 1},
            status={"enum": ["new", "paid", "shipped"]},
            lines={
                "type": "array",
                "items": obj(sku=S, qty={"type": "integer", "minimum": 1, "maximum": 9}),
                "maxItems": 3,
            },
        ),
    ),
]

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": obj(
            a={"type": "integer", "minimum": -1000, "maximum": 1000},
            b={"type": "integer", "minimum": -1000, "maximum": 1000},
        ),
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": obj(city=S, unit={"enum": ["celsius", "fahrenheit"]}),
    },
}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, WEATHER)}


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    city: Literal["Paris", "Tokyo", "Lima", "Oslo"]


class GetWeather(BaseModel):
    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]
