"""
Upstream dialers: HTTP (treq), WebSocket (autobahn), and egress proxies.
"""
