"""
Tests for L{relay.configuration.components.loadComponent}.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase
from zope.interface import Interface, implementer
from zope.interface.verify import verifyObject

from relay.configuration.components import loadComponent
from relay.interfaces import IFailureClassifier
from relay.base.records import ConfigError

_HERE = __name__


class IGreeter(Interface):
    """
    A tiny interface for these tests.
    """

    def greet(name):
        """
        @return: a greeting for C{name}.
        """

    def farewell(name):
        """
        @return: a farewell for C{name}.
        """


@implementer(IGreeter)
class BuiltinGreeter:
    """
    The "built-in" implementation.
    """

    def __init__(self, clock=None, settings=None):
        self.clock = clock
        self.settings = settings

    def greet(self, name):
        return f"hello {name}"

    def farewell(self, name):
        return f"bye {name}"


@implementer(IGreeter)
class CustomGreeter:
    """
    A valid replacement taking the same arguments.
    """

    def __init__(self, clock=None, settings=None):
        self.clock = clock
        self.settings = settings

    def greet(self, name):
        return f"hi {name}"

    def farewell(self, name):
        return f"later {name}"


@implementer(IGreeter)
class HalfGreeter:
    """
    Claims the interface but lacks C{farewell}.
    """

    def __init__(self, clock=None, settings=None):
        pass

    def greet(self, name):
        return name


class NoArgsGreeter:
    """
    Cannot be built with the built-in arguments.
    """

    def __init__(self):
        pass


class ExplodingGreeter:
    """
    Raises while being built.
    """

    def __init__(self, clock=None, settings=None):
        raise ValueError("no settings\nat all")


NOT_CALLABLE = 42


class LoadComponentTests(SynchronousTestCase):
    """
    L{loadComponent} builds the built-in component or a named one, and
    turns every failure into a one-line L{ConfigError} naming the key.
    """

    def load(self, dotted, key="components.classifier"):
        """
        Call L{loadComponent} with the greeter defaults and fixed kwargs.
        """
        return loadComponent(dotted, IGreeter, BuiltinGreeter, key, clock="CLOCK", settings="S")

    def assertLoadError(self, dotted, *fragments, key="components.classifier"):
        """
        Loading C{dotted} raises a one-line L{ConfigError} with every
        fragment; return the message.
        """
        e = self.assertRaises(ConfigError, self.load, dotted, key)
        message = str(e)
        self.assertNotIn("\n", message)
        self.assertTrue(message.startswith(key + ": "), message)
        for fragment in fragments:
            self.assertIn(fragment, message)
        return message

    def test_default(self):
        """
        With no dotted name the default factory gets the keyword arguments.
        """
        component = self.load(None)
        self.assertIsInstance(component, BuiltinGreeter)
        self.assertEqual((component.clock, component.settings), ("CLOCK", "S"))
        self.assertTrue(verifyObject(IGreeter, component))

    def test_named(self):
        """
        A valid named class is built with the same keyword arguments.
        """
        component = self.load(f"{_HERE}.CustomGreeter")
        self.assertIsInstance(component, CustomGreeter)
        self.assertEqual((component.clock, component.settings), ("CLOCK", "S"))
        self.assertTrue(verifyObject(IGreeter, component))

    def test_unimportableModule(self):
        """
        A module that does not exist is a config error naming the key.
        """
        self.assertLoadError(
            "no_such_pkg_xyz.Classifier", "cannot import no_such_pkg_xyz.Classifier"
        )

    def test_missingAttribute(self):
        """
        A name missing from an existing module is a config error.
        """
        self.assertLoadError(f"{_HERE}.NoSuchClass", f"cannot import {_HERE}.NoSuchClass")

    def test_notCallable(self):
        """
        A name that is not callable is a config error.
        """
        self.assertLoadError(f"{_HERE}.NOT_CALLABLE", "is not callable")

    def test_wrongArguments(self):
        """
        A class that cannot take the built-in arguments is a config error
        (the TypeError is summarised on the same line).
        """
        self.assertLoadError(f"{_HERE}.NoArgsGreeter", "cannot build", "TypeError")

    def test_constructorRaises(self):
        """
        Any exception while building is reported on one line.
        """
        self.assertLoadError(f"{_HERE}.ExplodingGreeter", "ValueError: no settings at all")

    def test_missingMethod(self):
        """
        A class lacking a method of the interface fails verifyObject.
        """
        message = self.assertLoadError(
            f"{_HERE}.HalfGreeter",
            f"{_HERE}.HalfGreeter does not provide IGreeter: ",
            "farewell",
            key="components.dialer",
        )
        self.assertNotIn("has failed to implement", message)

    def test_notDeclared(self):
        """
        A class that does not declare the interface fails verifyObject.
        """
        self.assertLoadError(f"{_HERE}.NoArgsGreeter", key="components.admission")
        e = self.assertRaises(
            ConfigError,
            loadComponent,
            f"{_HERE}.CustomGreeter",
            IFailureClassifier,
            BuiltinGreeter,
            "classifier",
            clock=None,
            settings=None,
        )
        self.assertIn(
            f"components.classifier: {_HERE}.CustomGreeter does not provide IFailureClassifier: ",
            str(e),
        )
        self.assertNotIn("\n", str(e))
