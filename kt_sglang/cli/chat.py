"""`kt-sglang chat [--url] [--system]`: an interactive, streaming chat with a running server.

The server's own error messages are shown and the conversation goes on (history kept); a reply cut
off by the server is said to be; reasoning (from a server started with a reasoning parser) shows
dimmed before the answer; each reply ends with its token count and tokens/s.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

HELP = """commands:
  /help          this list
  /retry         ask again for the last reply
  /clear         forget the conversation (the --system prompt stays)
  /quit          leave (also Ctrl-D or an empty line)"""


class ChatError(RuntimeError):
    """A request that failed; the message is the server's own when it sent one."""


@dataclass
class Reply:
    text: str
    reasoning: str
    tokens: int | None
    seconds: float
    complete: bool


def _server_message(exc: urllib.error.HTTPError) -> str:
    body = exc.read().decode(errors="replace")
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip() or exc.reason
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def check_server(url: str) -> str | None:
    """None when the server answers its health check; otherwise why not."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=10) as r:
            return None if r.status == 200 else f"health check answered {r.status}"
    except urllib.error.HTTPError as exc:
        return f"health check answered {exc.code}: {_server_message(exc)}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def stream_reply(url: str, messages: list[dict], max_tokens: int, temperature: float, show) -> Reply:
    """Streams one reply from the OpenAI-compatible endpoint, passing each piece to ``show(kind, text)``."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    text, reasoning, tokens, complete = [], [], None, False
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    complete = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                if "error" in chunk:
                    raise ChatError(str(chunk["error"].get("message", chunk["error"])))
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("reasoning_content"):
                        reasoning.append(delta["reasoning_content"])
                        show("reasoning", delta["reasoning_content"])
                    if delta.get("content"):
                        text.append(delta["content"])
                        show("content", delta["content"])
    except urllib.error.HTTPError as exc:
        raise ChatError(f"the server answered {exc.code}: {_server_message(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        if not text and not reasoning:
            raise ChatError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    return Reply("".join(text), "".join(reasoning), tokens, time.perf_counter() - start, complete)


class _Printer:
    """Prints streamed pieces, reasoning dimmed, with a line break where the answer begins."""

    def __init__(self, dim: str, plain: str) -> None:
        self.dim, self.plain, self.kind = dim, plain, None

    def __call__(self, kind: str, piece: str) -> None:
        if kind != self.kind:
            if self.kind == "reasoning":
                print(self.plain)
            print(self.dim if kind == "reasoning" else "", end="")
            self.kind = kind
        print(piece, end="", flush=True)


def run_chat(url: str, max_tokens: int = 256, temperature: float = 0.7, system: str | None = None) -> int:
    problem = check_server(url)
    if problem is not None:
        print(
            f"error: cannot reach {url}: {problem} (start one with `kt-sglang serve MODEL`)", file=sys.stderr
        )
        return 1
    tty = sys.stdout.isatty()
    dim, plain = ("\033[2m", "\033[0m") if tty else ("", "")
    print(f"chatting with {url}; /help for commands, an empty line or Ctrl-D to quit")
    base = [{"role": "system", "content": system}] if system else []
    history: list[dict] = list(base)
    last_user: str | None = None
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line or line == "/quit":
            return 0
        if line == "/help":
            print(HELP)
            continue
        if line in ("/clear", "/reset"):
            history, last_user = list(base), None
            print("(conversation cleared)")
            continue
        if line == "/retry":
            if last_user is None:
                print("(nothing to retry)")
                continue
            if history and history[-1]["role"] == "assistant":
                history.pop()
            if history and history[-1]["role"] == "user":
                history.pop()
            line = last_user
        elif line.startswith("/"):
            print(f"(unknown command {line.split()[0]}; /help lists them)")
            continue
        last_user = line
        print("assistant> ", end="", flush=True)
        try:
            messages = history + [{"role": "user", "content": line}]
            reply = stream_reply(url, messages, max_tokens, temperature, _Printer(dim, plain))
        except ChatError as exc:
            print(plain)
            print(f"error: {exc}", file=sys.stderr)
            continue  # the conversation so far is kept; /retry sends the message again
        except KeyboardInterrupt:
            print(f"{plain}\n(interrupted; the partial reply is not kept)")
            continue
        print(plain)
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply.text}]
        if not reply.complete:
            print("(the server ended the stream before the reply was complete)", file=sys.stderr)
        if reply.tokens:
            print(f"{dim}({reply.tokens} tokens, {reply.tokens / reply.seconds:.1f} tokens/s){plain}")
