"""``arbor serve``: the HTTP server (native and OpenAI-compatible APIs) in front of the
scheduler and detokenizer processes. See docs/serving.md."""

from runtime.server.launcher import launch_server

__all__ = ["launch_server"]
