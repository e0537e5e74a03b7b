"""A bounded soak of the real server with the plugin (bench/bench_soak.py): no 5xx, alive, same text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_soak.py"


@pytest.mark.slow
def test_soak_with_cpu_experts(tmp_path, record_property):
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [sys.executable, str(BENCH), "--requests", "200", "--modes", "cpu-experts", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=tmp_path,
    )
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())["results"][0]
    record_property("rss_mib", result["rss_mib"])
    assert result["alive"] and result["server_errors"] == 0, result["statuses"]
    assert result["greedy_unchanged"], result["greedy"]
    by_kind = result["statuses"]
    for kind in ("complete", "stream", "hang-up", "chat"):
        assert set(by_kind[kind]) == {"200"}, (kind, by_kind[kind])
    malformed = {k: v for k, v in by_kind.items() if k.startswith("malformed")}
    assert len(malformed) == 7
    for kind, by in malformed.items():
        assert all(400 <= int(s) < 500 for s in by), (kind, by)
    messages = result["error_messages"]  # the plugin's checks answered these (SGLang's own died)
    assert "outside the vocabulary [0, 4096)" in messages["malformed 3"], messages
    assert "more than the vocabulary" in messages["malformed 6"], messages
    assert r.returncode == 0, r.stdout[-3000:]
