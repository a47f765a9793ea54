"""Arbor runtime: models, KV memory, scheduler, engine and server."""
