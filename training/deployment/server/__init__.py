"""The embedded HTTP server: the aiohttp app over an ``AsyncEngine`` (``app.py``), its routes, request
parsing, fields and limits, streaming, and the receiving side of weight pushes. See ../README.md."""
