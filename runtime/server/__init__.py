"""``arbor serve``: the HTTP server (native and OpenAI-compatible APIs) in front of the
scheduler and detokenizer processes. See docs/serving.md."""

from runtime.server.child_process import ServerProcess, free_port
from runtime.server.launcher import launch_server

__all__ = ["ServerProcess", "free_port", "launch_server"]
