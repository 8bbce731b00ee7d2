"""A stand-alone fake AI video provider with chaos knobs, for the demo and the tests.

The core never imports this package; ``aivedio sandbox-provider`` runs it as its own app.
"""

from aivedio.sandbox.app import create_app, running, serve
from aivedio.sandbox.config import SandboxConfig

__all__ = ["SandboxConfig", "create_app", "running", "serve"]
