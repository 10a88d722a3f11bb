"""Django's PostgreSQL compilers, with SELECT shapes kept between queries (``portal.compiler``)."""

from django.db.backends.postgresql import compiler as django_compiler
from django.db.backends.postgresql.compiler import (
    SQLAggregateCompiler,
    SQLDeleteCompiler,
    SQLInsertCompiler,
    SQLUpdateCompiler,
)

from portal.compiler import ShapeMemo

__all__ = [
    "SQLAggregateCompiler",
    "SQLCompiler",
    "SQLDeleteCompiler",
    "SQLInsertCompiler",
    "SQLUpdateCompiler",
]


class SQLCompiler(ShapeMemo, django_compiler.SQLCompiler):
    plain = django_compiler.SQLCompiler
