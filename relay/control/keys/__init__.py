# -*- test-case-name: tests.test_control_keys -*-
"""
Client keys issued, edited, disabled and revoked through the admin API:
L{resource} (HTTP), L{service} (the rules), L{records} (how they are
stored).
"""
