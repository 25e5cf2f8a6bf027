"""A small JSON Schema validator for structured output (no dependencies).

Covers what response schemas use: ``type`` (one or a list), ``enum``,
``const``, ``properties`` / ``required`` / ``additionalProperties`` /
``patternProperties`` / ``minProperties`` / ``maxProperties``, ``items``
(a schema, or a list as in draft 4) / ``prefixItems`` / ``minItems`` /
``maxItems`` / ``uniqueItems``, ``minimum`` / ``maximum`` /
``exclusiveMinimum`` / ``exclusiveMaximum`` / ``multipleOf``,
``minLength`` / ``maxLength`` / ``pattern``, ``anyOf`` / ``oneOf`` /
``allOf`` / ``not``, boolean schemas, and ``$ref`` to ``#``, ``#/$defs/…``
or ``#/definitions/…`` (any local JSON pointer).  Unknown keywords (such as
``format``) are ignored.  ``validate`` returns error strings with a JSON
path (``$.items[2].name: …``); it never raises for a bad instance.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["validate"]

MAX_ERRORS = 20
MAX_DEPTH = 256

_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")


def _type_ok(value: Any, name: str) -> bool:
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if isinstance(value, bool):
        return False
    if name == "number":
        return isinstance(value, (int, float))
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return True  # an unknown type name constrains nothing


def _kind(value: Any) -> str:
    for name in _TYPES:
        if name != "integer" and _type_ok(value, name):
            return name
    return type(value).__name__


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON sees it (``true`` is not ``1``; ``1`` is ``1.0``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        raise LookupError(f"only local $ref is supported: {ref!r}")
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            node = node[int(part)]
        else:
            node = node[part]
    return node


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Validator:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.errors: list[str] = []

    def err(self, path: str, message: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(f"{path}: {message}")

    def ok(self, value: Any, schema: Any, path: str, depth: int) -> bool:
        """Validate into a scratch list: whether ``value`` matches (for anyOf & co)."""
        saved = self.errors
        self.errors = []
        self.check(value, schema, path, depth)
        good = not self.errors
        self.errors = saved
        return good

    def check(self, value: Any, schema: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            self.err(path, "schema nesting too deep (recursive $ref?)")
            return
        if schema is True or schema == {}:
            return
        if schema is False:
            self.err(path, "no value is allowed here")
            return
        if not isinstance(schema, dict):
            return
        d = depth + 1
        if "$ref" in schema:
            try:
                target = _resolve(self.root, schema["$ref"])
            except (LookupError, ValueError, IndexError, TypeError):
                self.err(path, f"unresolvable $ref {schema['$ref']!r}")
            else:
                self.check(value, target, path, d)
        types = schema.get("type")
        if types is not None:
            names = types if isinstance(types, list) else [types]
            if not any(_type_ok(value, str(t)) for t in names):
                self.err(path, f"expected {' or '.join(map(str, names))}, got {_kind(value)}")
                return
        if "enum" in schema and isinstance(schema["enum"], list):
            if not any(json_equal(value, e) for e in schema["enum"]):
                self.err(path, f"{_short(value)} is not one of {_short(schema['enum'])}")
        if "const" in schema and not json_equal(value, schema["const"]):
            self.err(path, f"expected {_short(schema['const'])}")
        for key in ("allOf", "anyOf", "oneOf"):
            subs = schema.get(key)
            if not isinstance(subs, list):
                continue
            if key == "allOf":
                for sub in subs:
                    self.check(value, sub, path, d)
                continue
            matched = sum(1 for sub in subs if self.ok(value, sub, path, d))
            if key == "anyOf" and matched == 0:
                self.err(path, "matches none of anyOf")
            elif key == "oneOf" and matched != 1:
                self.err(path, f"matches {matched} of oneOf (exactly one expected)")
        if "not" in schema and self.ok(value, schema["not"], path, d):
            self.err(path, "must not match the 'not' schema")
        if isinstance(value, dict):
            self.check_object(value, schema, path, d)
        elif isinstance(value, list):
            self.check_array(value, schema, path, d)
        elif isinstance(value, str):
            self.check_string(value, schema, path)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            self.check_number(value, schema, path)

    def check_object(self, value: dict[str, Any], schema: dict[str, Any], path: str, d: int) -> None:
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        for name in schema.get("required") or ():
            if name not in value:
                self.err(path, f"missing required property {name!r}")
        patterns = schema.get("patternProperties")
        patterns = patterns if isinstance(patterns, dict) else {}
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            sub = f"{path}.{key}" if key.isidentifier() else f"{path}[{key!r}]"
            seen = False
            if key in props:
                seen = True
                self.check(item, props[key], sub, d)
            for pattern, pschema in patterns.items():
                if re.search(pattern, key):
                    seen = True
                    self.check(item, pschema, sub, d)
            if not seen:
                if extra is False:
                    self.err(path, f"property {key!r} is not allowed")
                elif isinstance(extra, dict):
                    self.check(item, extra, sub, d)
        n = len(value)
        if isinstance(schema.get("minProperties"), int) and n < schema["minProperties"]:
            self.err(path, f"expected at least {schema['minProperties']} properties")
        if isinstance(schema.get("maxProperties"), int) and n > schema["maxProperties"]:
            self.err(path, f"expected at most {schema['maxProperties']} properties")

    def check_array(self, value: list[Any], schema: dict[str, Any], path: str, d: int) -> None:
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        if isinstance(items, list):  # draft 4 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        start = 0
        if isinstance(prefix, list):
            for i, sub in enumerate(prefix[: len(value)]):
                self.check(value[i], sub, f"{path}[{i}]", d)
            start = len(prefix)
        if items is not None and items is not True:
            for i in range(start, len(value)):
                self.check(value[i], items, f"{path}[{i}]", d)
        n = len(value)
        if isinstance(schema.get("minItems"), int) and n < schema["minItems"]:
            self.err(path, f"expected at least {schema['minItems']} items, got {n}")
        if isinstance(schema.get("maxItems"), int) and n > schema["maxItems"]:
            self.err(path, f"expected at most {schema['maxItems']} items, got {n}")
        if schema.get("uniqueItems") is True:
            for i in range(n):
                if any(json_equal(value[i], value[j]) for j in range(i)):
                    self.err(path, f"items are not unique (item {i})")
                    break

    def check_string(self, value: str, schema: dict[str, Any], path: str) -> None:
        n = len(value)
        if isinstance(schema.get("minLength"), int) and n < schema["minLength"]:
            self.err(path, f"expected at least {schema['minLength']} characters, got {n}")
        if isinstance(schema.get("maxLength"), int) and n > schema["maxLength"]:
            self.err(path, f"expected at most {schema['maxLength']} characters, got {n}")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            try:
                if not re.search(pattern, value):
                    self.err(path, f"does not match pattern {pattern!r}")
            except re.error:
                pass  # a pattern Python cannot compile constrains nothing here

    def check_number(self, value: float, schema: dict[str, Any], path: str) -> None:
        def num(key: str) -> float | None:
            v = schema.get(key)
            return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        lo, hi = num("minimum"), num("maximum")
        xlo, xhi = num("exclusiveMinimum"), num("exclusiveMaximum")
        if schema.get("exclusiveMinimum") is True and lo is not None:  # draft 4
            xlo, lo = lo, None
        if schema.get("exclusiveMaximum") is True and hi is not None:
            xhi, hi = hi, None
        if lo is not None and value < lo:
            self.err(path, f"{value} is less than the minimum {lo}")
        if hi is not None and value > hi:
            self.err(path, f"{value} is greater than the maximum {hi}")
        if xlo is not None and value <= xlo:
            self.err(path, f"{value} is not greater than {xlo}")
        if xhi is not None and value >= xhi:
            self.err(path, f"{value} is not less than {xhi}")
        step = num("multipleOf")
        if step:
            q = value / step
            if not math.isfinite(q) or abs(q - round(q)) > 1e-9:
                self.err(path, f"{value} is not a multiple of {step}")


def validate(value: Any, schema: Any) -> list[str]:
    """Errors of ``value`` against ``schema`` (empty when it conforms; at most 20)."""
    v = _Validator(schema)
    v.check(value, schema, "$", 0)
    return v.errors
