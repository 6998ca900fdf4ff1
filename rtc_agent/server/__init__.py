"""The aiohttp + aiortc call server (see app.py for the routes)."""
