"""A request's JSON schema made ready for xgrammar (``prepare_schema``): keywords xgrammar
accepts but does not enforce are refused by name, since a constraint that silently does not
hold is worse than a clear 400; and string lengths are rewritten into a pattern. The list is
what a probe of each keyword found (tests/cluster/test_structured_compile.py keeps it honest):
an instance breaking the keyword still matched the compiled grammar.

Strings with ``minLength``/``maxLength``: xgrammar (0.2.9) writes their characters as any but
quote, backslash and line breaks, so other control characters come out raw, which is not
JSON. The same bounds as a pattern exclude them (and, as before, escapes); a pattern together
with a length is refused, since xgrammar would drop the length.

Annotations (``title``, ``description``, ``default``, ``examples``, ``$schema``...) are not
constraints and pass.
"""

from __future__ import annotations

from cluster.validation import InvalidRequestError

UNENFORCED = {
    "allOf": "list the combined constraints in one schema",
    "not": "describe what is allowed instead",
    "if": "use anyOf over the cases",
    "then": "use anyOf over the cases",
    "else": "use anyOf over the cases",
    "uniqueItems": "drop it and check uniqueness after parsing",
    "contains": "use prefixItems or items",
    "minContains": "use prefixItems or items",
    "maxContains": "use prefixItems or items",
    "dependentRequired": "list the properties in required",
}
# Keywords whose value is one schema, a list of schemas, or a map from names to schemas: the
# only places a subschema can sit (a property named "not" is a name, not the keyword).
ONE_SCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
              "propertyNames", "additionalItems", "contains", "not", "if", "then",
              "else")  # fmt: skip
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def prepare_schema(schema: object, param: str, path: str = "#"):
    """``schema`` (parsed JSON) as xgrammar should compile it; InvalidRequestError if it, or
    any subschema, uses a keyword the grammar would not enforce, or a ``$ref`` outside the
    document."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            f"The JSON schema at {path} must be an object or a boolean, got "
            f"{type(schema).__name__}",
            param=param,
        )
    for keyword, instead in UNENFORCED.items():
        if keyword in schema:
            raise InvalidRequestError(
                f"The JSON schema uses '{keyword}' at {path}, which kvray's structured outputs "
                f"cannot enforce; {instead}.",
                param=param,
            )
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise InvalidRequestError(
            f"The JSON schema's $ref at {path} is {ref!r}: only references within the schema "
            "('#/...') are supported.",
            param=param,
        )
    schema = _string_lengths_as_pattern(schema, param, path)
    for keyword in ONE_SCHEMA:
        if isinstance(schema.get(keyword), (dict, bool)):
            schema[keyword] = prepare_schema(schema[keyword], param, f"{path}/{keyword}")
    for keyword in SCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            schema[keyword] = [
                prepare_schema(item, param, f"{path}/{keyword}/{index}")
                for index, item in enumerate(schema[keyword])
            ]
    for keyword in SCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            schema[keyword] = {
                name: prepare_schema(item, param, f"{path}/{keyword}/{name}")
                for name, item in schema[keyword].items()
            }
    return schema


# JSON string characters with no escape: anything but control characters, quote, backslash.
_PLAIN_CHARACTER = '[^\\x00-\\x1f"\\\\]'


def _string_lengths_as_pattern(schema: dict, param: str, path: str) -> dict:
    """A copy of ``schema``, its string length bounds written as a pattern."""
    schema = dict(schema)
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is None and high is None:
        return schema
    if "pattern" in schema or "format" in schema:
        raise InvalidRequestError(
            f"The JSON schema at {path} bounds a string's length beside a pattern or format, "
            "which kvray's structured outputs cannot enforce together; write the length into "
            "the pattern.",
            param=param,
        )
    if not all(isinstance(v, int) and v >= 0 for v in (low or 0, high or 0)):
        raise InvalidRequestError(
            f"minLength and maxLength at {path} must be non-negative integers", param=param
        )
    schema.pop("minLength", None)
    schema.pop("maxLength", None)
    bounds = f"{low or 0},{'' if high is None else high}"
    schema["pattern"] = f"^{_PLAIN_CHARACTER}{{{bounds}}}$"
    return schema
