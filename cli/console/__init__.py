"""The operator console: ``airlock journal serve``, web pages over a journal (see docs/console.md)."""

from .command import serve

__all__ = ["serve"]
