"""A delta on its way in: its checks, its stream into the blob store, the upload spool,
and the shared durable commits that record its frames."""
