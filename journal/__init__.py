"""Durable EffectStores on an append-only, hash-chained event log."""

__all__: list[str] = []
