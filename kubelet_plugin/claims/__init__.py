"""The claim state machine: prepare and unprepare, the checkpoint that makes them crash-safe,
partitions made before binding, start-up reconcile, sharing and tenancy checks, reading claims
and writing their status."""
