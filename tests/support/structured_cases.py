"""Schemas and prompts for the structured-output tests on the real model (shared by tests and the benchmark)."""

from __future__ import annotations

from typing import Any

S = 40  # maxLength for free-text strings, so a small model cannot ramble until max_tokens

_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": S},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
           "required": ["name", "age"]}

SCHEMA_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("flat person", _PERSON, "Give me a person's name and age."),
    ("flat product", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": S}, "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "in_stock": {"type": "boolean"}}, "required": ["title", "price", "in_stock"]},
     "Describe a laptop for sale with its title, price and whether it is in stock."),
    ("flat city", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": S}, "country": {"type": "string", "maxLength": S},
        "population": {"type": "integer", "minimum": 0, "maximum": 40000000}},
        "required": ["city", "country", "population"]}, "Tell me about Paris."),
    ("enum color", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                    "required": ["color"]}, "What color is the sky?"),
    ("enum sentiment", {"type": "object", "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["sentiment", "confidence"]},
     "Classify the sentiment of: 'I love this phone, the battery is great.'"),
    ("const version", {"type": "object", "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
                       "required": ["version", "ok"]}, "Report status."),
    ("integer range", {"type": "object", "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5}},
                       "required": ["rating"]}, "Rate the movie Titanic from 1 to 5."),
    ("exclusive range", {"type": "object", "properties": {
        "temperature_c": {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60}},
        "required": ["temperature_c"]}, "What is a typical summer temperature in Madrid?"),
    ("negative numbers", {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]},
     "Give the coordinates of Rio de Janeiro."),
    ("integer multipleOf", {"type": "object", "properties": {
        "minutes": {"type": "integer", "multipleOf": 15, "minimum": 0, "maximum": 240}},
        "required": ["minutes"]}, "How long is a typical meeting, in minutes?"),
    ("array bounds", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"]}, "Give tags for a blog post about hiking."),
    ("array of ints", {"type": "object", "properties": {
        "primes": {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 100},
                   "minItems": 3, "maxItems": 5}}, "required": ["primes"]}, "List a few prime numbers."),
    ("top-level array", {"type": "array", "items": {"type": "string", "enum": ["apple", "banana", "cherry"]},
                         "minItems": 1, "maxItems": 3}, "Name some fruits."),
    ("array of objects", {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                   "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["sku", "qty"]}}}, "required": ["items"]}, "Write an order with one or two items."),
    ("tuple prefixItems", {"type": "object", "properties": {"point": {
        "type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False}},
        "required": ["point"]}, "Give a 2D point."),
    ("nested address", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": S},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": S}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "city": {"type": "string", "maxLength": S}}, "required": ["street", "zip", "city"]}},
        "required": ["name", "address"]}, "Give a US customer with an address."),
    ("nested two levels", {"type": "object", "properties": {"company": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": S}, "ceo": _PERSON}, "required": ["name", "ceo"]}},
        "required": ["company"]}, "Describe a company and its CEO."),
    ("optional fields", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": S}, "subtitle": {"type": "string", "maxLength": S},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}, "required": ["title"]},
     "Describe a book."),
    ("nullable", {"type": "object", "properties": {
        "middle_name": {"type": ["string", "null"], "maxLength": S}, "first": {"type": "string", "maxLength": S}},
        "required": ["first", "middle_name"]}, "Give a name; the middle name may be missing."),
    ("anyOf", {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                                                                 {"type": "string", "pattern": "^ID[0-9]{4}$"}]}},
               "required": ["id"]}, "Give an identifier."),
    ("oneOf disjoint", {"type": "object", "properties": {"value": {"oneOf": [
        {"type": "boolean"}, {"type": "string", "maxLength": 10}]}}, "required": ["value"]}, "Is water wet?"),
    ("format date", {"type": "object", "properties": {"event": {"type": "string", "maxLength": S},
                                                      "date": {"type": "string", "format": "date"}},
                     "required": ["event", "date"]}, "When did the first moon landing happen?"),
    ("format email uuid", {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                                            "id": {"type": "string", "format": "uuid"}},
                           "required": ["email", "id"]}, "Create a user account record."),
    ("format ipv4", {"type": "object", "properties": {"host": {"type": "string", "format": "ipv4"},
                                                      "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
                     "required": ["host", "port"]}, "Give a local server address and port."),
    ("string pattern", {"type": "object", "properties": {"phone": {"type": "string",
                                                                   "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}},
                        "required": ["phone"]}, "Give an international phone number."),
    ("string lengths", {"type": "object", "properties": {"code": {"type": "string", "minLength": 4, "maxLength": 6}},
                        "required": ["code"]}, "Make up a short discount code."),
    ("$defs and $ref", {"$defs": {"person": _PERSON}, "type": "object", "properties": {
        "author": {"$ref": "#/$defs/person"}, "reviewer": {"$ref": "#/$defs/person"}},
        "required": ["author", "reviewer"]}, "Name an author and a reviewer of a paper."),
    ("definitions ref array", {"definitions": {"step": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 9}, "do": {"type": "string", "maxLength": 30}},
        "required": ["n", "do"]}}, "type": "object", "properties": {
        "steps": {"type": "array", "items": {"$ref": "#/definitions/step"}, "minItems": 1, "maxItems": 3}},
        "required": ["steps"]}, "How do I make tea? Give the steps."),
    ("chinese enum", {"type": "object", "properties": {"城市": {"type": "string", "enum": ["北京", "上海", "广州"]},
                                                       "人口": {"type": "integer", "minimum": 0, "maximum": 30000000}},
                      "required": ["城市", "人口"]}, "中国的首都是哪里？"),
    ("chinese values", {"type": "object", "properties": {
        "名字": {"type": "string", "maxLength": 8}, "爱好": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                           "minItems": 1, "maxItems": 3}},
        "required": ["名字", "爱好"]}, "请用中文介绍一个人的名字和爱好。"),
    ("additionalProperties map", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                                             "maximum": 100},
                                  "maxProperties": 3}, "Give scores for three students."),
    ("min properties", {"type": "object", "properties": {
        "a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}, "minProperties": 2},
     "Fill in some flags."),
    ("recursive tree", {"$defs": {"node": {"type": "object", "properties": {
        "label": {"type": "string", "maxLength": 12},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["label", "children"]}}, "$ref": "#/$defs/node"}, "Draw a small family tree."),
    ("bool and null", {"type": "object", "properties": {"done": {"type": "boolean"}, "error": {"type": "null"}},
                       "required": ["done", "error"]}, "Report a finished job."),
]

JSON_OBJECT_PROMPTS: list[str] = [
    "Return a JSON object describing a cat.",
    "Give me the weather in Tokyo as a short JSON object.",
    "Describe a book as a JSON object with a title and an author.",
    "Output a JSON object with your favorite color.",
    "Name two planets in a short JSON object.",
    "Create a JSON user profile.",
    "JSON please: the capital of Italy.",
    "Give the name and cooking time of pancakes as JSON.",
    "Convert this to JSON: name Alice, age 31.",
    "A JSON object with three numbers.",
    "Describe a car in JSON.",
    "Return {\"ok\": true} style JSON saying the task succeeded.",
    "用JSON描述一只熊猫。",
    "What is 2+2? Answer as a JSON object.",
    "Give a JSON object for an HTTP error.",
    "Give the author and year of Romeo and Juliet as JSON.",
    "Make a JSON shopping list.",
    "Return a JSON object with a date and a time.",
    "Give the height and city of the Eiffel Tower as JSON.",
    "Write a JSON config for a web server.",
]
