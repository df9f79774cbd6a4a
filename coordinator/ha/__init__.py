"""Several coordinators on one state database: the leader lease (pure decisions and its
PostgreSQL side) and the daemon's leadership loop."""
