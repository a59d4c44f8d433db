"""JSON schemas as our grammars read them: an object schema that lists its properties and says
nothing of others admits no others. llama.cpp's grammar converter, XGrammar (vLLM's default,
in its default strict mode) and Outlines read schemas this way; llguidance, which compiles
ours, follows the JSON Schema text (other properties allowed) unless told. So tool-call
arguments keep to the declared parameters, where a model otherwise invents keys (the default
model added "type" and "encoding" to read_file's one parameter, "path"), and the grammar
knows where an object ends. A schema that wants other properties says so:
``"additionalProperties": true`` or a schema for them."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

# How generated JSON is laid out (llguidance's JSON options): one fixed separator each, with
# the space json.dumps writes, so a model cannot pad with whitespace until max_tokens and
# writes JSON as it reads it: the tool calls and tool listings in its prompt are rendered
# with json.dumps or a template's tojson, both ", " and ": ", and prompt lookup then finds an
# earlier call's arguments. Without the spaces (llguidance's default), the default model's
# forced calls to 24 agent asks were complete in 20 (21 with them).
JSON_LAYOUT = MappingProxyType({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})

# where a schema holds subschemas: by name, in a list, or as one
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "propertyNames",
                  "contains", "not", "if", "then", "else")
# an object schema with any of these already says what else it admits, or takes properties
# from elsewhere: left as written
_OPEN_WORDS = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "anyOf", "oneOf",
               "$ref")


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema with ``properties`` and no word on other
    properties gets ``"additionalProperties": false``. The members of an ``allOf`` are left open:
    their properties add up, and closing each would admit no object with both; so is an object
    that requires a key it does not list."""
    return _close(schema, in_all_of=False)


def _close(schema: Any, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub, False) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(sub, key == "allOf") for sub in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), list):  # draft 4-7 tuple "items"
            out[key] = [_close(sub, False) for sub in out[key]]
        elif key in out:
            out[key] = _close(out[key], False)
    if isinstance(schema.get("properties"), dict) and not in_all_of and not any(w in schema for w in _OPEN_WORDS) \
            and not _requires_unlisted(schema):
        out["additionalProperties"] = False
    return out


def _requires_unlisted(schema: dict) -> bool:
    """It requires a key its ``properties`` do not list: it expects others (closed, it would
    admit no object at all)."""
    required = schema.get("required")
    return isinstance(required, list) and any(key not in schema["properties"] for key in required)
