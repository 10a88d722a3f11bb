"""Django's compilers for SQLite, with SELECT shapes kept between queries (``portal.compiler``)."""

from django.db.models.sql import compiler as django_compiler
from django.db.models.sql.compiler import (  # noqa: F401  (the other statements' compilers)
    SQLAggregateCompiler,
    SQLDeleteCompiler,
    SQLInsertCompiler,
    SQLUpdateCompiler,
)

from portal.compiler import ShapeMemo


class SQLCompiler(ShapeMemo, django_compiler.SQLCompiler):
    """Django's, with ``ShapeMemo``."""

    plain = django_compiler.SQLCompiler
