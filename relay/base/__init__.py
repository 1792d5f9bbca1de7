"""
The floor every part stands on: the records a turn is made of (accounts,
keys, settings, the turn, client errors), the one model-name normaliser
(R110), request ids, the structured log, and Deferred helpers. Imports nothing of relay
but L{relay.interfaces}.
"""
