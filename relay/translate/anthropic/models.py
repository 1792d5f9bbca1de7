# -*- test-case-name: tests.test_anthropic -*-
"""
C{claude-*} model names -> OpenAI models, by family (config.md
C{anthropic_models}, behaviour.md R115): mapped first, before key
allow-lists, prices and account C{models} see the name (R110).
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

DEFAULT_ANTHROPIC_MODELS = {"opus": "gpt-5.5", "sonnet": "gpt-5.5", "haiku": "gpt-5.4-mini"}
"""The families' models when the configuration names none (config.md)."""

_FAMILY = re.compile(r"[a-z]+")


def familyOf(name: str) -> Optional[str]:
    """
    The family of a C{claude-*} name: C{claude-sonnet-4-5-20250929},
    C{claude-3-5-sonnet-latest} and C{Claude-Sonnet-4} are C{sonnet}.

    @param name: a model name.
    @return: the first word after C{claude} that is not a version, or
        L{None} for a name that is not C{claude-*}.
    """
    words = _FAMILY.findall(name.strip().lower())
    if not words or words[0] != "claude":
        return None
    return words[1] if len(words) > 1 else None


class AnthropicModels:
    """
    The live family -> model table: L{DEFAULT_ANTHROPIC_MODELS}, under the
    file's C{anthropic_models} (a reload replaces it, L{setFile}), under
    the admin API's (L{setAdmin}, live, R115); a family the upper layer
    names wins.

    @ivar table: family -> OpenAI model name in force.
    @ivar file: the file's table.
    @ivar admin: the admin API's table.
    """

    def __init__(self, file: Optional[Mapping[str, str]] = None,
                 admin: Optional[Mapping[str, str]] = None):
        self.file = dict(file or {})
        self.admin = dict(admin or {})
        self._merge()

    def _merge(self) -> None:
        self.table = {**DEFAULT_ANTHROPIC_MODELS, **self.file, **self.admin}

    def setFile(self, table: Optional[Mapping[str, str]]) -> None:
        """
        @param table: the file's checked table (a reload).
        """
        self.file = dict(table or {})
        self._merge()

    def setAdmin(self, table: Optional[Mapping[str, str]]) -> None:
        """
        @param table: the admin API's checked table.
        """
        self.admin = dict(table or {})
        self._merge()

    def view(self) -> dict:
        """
        @return: family -> C{{"model", "source"}} (C{admin}, C{config},
            C{default}).
        """
        return {family: {"model": model,
                         "source": "admin" if family in self.admin else
                         "config" if family in self.file else "default"}
                for family, model in sorted(self.table.items())}

    def resolve(self, name: str) -> str:
        """
        @param name: the client's model name.
        @return: the mapped OpenAI model for a C{claude-*} name whose family
            is in the table; C{name} unchanged otherwise (an OpenAI name
            passes; an unmapped family meets R110 as it is).
        """
        family = familyOf(name)
        if family is None:
            return name
        return self.table.get(family, name)


def checkTable(raw, path: str = "anthropic_models") -> dict:
    """
    Check a family -> model table (the file's C{anthropic_models} and the
    admin API's body alike).

    @return: a new dict of lower-cased family -> model.
    @raise ValueError: naming the entry (C{anthropic_models.opus: ...}).
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of family to model")
    out = {}
    for family, model in raw.items():
        if not isinstance(family, str) or not _FAMILY.fullmatch(family.strip().lower()):
            raise ValueError(f"{path}: a family is one word (opus, sonnet, haiku), got {family!r}")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"{path}.{family}: expected a model name")
        out[family.strip().lower()] = model.strip()
    return out
