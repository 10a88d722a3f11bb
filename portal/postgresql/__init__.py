"""Django's PostgreSQL backend with a ``timestamptz`` loader in C (``portal.postgresql.base``)."""
