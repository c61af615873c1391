"""Closed objects: a JSON schema's objects allow only the properties they list, unless the
schema says otherwise (as vLLM's default grammar backend and OpenAI's strict mode do).

JSON Schema's own default lets any other property in. Under a grammar, a small model then
wanders into keys nobody asked for and rambles on until max_tokens."""
from __future__ import annotations

from typing import Any

# Keywords whose values are schemas (one, a list, or a map of names to schemas). Others (enum,
# const, default, examples, not, if/then/else) hold data or negate: they are left as written.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames")
_LIST = ("prefixItems", "items", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_COMBINE = ("allOf", "anyOf", "oneOf", "$ref")


def close_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object that lists `properties`
    and says nothing about additional ones, nested objects and `$defs` included.

    An object combined with others (allOf, or properties beside anyOf/oneOf/$ref) is left
    open: the grammar engine intersects the parts, and closing one part would forbid the
    properties the other parts list. So is any part a `$ref` combines so, wherever it points
    (`$defs`, `#/properties/a`), and what that part refers to or is made of in turn."""
    if not isinstance(schema, dict):
        return schema
    return _close(schema, "#", True, _combined_closure(schema))


def _close(schema: Any, here: str, closable: bool, combined: frozenset[str]) -> Any:
    if not isinstance(schema, dict):
        return schema
    closable = closable and here not in combined
    out = dict(schema)
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub, f"{here}/{key}/{_escape(name)}", True, combined)
                        for name, sub in out[key].items()}
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], f"{here}/{key}", True, combined)
    has_properties = isinstance(out.get("properties"), dict)
    for key in _LIST:
        if isinstance(out.get(key), list):
            # A member of allOf, or of anyOf/oneOf beside properties or inside an open part, meets
            # the other parts' properties.
            members_closable = closable and key != "allOf" and not has_properties
            out[key] = [_close(sub, f"{here}/{key}/{i}", members_closable, combined)
                        for i, sub in enumerate(out[key])]
    says_itself = "additionalProperties" in out or "unevaluatedProperties" in out
    # A required name that `properties` does not list is one more property: closed, no object
    # could have it.
    required = out.get("required") if isinstance(out.get("required"), list) else []
    unlisted = has_properties and any(name not in out["properties"] for name in required)
    if closable and has_properties and not says_itself and not unlisted and not any(k in out for k in _COMBINE):
        out["additionalProperties"] = False
    return out


def _combined_closure(root: dict) -> frozenset[str]:
    """The `$ref`s that point where an object is combined with others, and, in turn, the refs
    found at the top of what they point to (its own $ref, its allOf/anyOf/oneOf members')."""
    found = _combined_refs(root)
    todo = list(found)
    while todo:
        target = _resolve(root, todo.pop())
        for ref in _top_refs(target):
            if ref not in found:
                found.add(ref)
                todo.append(ref)
    return frozenset(found)


def _top_refs(schema: Any) -> set[str]:
    """The refs that make up `schema` itself: its $ref, and its combining members' (recursively)."""
    refs: set[str] = set()
    if not isinstance(schema, dict):
        return refs
    if isinstance(schema.get("$ref"), str):
        refs.add(schema["$ref"])
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                refs |= _top_refs(sub)
    return refs


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local `$ref` ("#/..." JSON pointer) points to; None where it points nowhere."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _combined_refs(schema: Any, combined: bool = False) -> set[str]:
    """The `$ref`s that point where an object is combined with others: a member of allOf, a
    member of anyOf/oneOf beside properties, or a $ref beside properties."""
    found: set[str] = set()
    if isinstance(schema, list):
        for sub in schema:
            found |= _combined_refs(sub, combined)
        return found
    if not isinstance(schema, dict):
        return found
    has_properties = isinstance(schema.get("properties"), dict)
    ref = schema.get("$ref")
    if isinstance(ref, str) and (combined or has_properties or "allOf" in schema):
        found.add(ref)
    for key, value in schema.items():
        if key in _LIST and isinstance(value, list):
            found |= _combined_refs(value, key == "allOf" or (key in ("anyOf", "oneOf") and has_properties))
        elif key in _MAP and isinstance(value, dict):
            for sub in value.values():
                found |= _combined_refs(sub)
        elif key in _ONE and isinstance(value, dict):
            found |= _combined_refs(value)
    return found
