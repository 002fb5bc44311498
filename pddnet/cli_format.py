"""How every `pdd` help page looks: options that take a value show their default.

Its own module so that the root CLI (pddnet/cli.py, which imports every area's registration)
and an area building a parser of its own (pddnet/bench/cli.py) both use it without importing
each other.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any


def shows_default(action: argparse.Action) -> bool:
    """Whether `--help` states this option's default: it takes a value and has one worth
    saying (not None, not an empty list; a flag's False goes without saying)."""
    if action.nargs == 0 or action.default is argparse.SUPPRESS or action.required:
        return False
    if not action.option_strings and action.nargs not in ("?", "*"):
        return False  # a required positional
    return action.default is not None and action.default != [] and action.default != ()


def format_default(value: Any) -> str:
    """A default as it would be typed: lists and tuples (nargs) space-separated."""
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option that takes a value shows "(default: X)", unless its help already says what
    its default is (help texts of options whose default is None say what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not shows_default(action) or "default" in text.lower():
            return text
        shown = format_default(action.default).replace("%", "%%")
        return f"{text} (default: {shown})" if text else f"(default: {shown})"

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and shows_default(action):
            action = copy.copy(action)  # argparse prints no help line at all when help is None
            action.help = ""
            action.help = self._get_help_string(action)
        return super()._format_action(action)


_FORMATTERS: dict[type, type] = {}


def with_defaults(cls: type) -> type:
    """`cls` (a parser's formatter class) that also shows defaults; keeps e.g. raw descriptions."""
    if issubclass(cls, DefaultsHelpFormatter):
        return cls
    if cls in (argparse.HelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        return DefaultsHelpFormatter
    if cls not in _FORMATTERS:
        _FORMATTERS[cls] = type(f"Defaults{cls.__name__}", (cls, DefaultsHelpFormatter), {})
    return _FORMATTERS[cls]
