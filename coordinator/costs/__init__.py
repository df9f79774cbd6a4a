"""What jobs cost: the price table, usage folded from the audit log, showback per job and team."""
