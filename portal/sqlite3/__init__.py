"""Django's SQLite backend, with SELECT shapes kept between queries (``portal.compiler``)."""
