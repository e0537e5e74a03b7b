"""Launch `python -m sglang.launch_server` as a child process, wait until it serves, stop it cleanly.

Used by `kt-sglang serve`, `kt-sglang demo` and the end-to-end tests: the server runs in its own
process group, so stopping it (also on Ctrl-C or a failed test) takes its workers with it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# What SGLang needs to serve on a machine without a GPU (see docs/usage.md); None: a switch.
CPU_DEVICE_FLAGS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--cuda-graph-backend-decode": "disabled",  # the successor of the deprecated --disable-cuda-graph
    "--cuda-graph-backend-prefill": "disabled",
    "--max-total-tokens": "4096",  # SGLang's CPU default reserves ~15 GB of KV cache
}
CPU_DEVICE_ARGS = [x for flag, value in CPU_DEVICE_FLAGS.items() for x in (flag, value) if x is not None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: str | Path, args: list[str], port: int, host: str = "127.0.0.1") -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        *args,
    ]


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message holds the end of its log."""


class SGLangServer:
    """``with SGLangServer(cmd, log) as s: s.post("/generate", {...})``."""

    def __init__(self, command: list[str], log_path: str | Path, port: int, timeout_s: float = 300) -> None:
        self.command, self.log_path, self.port, self.timeout_s = command, Path(log_path), port, timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> SGLangServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.log_path.parent,  # `python -m` puts the cwd first on sys.path: not a source tree
        )
        try:
            self._wait_ready()
        except BaseException:  # also Ctrl-C while it starts: `with` does not call __exit__ then
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"the server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1)
        raise ServerError(f"the server was not ready after {self.timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.proc is not None:
            try:  # workers left behind in the group
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(text[-lines:])

    def post(self, path: str, payload: dict, timeout_s: float = 120) -> dict:
        req = urllib.request.Request(
            self.url + path, json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.load(r)
