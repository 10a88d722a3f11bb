"""Django's compilers, with SELECT shapes kept between queries (``portal.compiler``)."""

from django.db.models.sql import compiler as django_compiler
from django.db.models.sql.compiler import (
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
