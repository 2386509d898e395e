"""Structured output's grammar from a request's response format, checked in the front end.

A response format becomes an llguidance grammar (llguidance's JSON), checked here so a schema
the node cannot follow is refused (INVALID_ARGUMENT, 400) before the request reaches the
engine core, which compiles it against the model's vocabulary (engine/grammar.py). JSON is
generated compact (no optional whitespace): a small model given free whitespace can spend its
whole answer on it.
"""
from __future__ import annotations

import json

import llguidance

from lora.v1 import inference_pb2

from ..request_builder import BadRequest

# llguidance's JSON options, under whatever a schema's own "x-guidance" says.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}
PARAM = "response_format"


def grammar_of(fmt: inference_pb2.ResponseFormat) -> str:
    """The grammar of a JSON_OBJECT or JSON_SCHEMA response format ("" for TEXT); raises
    BadRequest naming what is wrong with the schema."""
    if fmt.type == inference_pb2.ResponseFormat.TEXT:
        if fmt.json_schema:
            raise BadRequest("response_format has a json_schema but its type is not JSON_SCHEMA", PARAM)
        return ""
    if fmt.type == inference_pb2.ResponseFormat.JSON_OBJECT:
        if fmt.json_schema:
            raise BadRequest("response_format json_object takes no schema (use json_schema)", PARAM)
        schema: object = ANY_OBJECT
    elif fmt.type == inference_pb2.ResponseFormat.JSON_SCHEMA:
        try:
            schema = json.loads(fmt.json_schema)
        except ValueError as exc:
            raise BadRequest(f"response_format's json_schema is not valid JSON: {exc}", PARAM) from None
        except RecursionError:
            raise BadRequest("response_format's json_schema nests too deeply", PARAM) from None
        if not isinstance(schema, (dict, bool)):
            raise BadRequest("response_format's json_schema must be a JSON Schema: an object (or true/false)",
                             PARAM)
    else:
        raise BadRequest(f"response_format has an unknown type {fmt.type}", PARAM)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise BadRequest(f"response_format's json_schema cannot be followed: {problem}", PARAM)
    return grammar
