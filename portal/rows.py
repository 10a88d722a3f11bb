"""Model instances from a hand-written statement, for the few hot lookups where compiling a QuerySet
costs more than running it (``ModelColumns``, ``Statement``).

Django compiles every QuerySet anew: for the API token lookup (a token and its tenant by key, one
indexed row) the compilation was 0.5 ms of the 0.9 ms the ORM spent, against 0.18 ms for the same
statement sent by hand. ``ModelColumns`` gives a model's column list (from its metadata, so it follows
the model's fields) for a statement's SELECT, and turns that part of a row back into an instance the
way the ORM does: the backend's and the fields' converters (JSON, time zones, decimals), then
``Model.from_db``. Statements stay written with the models' own table and column names.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from django.db.models import Model


class ModelColumns:
    """The concrete columns of ``model`` under a table alias (``names``: only these fields, in this
    order; then ``values``, not ``instance``)."""

    def __init__(self, model: type[Model], alias: str, names: Iterable[str] | None = None) -> None:
        self.model = model
        self.alias = alias
        meta = model._meta
        self.fields = list(meta.concrete_fields) if names is None else [meta.get_field(n) for n in names]
        self.attnames = [f.attname for f in self.fields]
        self._converters: dict[str, list[tuple[int, list, Any]]] = {}

    def __len__(self) -> int:
        return len(self.fields)

    def select(self, connection) -> str:
        """``"alias"."column", ...`` for a SELECT list."""
        return ", ".join(self._column(connection, f) for f in self.fields)

    def table(self, connection) -> str:
        """``"table" "alias"`` for a FROM or a JOIN."""
        qn = connection.ops.quote_name
        return f"{qn(self.model._meta.db_table)} {qn(self.alias)}"

    def select_joined(self, connection, parent: ModelColumns, via: str) -> str:
        """``SELECT`` these columns and ``parent``'s ``FROM`` this table ``INNER JOIN`` the parent's
        on its primary key = this model's foreign key ``via``: the head of a statement that reads a
        row with the row it points to (a WHERE clause and the rest follow)."""
        pk = parent.model._meta.pk.name
        return (
            f"SELECT {self.select(connection)}, {parent.select(connection)} FROM {self.table(connection)}"
            f" INNER JOIN {parent.table(connection)}"
            f" ON {parent.column(connection, pk)} = {self.column(connection, via)}"
        )

    def column(self, connection, name: str) -> str:
        """``"alias"."column"`` of the model's field ``name`` (any field, selected or not)."""
        return self._column(connection, self.model._meta.get_field(name))

    def _column(self, connection, field) -> str:
        qn = connection.ops.quote_name
        return f"{qn(self.alias)}.{qn(field.column)}"

    def values(self, connection, values) -> list[Any]:
        """This part of a row (``len(self)`` values in field order) as the ORM reads it."""
        converters = self._converters.get(connection.alias)
        if converters is None:
            converters = self._converters[connection.alias] = self._converters_for(connection)
        values = list(values)
        for i, functions, expression in converters:
            value = values[i]
            for fn in functions:
                value = fn(value, expression, connection)
            values[i] = value
        return values

    def instance(self, connection, values) -> Model:
        """The model instance of this part of a row (``len(self)`` values in field order)."""
        return self.model.from_db(connection.alias, self.attnames, self.values(connection, values))

    def _converters_for(self, connection) -> list[tuple[int, list, Any]]:
        """As the compiler's ``get_converters``: the backend's, then the field's, per column."""
        out = []
        for i, field in enumerate(self.fields):
            expression = field.get_col(self.alias)
            backend = connection.ops.get_db_converters(expression)
            functions = backend + expression.get_db_converters(connection)
            if functions:
                out.append((i, functions, expression))
        return out


class Statement:
    """A hand-written statement, written once per database vendor and shape instead of on every
    call: ``build(connection, *shape)`` returns the SQL, where ``shape`` is whatever changes its
    text (the number of placeholders of an ``IN`` list). Used as a decorator on ``build``;
    ``sql(connection, *shape)`` gives the text."""

    # Shapes are few (an IN list is as long as a page at most); past this many the text is written
    # each time instead of kept.
    MAX_SHAPES = 256

    def __init__(self, build: Callable[..., str]) -> None:
        self.build = build
        self._sql: dict[tuple, str] = {}

    def sql(self, connection, *shape: Hashable) -> str:
        key = (connection.vendor, *shape)
        sql = self._sql.get(key)
        if sql is None:
            sql = self.build(connection, *shape)
            if len(self._sql) < self.MAX_SHAPES:
                self._sql[key] = sql
        return sql
