"""What a region's agent reads of its nodes and GPUs: NVML and host figures (:mod:`.node`),
XID events from the kernel log (:mod:`.xid_events`), their history across restarts
(:mod:`.history`) and their Prometheus metrics (:mod:`.metrics`)."""
