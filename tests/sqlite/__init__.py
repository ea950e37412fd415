"""The SQLite journal beyond the contracts every store keeps: its file, locks, processes and clock."""
