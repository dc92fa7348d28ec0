"""Checking a request's JSON schema before xgrammar compiles it (``check_schema``): keywords
xgrammar accepts but does not enforce are refused by name, since a constraint that silently does not
hold is worse than a clear 400. The list is what a probe of each keyword found
(tests/cluster/test_structured_compile.py keeps it honest): an instance breaking the keyword
still matched the compiled grammar. So is a string's ``minLength``/``maxLength`` beside a
``pattern`` or ``format``: xgrammar keeps the pattern and drops the length.

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


def check_schema(schema: object, param: str, path: str = "#") -> None:
    """InvalidRequestError if ``schema`` (parsed JSON), or any subschema, uses a keyword the
    grammar would not enforce, or a ``$ref`` outside the document."""
    if isinstance(schema, bool):
        return
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
    has_length = "minLength" in schema or "maxLength" in schema
    if has_length and ("pattern" in schema or "format" in schema):
        raise InvalidRequestError(
            f"The JSON schema at {path} bounds a string's length beside a pattern or format, "
            "which kvray's structured outputs cannot enforce together; write the length into "
            "the pattern.",
            param=param,
        )
    for keyword in ONE_SCHEMA:
        if isinstance(schema.get(keyword), (dict, bool)):
            check_schema(schema[keyword], param, f"{path}/{keyword}")
    for keyword in SCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            for index, item in enumerate(schema[keyword]):
                check_schema(item, param, f"{path}/{keyword}/{index}")
    for keyword in SCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for name, item in schema[keyword].items():
                check_schema(item, param, f"{path}/{keyword}/{name}")
