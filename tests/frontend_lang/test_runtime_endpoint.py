"""The HTTP backends' clients (fl.RuntimeEndpoint, fl.OpenAI): each call leases a whole client
(a pool shared between threads handed out connections another thread closed), and clients are
reused across calls and threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import frontend_lang as fl
from frontend_lang.backends.client_pool import ClientPool


class _Client:
    def __init__(self) -> None:
        self.closed = False


def test_concurrent_calls_get_distinct_clients_and_later_calls_reuse_them():
    pool = ClientPool(_Client, lambda c: setattr(c, "closed", True))
    inside = threading.Barrier(4)
    seen: list[_Client] = []

    def call() -> None:
        with pool.lease() as client:
            seen.append(client)
            inside.wait(timeout=10)  # all four hold a client at once

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(c) for c in seen}) == 4 and pool.size == 4

    def one_call() -> None:
        with pool.lease():
            pass

    for _ in range(3):  # new short-lived threads, one call each: warm clients, none made
        thread = threading.Thread(target=one_call)
        thread.start()
        thread.join()
    assert pool.size == 4
    with pool.lease() as held:
        pool.close_all()
        assert not held.closed  # in use: closed when its call ends
    assert held.closed and all(c.closed for c in seen)
    with pytest.raises(RuntimeError, match="shut down"), pool.lease():
        pass


def test_many_threads_calling_a_live_server_all_succeed(endpoint_backend: fl.RuntimeEndpoint):
    def call(i: int) -> str:
        result = endpoint_backend._call(
            {"text": f"call {i}", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        )
        return str(result["text"])

    with ThreadPoolExecutor(16) as pool:
        assert len(list(pool.map(call, range(200)))) == 200
    assert endpoint_backend._clients.size <= 16


def test_role_blocks_come_from_the_server_without_a_local_tokenizer(
    endpoint_backend: fl.RuntimeEndpoint, monkeypatch: pytest.MonkeyPatch
):
    import transformers

    info = endpoint_backend.get_model_info()
    local = transformers.AutoTokenizer.from_pretrained(info["tokenizer_path"])
    assert info["chat_template_blocks"] == fl.ChatTemplate.from_tokenizer(local).__dict__

    def no_folder(*args: object, **kwargs: object) -> None:
        raise AssertionError("the client read the model folder")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_folder)
    fresh = fl.RuntimeEndpoint(endpoint_backend.url)
    try:
        assert fresh.chat_template == fl.ChatTemplate.from_tokenizer(local)
    finally:
        fresh.shutdown()


def test_a_server_without_role_blocks_says_why(monkeypatch: pytest.MonkeyPatch):
    endpoint = fl.RuntimeEndpoint("http://127.0.0.1:9")  # never contacted
    why = {"chat_template_error": "the tokenizer has no chat template"}
    monkeypatch.setattr(endpoint, "get_model_info", lambda: why)
    with pytest.raises(fl.ChatTemplateError, match="no chat template.*chat_template=fl.CHATML"):
        _ = endpoint.chat_template
    endpoint.shutdown()


def test_threads_needing_the_template_at_once_load_it_once(monkeypatch: pytest.MonkeyPatch):
    endpoint = fl.RuntimeEndpoint("http://127.0.0.1:9")
    calls: list[int] = []
    blocks = fl.CHATML.__dict__

    def slow_info() -> dict[str, object]:
        calls.append(1)
        threading.Event().wait(0.2)  # the others arrive while this one loads
        return {"chat_template_blocks": blocks}

    monkeypatch.setattr(endpoint, "get_model_info", slow_info)
    with ThreadPoolExecutor(8) as pool:
        templates = list(pool.map(lambda _: endpoint.chat_template, range(8)))
    assert calls == [1] and all(t == fl.CHATML for t in templates)
    endpoint.shutdown()


def test_the_server_reports_why_a_template_has_no_role_blocks() -> None:
    from types import SimpleNamespace

    from runtime.server.state import ServerState

    class Raises:  # a template that raises on the probe conversation (jinja's raise_exception)
        chat_template = "{{ raise_exception('System role not supported') }}"

        def apply_chat_template(self, *args: object, **kwargs: object) -> str:
            raise RuntimeError("System role not supported")

    class NoTemplate:
        chat_template = None

    for tokenizer, why in ((Raises(), "System role not supported"), (NoTemplate(), "no chat")):
        state = SimpleNamespace(tokenizer=tokenizer, _role_blocks=None)
        info = ServerState.role_blocks(state)  # type: ignore[arg-type]
        assert set(info) == {"chat_template_error"} and why in info["chat_template_error"]
        assert ServerState.role_blocks(state) is info  # type: ignore[arg-type]  # derived once
