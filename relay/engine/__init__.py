"""
The turn engine: select -> admit -> dial -> stream -> classify -> decide,
for every entrypoint (architecture.md "The one idea").
"""
