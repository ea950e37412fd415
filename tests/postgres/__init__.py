"""The PostgreSQL journal beyond the contracts every store keeps: its server, roles, replicas and faults."""
