"""SELECT statements compiled once per shape: the part of Django's SQL compiler that does not depend on
a query's values, kept between queries of the same shape.

Django compiles every QuerySet anew, and most of that work is the same for every query a view makes:
the column list (forty-odd columns for a workload, with its region's through ``select_related``), the
ordering (each name resolved through the model's fields) and the FROM clause. Under
``bench/scale.py`` the compiler's ``pre_sql_setup`` and ``get_from_clause`` were 13 % of the web
processes' CPU, half of a workload list page's. Only the WHERE clause and the LIMIT depend on
values.

``ShapeMemo`` keys a query by what those parts are computed from (the model, the tables and joins
already in the query and their reference counts, ``select_related``, deferred fields, ordering,
DISTINCT, the row lock) and keeps what they gave the first time (the selected columns, how rows
become instances, the ORDER BY, the FROM clause); the WHERE clause is compiled every time, as
before. Queries it cannot key safely are compiled as Django compiles them: annotations, ``extra()``,
SELECT lists of anything but columns, GROUP BY, set operations, ``distinct(fields)``, ordering by
expressions, filtered relations, queries without a model.

``DB_COMPILE_CACHE``: ``on`` (the default), ``off`` (Django's compiler only) or ``verify``: every
statement made from a kept shape is compiled again by Django's own compiler from a copy of the
query, and any difference in SQL, parameters or row mapping raises (the test suite runs so).
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from django.conf import settings
from django.db.models.expressions import Col
from django.db.models.sql.datastructures import BaseTable, Join
from django.db.models.sql.query import Query
from django.utils.hashable import make_hashable

# Shapes are made by code, not by data: a process has a few hundred. The bound is a guard against a
# caller that builds queries without end (they are then compiled as Django does, uncached).
MAX_SHAPES = 4096


class _Shape:
    __slots__ = ("annotation_col_map", "col_count", "from_", "klass_info", "meta_ordering", "select", "setup")

    def __init__(self, compiler, setup) -> None:
        self.select = compiler.select
        self.klass_info = compiler.klass_info
        self.annotation_col_map = compiler.annotation_col_map
        self.col_count = compiler.col_count
        self.meta_ordering = compiler._meta_ordering
        self.setup = setup  # (extra_select, order_by, group_by), as pre_sql_setup returns them
        self.from_: tuple[list[str], list[Any]] | None = None


def shape_key(compiler, with_col_aliases: bool) -> tuple | None:
    """What the column list, the ordering and the FROM clause of ``compiler.query`` are computed
    from (the columns of ``values()`` by table alias and field); None where that cannot be told
    cheaply and safely."""
    query = compiler.query
    if (
        type(query) is not Query
        or query.model is None
        or query.combinator
        or query.annotations
        or query.extra
        or query.extra_order_by
        or query.extra_tables
        or query.group_by is not None
        or query.distinct_fields
        or query.explain_info is not None
    ):
        return None
    columns = []
    for col in query.select:  # values(), values_list(): columns, and only columns
        if type(col) is not Col:
            return None
        columns.append((col.alias, col.target, col.output_field))
    selected = query.selected
    if selected is not None:
        for index in selected.values():
            if type(index) is not int:
                return None
        selected = tuple(selected.items())
    order_by = query.order_by
    for name in order_by:
        if type(name) is not str:
            return None
    for name in query.model._meta.ordering:
        if type(name) is not str:
            return None
    tables = []
    refcount = query.alias_refcount
    for alias, table in query.alias_map.items():
        kind = type(table)
        if kind is Join:
            if table.filtered_relation is not None:
                return None
            tables.append(
                (alias, table.table_name, table.parent_alias, table.join_field, table.join_type, table.nullable,
                 refcount[alias])
            )  # fmt: skip
        elif kind is BaseTable:
            tables.append((alias, table.table_name, table.table_alias, refcount[alias]))
        else:
            return None
    select_related = query.select_related
    deferred, defer = query.deferred_loading
    return (
        compiler.connection.alias,
        query.model,
        with_col_aliases,
        compiler.elide_empty,
        query.subquery,
        query.alias_prefix,
        tuple(tables),
        tuple((name, tuple(aliases)) for name, aliases in query.table_map.items()),
        query.default_cols,
        tuple(columns),
        selected,
        query.values_select,
        select_related if type(select_related) is bool else make_hashable(select_related),
        query.max_depth,
        frozenset(deferred),
        defer,
        query.distinct,
        order_by,
        query.default_ordering,
        query.standard_ordering,
        query.select_for_update,
        query.select_for_update_of,
    )


def _rows_map(klass_info: dict | None) -> tuple | None:
    """How rows become instances, without the setter functions (made anew by every compilation)."""
    if klass_info is None:
        return None
    return (
        klass_info["model"],
        klass_info.get("field"),
        klass_info.get("reverse"),
        klass_info.get("from_parent"),
        tuple(klass_info["select_fields"]),
        tuple(_rows_map(k) for k in klass_info.get("related_klass_infos", ())),
    )


def _param(value: Any) -> Any:
    """A parameter as compared: by value where it has one, else (adapters without ``__eq__``, such as
    psycopg's ``Jsonb``) by type and representation."""
    if type(value).__eq__ is object.__eq__:
        return type(value), repr(value)
    return value


class ShapeMemo:
    """A mixin before a backend's ``SQLCompiler``; ``plain`` names that backend's own compiler."""

    plain: ClassVar[type]
    _shapes: ClassVar[dict[tuple, _Shape]]
    _shapes_lock: ClassVar[threading.Lock]
    _shape: _Shape | None = None  # this compilation's, kept or being made
    _shape_key: tuple | None = None
    _shape_hit = False  # this compilation used a kept shape

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._shapes = {}
        cls._shapes_lock = threading.Lock()

    def pre_sql_setup(self, with_col_aliases=False):
        self._shape, self._shape_hit = None, False
        if settings.DB_COMPILE_CACHE == "off":
            return super().pre_sql_setup(with_col_aliases=with_col_aliases)
        query = self.query
        if all(query.alias_refcount[a] == 0 for a in query.alias_map):
            query.get_initial_alias()  # as setup_query does first
        key = shape_key(self, with_col_aliases)
        if key is None:
            return super().pre_sql_setup(with_col_aliases=with_col_aliases)
        shape = self._shapes.get(key)
        if shape is None:  # kept once its FROM clause is known (get_from_clause)
            setup = super().pre_sql_setup(with_col_aliases=with_col_aliases)
            self._shape, self._shape_key = _Shape(self, setup), key
            return setup
        self._shape, self._shape_hit = shape, True
        self.select = shape.select
        self.klass_info = shape.klass_info
        self.annotation_col_map = shape.annotation_col_map
        self.col_count = shape.col_count
        self._meta_ordering = shape.meta_ordering
        self.where, self.having, self.qualify = query.where.split_having_qualify(must_group_by=False)
        self.has_extra_select = bool(shape.setup[0])
        return shape.setup

    def get_from_clause(self):
        shape = self._shape
        if shape is None:
            return super().get_from_clause()
        if shape.from_ is None:  # this compilation made the shape
            from_, params = super().get_from_clause()
            if not params and len(self._shapes) < MAX_SHAPES:
                shape.from_ = (from_, params)
                with self._shapes_lock:
                    self._shapes.setdefault(self._shape_key, shape)
            return from_, params
        return shape.from_

    def as_sql(self, with_limits=True, with_col_aliases=False):
        if settings.DB_COMPILE_CACHE != "verify":
            return super().as_sql(with_limits=with_limits, with_col_aliases=with_col_aliases)
        reference = self.plain(self.query.clone(), self.connection, self.using, self.elide_empty)
        sql, params = super().as_sql(with_limits=with_limits, with_col_aliases=with_col_aliases)
        if self._shape_hit:
            expected_sql, expected_params = reference.as_sql(
                with_limits=with_limits, with_col_aliases=with_col_aliases
            )
            if (
                sql != expected_sql
                or list(map(_param, params)) != list(map(_param, expected_params))
                or _rows_map(self.klass_info) != _rows_map(reference.klass_info)
                or self.annotation_col_map != reference.annotation_col_map
            ):
                raise AssertionError(
                    f"a kept query shape compiled differently:\n  kept:   {sql} {params!r}\n"
                    f"  Django: {expected_sql} {expected_params!r}"
                )
        return sql, params
