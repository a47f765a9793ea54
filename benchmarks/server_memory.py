"""Resident memory of `arbor serve` at its defaults: every process of the server, after start
and after a few chat requests.

Starts ``arbor serve`` (the built-in model unless ``--model-path``) on a free loopback port,
waits for ``/health``, reads VmRSS of each process in its tree (Linux ``/proc``), sends
``--requests`` short chat completions one after another, and reads them again. Each process is
named by its role (the HTTP process is the one started; its children are the scheduler, the
detokenizer and any grammar workers). Prints a table and writes JSON.

    python -m benchmarks.server_memory [--model-path PATH] [--requests 4] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, write_json

ARBOR = Path(sys.executable).parent / "arbor"
PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "Say hello in Spanish.",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_kb(pid: int) -> int:
    """VmRSS of ``pid`` in kB (0 once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def process_tree(root: int) -> dict[int, str]:
    """{pid: command line} of ``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        tree[pid] = cmdline.strip()
        todo.extend(children.get(pid, []))
    return tree


def role(pid: int, root: int, cmdline: str, roles: dict[int, str]) -> str:
    """The process's part in the server, from /get_server_info's pids where it names them."""
    if pid == root:
        return "http (tokenizer manager)"
    if pid in roles:
        return roles[pid]
    if "grammar.sandbox" in cmdline:
        return f"grammar worker {pid}"
    if "resource_tracker" in cmdline:
        return "multiprocessing resource tracker"
    return "other: " + cmdline[-60:]


def get_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_healthy(base: str, server: subprocess.Popen[bytes], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"arbor serve exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"arbor serve not healthy within {deadline_s:.0f} s")


def snapshot(root: int, roles: dict[int, str]) -> dict[str, int]:
    """{role: VmRSS kB} of every process in the server's tree."""
    return {role(pid, root, cmd, roles): rss_kb(pid) for pid, cmd in process_tree(root).items()}


def server_roles(info: dict[str, Any]) -> dict[int, str]:
    """The pids /get_server_info names, by role."""
    named = {"scheduler_pid": "scheduler", "detokenizer_pid": "detokenizer"}
    return {int(info[key]): name for key, name in named.items() if info.get(key)}


def measure(model_path: str | None, requests: int, extra: list[str]) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(ARBOR), "serve", "--port", str(port), *extra]
    if model_path:
        command += ["--model-path", model_path]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(base, server, deadline_s=300)
        info = get_json(base + "/get_server_info")
        roles = server_roles(info)
        model = get_json(base + "/v1/models")["data"][0]["id"]
        time.sleep(2)  # let start-up's last allocations settle
        started = snapshot(server.pid, roles)
        for i in range(requests):
            get_json(
                base + "/v1/chat/completions",
                {
                    "model": model,
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "max_tokens": 64,
                },
            )
        served = snapshot(server.pid, roles)
        pool = {key: info.get(key) for key in ("max_total_tokens", "context_length")}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {"started_kb": started, "after_requests_kb": served, "requests": requests, **pool}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in model")
    parser.add_argument("--requests", type=int, default=4, help="chat requests to send")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/)")
    args, extra = parser.parse_known_args(argv)
    extra = [flag for flag in extra if flag != "--"]
    result = measure(args.model_path, args.requests, extra)
    started, served = result["started_kb"], result["after_requests_kb"]
    names = sorted(set(started) | set(served))
    rows = [[name, started.get(name, 0) / 1024, served.get(name, 0) / 1024] for name in names]
    rows.append(["total", sum(started.values()) / 1024, sum(served.values()) / 1024])
    print(f"KV pool: {result['max_total_tokens']} tokens, context {result['context_length']}")
    print_table(["process", "RSS MB started", f"RSS MB after {args.requests} requests"], rows)
    write_json("server_memory", {"serve_flags": extra, **result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
