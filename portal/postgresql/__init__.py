"""Django's PostgreSQL backend, with the connection pool's check of ``base.check_connection``."""
