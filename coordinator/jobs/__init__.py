"""Jobs: the spec, submission and its residency and capacity admission, elastic regions,
what a job derives from its spec, its θ_0, recovery, status, and GPU usage."""
