"""Example tasks bundled with geofed; ``geofed demo`` trains :mod:`geofed.examples.charlm`."""
