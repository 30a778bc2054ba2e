"""Observability of a running pipeline: snapshots, the status reporter, `asyncrl status`."""
