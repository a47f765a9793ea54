"""``GET /dashboard``: a live page of the radix cache and the scheduler (docs/dashboard.md).

The page is static files of this package (``static/``: HTML, CSS and plain JavaScript
modules, no build step, nothing fetched from elsewhere) and one stream of server-sent events,
``GET /dashboard/events``, fed by ``DashboardFeed``. The routes are not part of the API's
OpenAPI document: ``GET /cache_tree`` is the documented way to read the same data.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from runtime.server.dashboard.feed import DashboardFeed
from runtime.server.errors import ApiError

__all__ = ["DashboardFeed", "router"]

router = APIRouter(include_in_schema=False)

# The page may load nothing but its own files and talk to nothing but this server.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_JS = "text/javascript; charset=utf-8"
MEDIA_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": _JS,  # the page's entry module; it imports the others
    "charts.js": _JS,
    "format.js": _JS,
    "tooltip.js": _JS,
    "tree.js": _JS,
}
_STATIC = resources.files(__package__) / "static"


def _asset(name: str) -> Response:
    try:
        media_type = MEDIA_TYPES[name]
    except KeyError:
        raise ApiError(404, f"no dashboard file {name!r}") from None
    return Response(
        (_STATIC / name).read_bytes(),
        media_type=media_type,
        headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
        },
    )


@router.get("/dashboard")
async def dashboard() -> Response:
    return _asset("index.html")


@router.get("/dashboard/static/{name}")
async def dashboard_static(name: str) -> Response:
    if name == "index.html":
        raise ApiError(404, "the page is at /dashboard")
    return _asset(name)


@router.get("/dashboard/events")
async def dashboard_events(request: Request) -> Response:
    """Server-sent events, about two a second, each one JSON update of the page's data."""
    feed: DashboardFeed = request.app.state.dashboard_feed
    return StreamingResponse(
        feed.events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
