"""The URL resolver's routes, walked, for the tests that cover every route without listing them."""

from __future__ import annotations

from collections.abc import Iterator

from django.urls import URLPattern, URLResolver, get_resolver


def walk_urls(patterns=None, prefix: str = "", namespace: str = "") -> Iterator[tuple[str, str, URLPattern]]:
    """(route, namespaced name, pattern) for every URL pattern, includes followed."""
    for p in get_resolver().url_patterns if patterns is None else patterns:
        if isinstance(p, URLResolver):
            ns = f"{namespace}{p.namespace}:" if p.namespace else namespace
            yield from walk_urls(p.url_patterns, prefix + str(p.pattern), ns)
        elif isinstance(p, URLPattern):
            yield prefix + str(p.pattern), f"{namespace}{p.name}", p
