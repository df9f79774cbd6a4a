"""geofed: multi-region federated training with compressed deltas under residency policy."""

__version__ = "0.1.0"
