"""``geofed demo``: a coordinator and regional agents on loopback, training the example task."""
