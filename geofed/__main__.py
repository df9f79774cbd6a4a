"""`python -m geofed` runs the CLI."""

from geofed.cli import main

raise SystemExit(main())
