"""The browser client (``aivedio-client.js``), the demo page and the routes that serve them."""

from aivedio.web.routes import web_routes

__all__ = ["web_routes"]
