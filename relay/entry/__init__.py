"""
Entrypoints: twisted.web resources and the Responses WebSocket. They adapt
transports to L{relay.base.records.Turn}s and sinks; they hold no policy.
"""
