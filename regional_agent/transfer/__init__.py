"""What crosses the WAN: the coordinator client, reaching θ_r (updates and resyncs),
prefetching downloads, resumable uploads, and the ``transfer`` settings."""
