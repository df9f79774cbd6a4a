"""Publishing a closed round: the update, snapshots and when to take them, evaluation
of the global parameters, and lineage."""
