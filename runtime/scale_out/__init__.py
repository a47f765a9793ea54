"""Scale-out: engine replicas on Ray behind a cache-aware router (``arbor serve --dp N``).

See docs/scale-out.md. Nothing here is imported by a single-engine server.
"""
