"""Clean-up of a local Ray instance whose server was killed outright (SIGKILL, OOM killer).

A server that stops normally shuts its Ray instance down. One that is killed cannot, and Ray's
per-node agents (started by the raylet) outlive it. So before starting Ray the server marks its
environment with a token, which every process of that Ray instance inherits, and starts this
small watcher: once the server is gone, it kills every process carrying the token, then exits.
Processes of other Ray instances or users never carry it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

TOKEN_VAR = "ARBOR_RAY_OWNER"


def mark_and_watch() -> str:
    """Mark this process's environment (inherited by the Ray instance it starts next) and start
    the watcher; returns the token."""
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    os.environ[TOKEN_VAR] = token
    subprocess.Popen(
        [sys.executable, "-m", "runtime.scale_out.reaper", token, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != TOKEN_VAR},  # not itself marked
        start_new_session=True,  # a Ctrl+C to the server's terminal group does not reach it
    )
    return token


def marked_pids(token: str) -> list[int]:
    needle = f"{TOKEN_VAR}={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def main(token: str, server_pid: int) -> None:
    while _alive(server_pid):
        time.sleep(0.5)
    for _ in range(3):  # a dying raylet may still start a process or two
        for pid in marked_pids(token):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.5)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
