"""``ApiKeyMiddleware`` with and without ``--admin-api-key``, on a stand-in app: who gets 401,
403 and through on which route, what each caller counts as, and the flags' own checks. The
real server's routes are in test_multi_tenant.py."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from runtime.server.http_app import ApiKeyMiddleware
from runtime.server.state import caller_is_admin
from runtime.server_args import ServerArgs

API, ADMIN = "api-key", "admin-key"


async def _whoami(request: Request) -> JSONResponse:
    return JSONResponse({"admin": caller_is_admin(request)})


def _client(api_key: str | None, admin_api_key: str | None) -> TestClient:
    paths = ["/generate", "/health", "/cache_tree", "/cache_tree/prefix", "/dashboard",
             "/dashboard/events", "/flush_cache", "/get_server_info", "/cache_treeish"]  # fmt: skip
    app = Starlette(routes=[Route(p, _whoami, methods=["GET", "POST"]) for p in paths])
    app.add_middleware(ApiKeyMiddleware, api_key=api_key, admin_api_key=admin_api_key)
    return TestClient(app)


def _status(client: TestClient, path: str, key: str | None, method: str = "GET") -> object:
    """The status, or for a 200 whether the app saw an admin."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = client.request(method, path, headers=headers)
    return response.json()["admin"] if response.status_code == 200 else response.status_code


ADMIN_PATHS = ["/cache_tree", "/cache_tree/prefix", "/dashboard", "/dashboard/events"]


@pytest.mark.parametrize("path", ADMIN_PATHS + ["/flush_cache"])
def test_with_both_keys_admin_routes_take_the_admin_key_only(path: str) -> None:
    client = _client(API, ADMIN)
    method = "POST" if path == "/flush_cache" else "GET"
    assert _status(client, path, ADMIN, method) is True
    assert _status(client, path, API, method) == 403
    assert _status(client, path, None, method) == 401
    assert _status(client, path, "guess", method) == 401


def test_with_both_keys_ordinary_routes_take_either_key() -> None:
    client = _client(API, ADMIN)
    for path in ("/generate", "/get_server_info", "/cache_treeish"):  # not under /cache_tree
        assert _status(client, path, API) is False
        assert _status(client, path, ADMIN) is True
        assert _status(client, path, None) == 401
    assert _status(client, "/health", None) is False  # open, and no admin either


def test_an_admin_key_alone_guards_only_the_admin_routes() -> None:
    client = _client(None, ADMIN)
    assert _status(client, "/generate", None) is False
    assert _status(client, "/get_server_info", "anything") is False
    assert _status(client, "/cache_tree", None) == 401
    assert _status(client, "/cache_tree", ADMIN) is True


def test_without_an_admin_key_the_api_key_opens_everything_as_before() -> None:
    client = _client(API, None)
    for path in ADMIN_PATHS + ["/generate", "/get_server_info"]:
        assert _status(client, path, API) is True
        assert _status(client, path, None) == 401


def test_a_browser_logs_in_with_basic_credentials_and_is_asked_for_them() -> None:
    client = _client(API, ADMIN)
    assert client.get("/dashboard", auth=("anyone", ADMIN)).json() == {"admin": True}
    assert client.get("/dashboard", auth=("anyone", API)).status_code == 403
    asked = client.get("/dashboard")
    assert asked.status_code == 401 and asked.headers["www-authenticate"].startswith("Basic")
    assert client.post("/flush_cache", auth=("anyone", ADMIN)).status_code == 401  # GET only


def test_the_admin_key_is_a_secret_of_its_own() -> None:
    args = ServerArgs("unused", api_key=API, admin_api_key=ADMIN)
    assert "admin_api_key" not in args.reported() and "api_key" not in args.reported()
    for admin in ("", API):
        with pytest.raises(ValueError, match="admin_api_key"):
            ServerArgs("unused", api_key=API, admin_api_key=admin)
