"""A model without a chat template (a base model), ``--chat-template`` and packaged models by
name (runtime/chat_templates.py, runtime/model_files.py).

A base model serves /v1/completions and /generate; the chat APIs answer a 400 that says why and
names ``--chat-template``, and the server keeps serving.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.chat_templates import BUILTIN_TEMPLATES, ChatTemplateSpecError, template_stop_ids
from runtime.errors import ModelLoadError
from runtime.model_files import (
    BUILTIN_DISTRIBUTION,
    PACKAGED_MODELS,
    PackagedModel,
    builtin_model_path,
    load_tokenizer,
    resolve_model_path,
)
from runtime.server import ServerProcess
from runtime.server_args import ServerArgs
from tests.server.server_process import POOL

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def base_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its chat template removed."""
    folder = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(tiny_model_path, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    assert not load_tokenizer(folder).chat_template
    return folder


@pytest.fixture(scope="module")
def base_server(base_model: Path) -> Iterator[ServerProcess]:
    with ServerProcess(base_model, *POOL, "--served-model-name", "m") as process:
        yield process


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/messages", {**CHAT, "max_tokens": 3}),
        ("/v1/responses", {"model": "m", "input": "Hi", "max_output_tokens": 3}),
        ("/v1/messages/count_tokens", {"model": "m", "messages": CHAT["messages"]}),
    ],
)
def test_chat_apis_say_there_is_no_template(base_server: ServerProcess, path: str, body: dict):
    reply = httpx.post(f"{base_server.url}{path}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "--chat-template" in reply.text and "no chat template" in reply.text


def test_completions_and_generate_serve(base_server: ServerProcess) -> None:
    body = {"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{base_server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
    params = {"max_new_tokens": 4, "temperature": 0, "regex": "[a-z]+"}
    reply = httpx.post(
        f"{base_server.url}/generate", json={"text": "Hello", "sampling_params": params}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    assert httpx.get(f"{base_server.url}/health", timeout=10).status_code == 200


def test_a_built_in_template_renders_and_stops_at_its_turn_end(base_model: Path) -> None:
    tokenizer = load_tokenizer(base_model, chat_template="chatml")
    text = tokenizer.apply_chat_template(
        CHAT["messages"], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # The tiny tokenizer has <|im_end|> as one token: a chat reply stops there.
    (stop,) = template_stop_ids(tokenizer, "chatml")
    assert tokenizer.convert_ids_to_tokens(stop) == "<|im_end|>"
    assert template_stop_ids(tokenizer, None) == ()
    gemma = load_tokenizer(base_model, chat_template="gemma").apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *CHAT["messages"]],
        tokenize=False,
        add_generation_prompt=True,
    )
    opening = "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert gemma.endswith(opening)
    assert set(BUILTIN_TEMPLATES) >= {"gemma", "chatml"}


def test_a_template_file_and_bad_specs(base_model: Path, tmp_path: Path) -> None:
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tokenizer = load_tokenizer(base_model, chat_template=str(good))
    assert tokenizer.apply_chat_template(CHAT["messages"], tokenize=False) == "[user] Hi\n"
    args = ServerArgs(model_path=str(base_model), chat_template=str(good))
    assert args.chat_template == str(good)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateSpecError, match="--chat-template .*not a valid Jinja"):
        ServerArgs(model_path=str(base_model), chat_template=str(bad))
    with pytest.raises(ChatTemplateSpecError, match="not a built-in name \\(gemma, chatml"):
        ServerArgs(model_path=str(base_model), chat_template="no-such-template")


def test_packaged_models_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_path: Path
) -> None:
    try:
        importlib.metadata.distribution(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        assert resolve_model_path("smollm2-135m") == builtin_model_path()
    missing = PackagedModel("arbor-no-such-distribution", "pip install arbor-no-such-distribution")
    monkeypatch.setitem(PACKAGED_MODELS, "nothing-1m", missing)
    with pytest.raises(ModelLoadError, match="'nothing-1m' is not installed: run `pip install"):
        resolve_model_path("nothing-1m")
    with pytest.raises(ModelLoadError, match="pip install arbor-no-such-distribution"):
        ServerArgs(model_path="nothing-1m")
    # A file or folder of that name is what it names.
    monkeypatch.chdir(tmp_path)
    Path("nothing-1m").symlink_to(tiny_model_path)
    assert resolve_model_path("nothing-1m") == "nothing-1m"
    assert resolve_model_path("/some/path.gguf") == "/some/path.gguf"
