"""Starting, supervising and stopping a region's worker group: locally, across nodes, or
under Slurm, with the rank count decided and logged with its reason."""
