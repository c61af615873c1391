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


def close_objects(schema: Any, closable: bool = True, combined: frozenset[str] | None = None) -> Any:
    """`schema` with `"additionalProperties": false` on every object that lists `properties`
    and says nothing about additional ones, nested objects and `$defs` included.

    An object combined with others (allOf, or properties beside anyOf/oneOf/$ref) is left
    open: the grammar engine intersects the parts, and closing one part would forbid the
    properties the other parts list. So is a `$defs` entry that a `$ref` combines so."""
    if not isinstance(schema, dict):
        return schema
    if combined is None:
        combined = frozenset(_combined_refs(schema))
    out = dict(schema)
    for key in ("$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub, f"#/{key}/{name}" not in combined, combined)
                        for name, sub in out[key].items()}
    for key in ("properties", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub, True, combined) for name, sub in out[key].items()}
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key], True, combined)
    has_properties = isinstance(out.get("properties"), dict)
    for key in _LIST:
        if isinstance(out.get(key), list):
            members_closable = key != "allOf" and not has_properties
            out[key] = [close_objects(sub, members_closable, combined) for sub in out[key]]
    says_itself = "additionalProperties" in out or "unevaluatedProperties" in out
    if closable and has_properties and not says_itself and not any(k in out for k in _COMBINE):
        out["additionalProperties"] = False
    return out


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
