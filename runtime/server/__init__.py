"""``arbor serve``: the HTTP server (native and OpenAI-compatible APIs) in front of the
scheduler and detokenizer processes. See docs/serving.md.

The names below load on first use, so importing one of this package's modules (as the
launcher's own ``http_app`` does) does not import the launcher first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports

if TYPE_CHECKING:
    from runtime.server.child_process import ServerProcess, free_port
    from runtime.server.launcher import launch_server

__all__, __getattr__ = lazy_exports(__name__)
