"""
Tests for L{relay.console.fields}: the JSON types of admin bodies.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from relay.control.accounts.records import ACCOUNT_BODY
from relay.console.fields import (
    INTEGER,
    NUMBER,
    STRING,
    FieldTypeError,
    checkTypes,
    listOf,
    mapOf,
    objectOf,
)


class CheckTypesTests(SynchronousTestCase):
    """
    L{checkTypes} names the first field of the wrong type, at any depth,
    and never the value.
    """

    def refused(self, body, table) -> FieldTypeError:
        """
        @return: the L{FieldTypeError} C{checkTypes} raises.
        """
        return self.assertRaises(FieldTypeError, checkTypes, body, table)

    def test_scalars(self):
        """
        A list for a string, an object for a string, a boolean for an
        integer, a string for a number: refused naming the field; C{null}
        and names outside the table pass.
        """
        table = {"s": STRING, "i": INTEGER, "n": NUMBER}
        checkTypes({"s": "x", "i": 1, "n": 1.5, "other": [1], "s2": None}, table)
        checkTypes({"s": None, "i": None}, table)
        e = self.refused({"s": ["sk-secret"]}, table)
        self.assertEqual((e.param, e.message), ("s", "s: expected a string, got a list"))
        self.assertEqual(self.refused({"s": {"a": 1}}, table).message,
                         "s: expected a string, got an object")
        self.assertEqual(self.refused({"i": True}, table).param, "i")
        self.assertEqual(self.refused({"i": 1.5}, table).param, "i")
        self.assertEqual(self.refused({"n": "1"}, table).param, "n")

    def test_nested(self):
        """
        List items, map values and object fields are checked with their
        path.
        """
        table = {"models": listOf(STRING), "prices": mapOf(objectOf({"input": NUMBER})),
                 "account": objectOf(ACCOUNT_BODY)}
        self.assertEqual(self.refused({"models": ["a", 3]}, table).param, "models[1]")
        self.assertEqual(self.refused({"models": [None]}, table).param, "models[0]")
        self.assertEqual(self.refused({"prices": {"m": {"input": "1"}}}, table).param,
                         "prices.m.input")
        self.assertEqual(self.refused({"prices": {"m": 1}}, table).param, "prices.m")
        e = self.refused({"account": {"api_key": {"k": "sk-secret"}}}, table)
        self.assertEqual(e.param, "account.api_key")
        self.assertNotIn("sk-secret", e.message)
