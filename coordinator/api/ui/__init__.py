"""The coordinator's status page, ``GET /ui``: one server-rendered HTML page.

Pure parts turn facts into markup (:mod:`.svg` charts, :mod:`.page` the page) and fold
the audit log into per-job histories (:mod:`.history`); :mod:`.handler` is the thin
aiohttp handler that gathers the facts and answers. Every string that came from
outside (region and job names, audit details, errors) is escaped where it is written.
"""
