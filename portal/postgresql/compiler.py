"""Django's PostgreSQL compilers, with SELECT shapes kept between queries (``portal.compiler``)."""

from django.db.backends.postgresql import compiler as django_compiler
from django.db.backends.postgresql.compiler import *  # noqa: F403  (the other statements' compilers)

from portal.compiler import ShapeMemo


class SQLCompiler(ShapeMemo, django_compiler.SQLCompiler):
    plain = django_compiler.SQLCompiler
