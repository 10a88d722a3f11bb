"""The API's JSON parser: orjson, with its limit on nesting; and a bounded YAML parser.

DRF's parser uses the standard library, which raises RecursionError (a 500) on a body nested about
a thousand levels deep; orjson refuses nesting past 1,024 levels as bad JSON, so any such body is a
400 naming the limit, as on the agent protocol.
"""

from __future__ import annotations

from rest_framework import parsers
from rest_framework.exceptions import ParseError

from portal.inputs import YAML_MAX_BYTES, json_loads, yaml_loads


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return json_loads(stream.read())
        except ValueError as exc:
            raise ParseError(str(exc)) from None


class YAMLParser(parsers.BaseParser):
    """``application/yaml`` (RFC 9512) bodies, e.g. Kubernetes manifests: ``yaml_loads``'s bounds.
    Only the routes that take YAML list this parser."""

    media_type = "application/yaml"

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return yaml_loads(stream.read(YAML_MAX_BYTES + 1))
        except ValueError as exc:
            raise ParseError(str(exc)) from None
