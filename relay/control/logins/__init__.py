# -*- test-case-name: tests.test_control_logins -*-
"""
ChatGPT logins from the admin API and page (protocol.md 7.5):
L{resource} (HTTP), L{service} (the flows and their rules), L{wire} (the
formats, as Codex's own login code speaks them).
"""
