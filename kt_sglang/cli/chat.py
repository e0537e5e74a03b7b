"""`kt-sglang chat [--url]`: an interactive, streaming chat with a running server."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request


def stream_reply(url: str, messages: list[dict], max_tokens: int, temperature: float):
    """Yields the reply's text pieces from the OpenAI-compatible streaming endpoint."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            delta = json.loads(data)["choices"][0].get("delta", {})
            if delta.get("content"):
                yield delta["content"]


def run_chat(url: str, max_tokens: int = 256, temperature: float = 0.7) -> int:
    print(f"chatting with {url} (empty line or Ctrl-D to quit, /reset to forget the conversation)")
    messages: list[dict] = []
    while True:
        try:
            user = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user:
            return 0
        if user == "/reset":
            messages.clear()
            continue
        messages.append({"role": "user", "content": user})
        print("assistant> ", end="", flush=True)
        pieces = []
        try:
            for piece in stream_reply(url, messages, max_tokens, temperature):
                pieces.append(piece)
                print(piece, end="", flush=True)
        except urllib.error.URLError as exc:
            print(f"\nerror: cannot reach {url}: {exc.reason}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\n(interrupted)")
        print()
        messages.append({"role": "assistant", "content": "".join(pieces)})
