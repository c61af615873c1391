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


def close_objects(schema: Any, closable: bool = True) -> Any:
    """`schema` with `"additionalProperties": false` on every object that lists `properties`
    and says nothing about additional ones, nested objects and `$defs` included.

    An object combined with others (allOf, or properties beside anyOf/oneOf/$ref) is left
    open: the grammar engine intersects the parts, and closing one part would forbid the
    properties the other parts list."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    has_properties = isinstance(out.get("properties"), dict)
    for key in _LIST:
        if isinstance(out.get(key), list):
            members_closable = key != "allOf" and not has_properties
            out[key] = [close_objects(sub, members_closable) for sub in out[key]]
    says_itself = "additionalProperties" in out or "unevaluatedProperties" in out
    if closable and has_properties and not says_itself and not any(k in out for k in _COMBINE):
        out["additionalProperties"] = False
    return out
