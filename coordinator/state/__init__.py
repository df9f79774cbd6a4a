"""The coordinator's durable state: the store interface, the SQL schema once for SQLite and
PostgreSQL, the awaitable facade, transactions, and the hash-chained audit log."""
