"""The llama-server baseline without building llama.cpp: flags, the server's command line,
the build's commands and failure reports, the process wrapper and the concurrent replay
against a fake server on 127.0.0.1. One test runs the real binary, only when it is cached."""

from __future__ import annotations

import io
import socket
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.suite.cli import BASELINES, _chosen_baselines, build_parser
from benchmarks.suite.systems import llama_server_baseline, llama_server_build
from benchmarks.suite.systems.llama_server_baseline import (
    MAX_SLOTS,
    LlamaServerReplay,
    slot_context,
    slot_count,
)
from benchmarks.suite.systems.llama_server_build import (
    BuildError,
    build_commands,
    extract_vendored_llama_cpp,
    find_or_build,
)
from benchmarks.suite.systems.llama_server_process import (
    LlamaServer,
    ServerConfig,
    ServerError,
)
from benchmarks.suite.systems.llama_server_stream import StreamedCompletion, parse_event
from benchmarks.suite.trace import Call

sys.path.insert(0, str(Path(__file__).parent))
from fake_llama_server import HELD, FakeState, next_tokens, serve  # noqa: E402

FAKE_SCRIPT = Path(__file__).parent / "fake_llama_server.py"


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState(loading_polls=0)
    server = serve(_port(), state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


def test_llama_server_is_a_baseline_with_its_own_binary_flag() -> None:
    assert "llama-server" in BASELINES and "llama-server" in _chosen_baselines(["all"])
    args = build_parser().parse_args(
        ["few-shot", "--baseline", "llama-server", "--llama-server-bin", "/opt/llama-server"]
    )
    assert args.baseline == ["llama-server"] and args.llama_server_bin == "/opt/llama-server"
    assert build_parser().parse_args(["few-shot"]).llama_server_bin is None


def test_slots_follow_the_widest_wave_and_context_covers_the_longest_call() -> None:
    calls = [Call((1,) * 100, (2,) * 20, group=g, wave=0) for g in range(6)]
    calls += [Call((1,) * 300, (2,) * 50, group=g, wave=1) for g in range(3)]
    assert slot_count(calls) == 6
    assert slot_count([Call((1,), (2,), group=g) for g in range(MAX_SLOTS + 5)]) == MAX_SLOTS
    context = slot_context(calls)
    assert context >= 350 + 8 and context % 256 == 0


def test_server_command_line() -> None:
    config = ServerConfig(Path("/bin/llama-server"), Path("/m.gguf"), 8, 512, 2, 4321)
    command = config.command()
    assert command[0] == "/bin/llama-server"

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--model") == "/m.gguf" and value("--host") == "127.0.0.1"
    assert value("--port") == "4321" and value("--parallel") == "8"
    assert value("--ctx-size") == str(8 * 512)  # split across the slots by the server
    assert value("--threads") == value("--threads-batch") == "2"
    assert "--cont-batching" in command and config.url == "http://127.0.0.1:4321"


def test_build_commands_build_only_the_server_offline(tmp_path: Path) -> None:
    configure, compile_ = build_commands("cmake", tmp_path / "src", tmp_path / "b", 2)
    assert "-DGGML_NATIVE=ON" in configure and "-DCMAKE_BUILD_TYPE=Release" in configure
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in configure and "-DLLAMA_CURL=OFF" in configure
    assert compile_[-4:] == ["--target", "llama-server", "-j", "2"]


def test_only_the_vendored_llama_cpp_is_extracted(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name in ("pkg/setup.py", "pkg/vendor/llama.cpp/CMakeLists.txt", "pkg/vendor/x/y"):
            data = b"project(x)\n"
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    tree = extract_vendored_llama_cpp(sdist, tmp_path / "out")
    assert tree == tmp_path / "out" / "pkg" / "vendor" / "llama.cpp"
    assert not (tmp_path / "out" / "pkg" / "setup.py").exists()


def test_binary_sources_and_build_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_server_build, "CACHE", tmp_path / "cache")
    monkeypatch.delenv(llama_server_build.BIN_ENV, raising=False)
    with pytest.raises(BuildError, match="not an executable"):
        find_or_build(str(tmp_path / "missing"))
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv(llama_server_build.BIN_ENV, str(binary))
    assert find_or_build() == binary
    monkeypatch.delenv(llama_server_build.BIN_ENV)
    monkeypatch.setattr(llama_server_build.shutil, "which", lambda name: None)
    with pytest.raises(BuildError, match="cmake not found"):
        find_or_build(log=lambda line: None)


def test_an_unavailable_server_is_reported_not_fatal(tmp_path: Path) -> None:
    outcome = llama_server_baseline.replay(
        "unused", [Call((1, 2), (3,))], binary=str(tmp_path / "nope")
    )
    assert outcome.run is None and "llama-server unavailable" in outcome.reason


def test_stream_events_are_parsed_and_errors_raised() -> None:
    assert parse_event('data: {"tokens": [5], "stop": false}') == {"tokens": [5], "stop": False}
    assert parse_event("") is None and parse_event(": keep-alive") is None
    with pytest.raises(ServerError, match="exceeds"):
        parse_event('data: {"error": {"code": 400, "message": "exceeds the context"}}')


def test_a_held_back_token_arrives_with_the_next_event_without_its_id() -> None:
    stream = StreamedCompletion(4)
    assert stream.add({"tokens": [7], "tokens_predicted": 1}) == 1
    assert stream.add({"tokens": [9], "tokens_predicted": 3}) == 2  # token 2 was held back
    assert stream.output_ids is None
    assert stream.add({"tokens": [], "tokens_predicted": 4, "stop": True}) == 1  # held at end
    assert stream.stopped and stream.count == 4 and stream.ids == [7, None, 9, None]
    plain = StreamedCompletion(2)
    for n, token in enumerate((3, 4, 5), 1):  # n_predict overshoots by one
        plain.add({"tokens": [token], "tokens_predicted": n})
    plain.add({"tokens": [], "stop": True, "timings": {"cache_n": 11}})
    assert plain.output_ids == (3, 4) and plain.cache_n == 11


def test_replay_streams_every_call_and_respects_waves(
    fake_server: tuple[str, FakeState],
) -> None:
    url, state = fake_server
    calls = [
        Call((7, 8, 9), (0,) * 4, group=0, wave=0),
        Call((7, 8, 20), (0,) * 3, group=1, wave=0),
        Call((7, 8, 9, 10, 11, 12, 13, 30), (0,) * 2, group=0, wave=1),
        Call((7, 8, 40), (), group=1, wave=1),  # a scoring call: prompt only
    ]
    run = LlamaServerReplay(url).run(calls, "note")
    assert run.system == "llama-server" and run.note == "note"
    for call, output, timing in zip(calls, run.outputs, run.timings, strict=True):
        assert output == tuple(next_tokens(list(call.prompt_ids), call.output_len))
        assert len(timing.token_times) == call.output_len
        assert timing.arrival <= timing.finish
    # wave 1 of a group is sent only after its group's wave 0 finished
    sent = {tuple(p): t for t, p in state.received}
    done = {tuple(p): t for t, p in state.finished}
    assert sent[calls[2].prompt_ids] >= done[calls[0].prompt_ids]
    assert sent[calls[3].prompt_ids] >= done[calls[1].prompt_ids]
    assert 0 < run.cache_hit_rate < 1  # the fake reports common prefixes as cached
    assert "re-read" not in run.note


def test_ids_a_stream_held_back_are_read_again(fake_server: tuple[str, FakeState]) -> None:
    url, _ = fake_server
    calls = [Call((HELD - 2,), (0,) * 4), Call((2 * HELD - 3,), (0,) * 3), Call((1,), (0,) * 3)]
    run = LlamaServerReplay(url).run(calls, "note")
    for call, output, timing in zip(calls, run.outputs, run.timings, strict=True):
        assert output == tuple(next_tokens(list(call.prompt_ids), call.output_len))
        assert len(timing.token_times) == call.output_len
    assert "token ids of 2 calls re-read unstreamed" in run.note
    held = run.timings[0].token_times
    assert held[1] == held[2]  # the held token reached the client with the next one


def test_a_stream_that_ends_early_is_an_error(fake_server: tuple[str, FakeState]) -> None:
    url, state = fake_server
    state.missing_tokens = 1
    with pytest.raises(ServerError, match="1 of 2 tokens"):
        LlamaServerReplay(url).run([Call((1, 2), (0, 0))], "")


def test_server_process_waits_for_health_and_is_always_stopped() -> None:
    port = _port()
    command = [sys.executable, str(FAKE_SCRIPT), "--port", str(port)]
    with LlamaServer(command, f"http://127.0.0.1:{port}") as server:
        process = server.process
        assert process is not None and process.poll() is None
    assert process.poll() is not None
    with pytest.raises(RuntimeError), LlamaServer(command, f"http://127.0.0.1:{port}") as server:
        process = server.process
        raise RuntimeError("the replay failed")
    assert process is not None and process.poll() is not None


def test_a_server_that_dies_while_starting_is_an_error() -> None:
    command = [sys.executable, "-c", "import sys; print('bad model'); sys.exit(3)"]
    started = time.monotonic()
    with (
        pytest.raises(ServerError, match="exited with 3"),
        LlamaServer(command, "http://127.0.0.1:9"),
    ):
        pass
    assert time.monotonic() - started < 30


@pytest.mark.skipif(
    not llama_server_build.cached_binary(llama_server_build.llama_cpp_python_version()).is_file(),
    reason="llama-server not built (arbor bench few-shot --baseline llama-server builds it)",
)
def test_real_llama_server_matches_transformers(tiny_model_path: Path) -> None:
    pytest.importorskip("gguf")
    calls = [
        Call((1, 30, 31, 32, 33), (0,) * 6, group=0),
        Call((1, 30, 31, 32, 40), (0,) * 6, group=1),
        Call((1, 30, 31, 32, 33, 50, 51), (), group=0, wave=1),
    ]
    outcome = llama_server_baseline.replay(str(tiny_model_path), calls, log=lambda line: None)
    assert outcome.run is not None, outcome.reason
    assert outcome.check["ok"] and outcome.check["tokenizer_equal"]
    assert [len(o) for o in outcome.run.outputs] == [6, 6, 0]
