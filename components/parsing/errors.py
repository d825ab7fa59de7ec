"""Errors of two-stage parsing that callers may want to tell apart."""

from __future__ import annotations


class LayoutNotInstalledError(ImportError):
    """A layout backend whose package is not installed here."""
