"""The simulated inference engine: a pure core and an aiohttp server."""
