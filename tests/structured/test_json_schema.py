"""JSON schemas allow only the properties they list, unless they say additionalProperties:
checked on the masks and matchers llguidance gives for the embedded model's tokenizer."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchprompt.structured import Grammar, GrammarCompiler
from batchprompt.structured.mask import allowed_tokens

COMPACT = {"whitespace_flexible": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                           "home": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                     "zip": {"type": "string"}}}},
          "required": ["name"]}
KEYS = {"name", "age", "home", "city", "zip"}
VALID = {"name": "Ann", "age": 7, "home": {"city": "Oslo"}}


@pytest.fixture(scope="module")
def compiler(engine32):
    tok = engine32.tokenizer
    return GrammarCompiler(tok.hf, engine32.model.args.vocab_size, tok.eos_token_ids)


def accepts(compiler, engine32, schema: dict, value) -> bool:
    """Whether the grammar of `schema` takes the compact JSON text of `value`, whole."""
    m = compiler.matcher(Grammar.json_schema(schema, COMPACT))
    ids = engine32.tokenizer.encode(json.dumps(value, separators=(",", ":")))
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def next_tokens(compiler, engine32, schema: dict, prefix: str) -> list[str]:
    """The text of every token the mask allows after `prefix`."""
    tok = engine32.tokenizer
    m = compiler.matcher(Grammar.json_schema(schema, COMPACT))
    ids = tok.encode(prefix)
    assert m.try_consume_tokens(ids) == len(ids), prefix
    allowed = allowed_tokens([m], engine32.model.args.vocab_size, torch.device("cpu"))[0]
    return [tok.decode([i]) for i in allowed.nonzero().squeeze(1).tolist()]


def test_after_a_comma_the_mask_allows_only_listed_keys(compiler, engine32):
    # Past "name", a new key can only be "age" or "home": every allowed token starts one.
    for text in next_tokens(compiler, engine32, PERSON, '{"name":"Ann","'):
        assert any(key.startswith(text[:len(key)]) for key in ('age":', 'home":')), text
    # Inside the nested object too: "zip" only.
    for text in next_tokens(compiler, engine32, PERSON, '{"name":"Ann","home":{"city":"Oslo","'):
        assert 'zip":'.startswith(text[:5]), text
    opened = {**PERSON, "additionalProperties": True}
    assert any(t.startswith("z") for t in next_tokens(compiler, engine32, opened, '{"name":"Ann","'))


@settings(max_examples=25, deadline=None)
@given(key=st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8).filter(lambda k: k not in KEYS),
       value=st.one_of(st.integers(-99, 999), st.booleans(), st.text("abc xyz", max_size=6)),
       nested=st.booleans())
def test_an_extra_key_is_refused_unless_the_schema_allows_it(compiler, engine32, key, value, nested):
    doc = json.loads(json.dumps(VALID))
    (doc["home"] if nested else doc)[key] = value
    assert accepts(compiler, engine32, PERSON, VALID)
    assert not accepts(compiler, engine32, PERSON, doc)
    opened = json.loads(json.dumps(PERSON))
    (opened["properties"]["home"] if nested else opened)["additionalProperties"] = True
    assert accepts(compiler, engine32, opened, doc)
    typed = json.loads(json.dumps(PERSON))  # additionalProperties as a schema: its type is kept
    (typed["properties"]["home"] if nested else typed)["additionalProperties"] = {"type": "null"}
    assert not accepts(compiler, engine32, typed, doc)


def test_closing_keeps_data_combinations_and_free_dicts_as_written():
    from batchprompt.structured.json_schema import close_objects

    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
                       "tags": {"type": "object"},  # a free-form dict lists no properties: stays open
                       "pick": {"anyOf": [{"type": "object", "properties": {"a": {"const": 1}}}, {"type": "null"}]},
                       "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
                       "fixed": {"const": {"properties": {"k": 1}}}},
        "$defs": {"Item": {"type": "object", "properties": {"id": {"type": "integer"}}}},
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert set(props) == set(schema["properties"])  # a property named "properties" is a name, not a keyword
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["tags"]
    assert props["pick"]["anyOf"][0]["additionalProperties"] is False
    assert props["both"] == schema["properties"]["both"]  # closing a part of allOf would forbid the others
    assert props["fixed"] == schema["properties"]["fixed"]  # data, not a schema
    assert closed["$defs"]["Item"]["additionalProperties"] is False
    assert close_objects({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"]
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_defs_combined_through_a_ref_stay_open():
    """allOf of two $refs was closed at each $def, so neither part could hold the other's required
    property: refused as unsatisfiable. A $def used alone (or as an anyOf alternative) is closed."""
    from batchprompt.structured.json_schema import close_objects

    def obj(name):
        return {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}

    schema = {"$defs": {"A": obj("x"), "B": obj("y"), "C": obj("z"), "D": obj("w"), "E": obj("v")},
              "type": "object",
              "properties": {"both": {"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
                             "extended": {"$ref": "#/$defs/C", "properties": {"more": {"type": "string"}}},
                             "alone": {"$ref": "#/$defs/D"},
                             "either": {"anyOf": [{"$ref": "#/$defs/E"}, {"type": "null"}]}},
              "required": ["both"]}
    defs = close_objects(schema)["$defs"]
    assert [("additionalProperties" in defs[k]) for k in "ABCDE"] == [False, False, False, True, True]


def test_an_all_of_refs_schema_compiles_and_answers(compiler):
    from batchprompt.structured.compiler import GrammarError  # noqa: F401  (a refusal fails the test)

    schema = {"$defs": {"A": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                        "B": {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}},
              "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}
    assert compiler.matcher(Grammar.json_schema(schema)) is not None


@pytest.mark.parametrize("schema", [
    # allOf through a $ref to a $ref: the second was closed, so "y" of the other part was refused
    {"$defs": {"B": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
               "A": {"$ref": "#/$defs/B"}},
     "allOf": [{"$ref": "#/$defs/A"},
               {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
    # a $ref to a property's schema, combined through allOf: that property was closed
    {"type": "object",
     "properties": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                    "b": {"allOf": [{"$ref": "#/properties/a"},
                                    {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}]}},
     "required": ["a", "b"]},
    # an anyOf inside a combined part: its members met the other part's properties
    {"$defs": {"A": {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                               {"type": "object", "properties": {"z": {"type": "integer"}}, "required": ["z"]}]}},
     "allOf": [{"$ref": "#/$defs/A"},
               {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
    # a required name that properties does not list: closed, the object could not have it
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
])
def test_parts_that_a_ref_combines_stay_open_wherever_they_are(schema):
    from batchprompt.structured.validate import grammar_problem

    assert grammar_problem(Grammar.json_schema(schema)) is None
