"""`python -m geofed` runs the command line, as the ``geofed`` console script does.

An entry point of the face (:mod:`geofed_cli`), not part of the shared core: nothing in
the core imports it (``tests/unit/test_package_graph.py`` holds it to the face's rules).
"""

from geofed_cli import run

run()
