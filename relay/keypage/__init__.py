# -*- test-case-name: tests.test_keypage -*-
"""
A page for each key holder (docs/keys.md "Your key's own page"): C{/me}
and its data, C{/me/api/...}, strictly scoped to the key that asks
(L{resource}); the page itself is C{me.html}.
"""
