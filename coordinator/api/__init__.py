"""The coordinator's HTTP face: the aiohttp application, who is calling, request bodies,
the API handlers (admin, data, export, lineage), the standby's read-only app, and /ui."""
