"""Example tasks bundled with geofed: :mod:`geofed.examples.charlm` (which ``geofed demo``
trains) and :mod:`geofed.examples.llama`, on the same byte corpus."""
