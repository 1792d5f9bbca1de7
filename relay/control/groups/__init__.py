# -*- test-case-name: tests.test_control_keys -*-
"""
Account groups changed through the admin API: L{resource}
(HTTP), L{service} (the rules and how they are stored).
"""
