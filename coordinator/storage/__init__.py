"""What the coordinator keeps on disk besides its state database: signed artifacts, the
checkpoint chain and its retention, and each job's working state and its replay."""
