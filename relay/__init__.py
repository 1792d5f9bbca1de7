"""
relay: a Twisted gateway that pools OpenAI accounts behind one endpoint.

One turn engine (L{relay.engine}) runs every HTTP request and every WebSocket
C{response.create}; entrypoints only adapt transports.
"""

__version__ = "0.1.0"
