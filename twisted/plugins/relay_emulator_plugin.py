"""
twistd plugin for the bundled OpenAI upstream emulator: C{twistd -n relay-emulator}.
"""

from twisted.application.service import ServiceMaker

relayEmulator = ServiceMaker(
    "Relay upstream emulator", "relay.emulator.tap",
    "An offline OpenAI upstream (Responses HTTP/WebSocket, Chat) with scripted faults.",
    "relay-emulator",
)
