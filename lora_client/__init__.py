"""Clients of the serving system: a typed Python client, the demo, and process launch helpers."""
