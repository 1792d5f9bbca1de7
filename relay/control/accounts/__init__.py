# -*- test-case-name: tests.test_control -*-
"""
Accounts changed through the admin API: L{resource} (HTTP),
L{service} (the rules), L{records} (how they are stored).
"""
