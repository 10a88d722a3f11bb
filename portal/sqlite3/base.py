"""Django's SQLite backend (``ENGINE = "portal.sqlite3"``), compiling through ``portal.sqlite3.compiler``."""

from django.db.backends.sqlite3 import base, operations


class DatabaseOperations(operations.DatabaseOperations):
    compiler_module = "portal.sqlite3.compiler"


class DatabaseWrapper(base.DatabaseWrapper):
    ops_class = DatabaseOperations
