"""
twistd plugin: C{twistd -n relay --config FILE}.
"""

from twisted.application.service import ServiceMaker

relay = ServiceMaker(
    "Relay", "relay.tap", "HTTP + WebSocket relay for pooled OpenAI accounts.", "relay"
)
