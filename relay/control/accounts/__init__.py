# -*- test-case-name: tests.test_control -*-
"""
Accounts changed through the admin API (issue 21): L{resource} (HTTP),
L{service} (the rules), L{records} (how they are stored).
"""
