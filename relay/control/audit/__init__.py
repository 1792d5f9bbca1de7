# -*- test-case-name: tests.test_control -*-
"""
The audit of admin changes: L{resource} (C{GET /admin/audit}
and the C{/admin} tree that records changes), L{service} (the trail).
"""
