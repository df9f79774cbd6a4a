"""`python -m geofed_cli` runs the CLI (the ``geofed`` command without its console script)."""

from geofed_cli import run

run()
