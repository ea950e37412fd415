"""The `airlock` command line for operators."""

__all__: list[str] = []
