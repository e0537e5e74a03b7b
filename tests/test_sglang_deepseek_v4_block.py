"""SGLang's DeepSeek-V4 MoE blocks with our wrapper against HF transformers' `DeepseekV4SparseMoeBlock`.

The blocks are SGLang's own `DeepseekV2MoE(is_deepseek_v4=True)`, built in a subprocess with the
plugin loaded (see sglang_deepseek_v4_block_worker.py): a hash-routed layer (`HashTopK`, experts from
a frozen token-id table) and a top-k layer (sqrt(softplus) scores plus a correction bias, ungrouped),
both with routed_scaling_factor 1.5. Their routed experts are a DeepSeek-V4-Flash MXFP4 checkpoint as
it ships, all cold on the CPU engine with `--kt-method MXFP4` and the checkpoint's clamped SiLU. The
reference is transformers' float32 block on the checkpoint's values, dequantized in the worker; the
shared expert is left out of the comparison (SGLang clamps it with a CUDA-only kernel) and its loaded
weights are compared instead.

The bound 0.02 sits between the measured error (0.003-0.004) and the errors of a lost scaling
factor (0.50), no clamp (0.67-0.68), sigmoid scores instead of sqrt(softplus) (0.10 hash, 0.23 top-k)
or the other layer kind's routing (1.1-1.2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kt_sglang.cli.server import free_port

WORKER = Path(__file__).with_name("sglang_deepseek_v4_block_worker.py")


def test_deepseek_v4_blocks_all_cold_mxfp4_match_hf(tmp_path):
    cmd = [sys.executable, str(WORKER), str(tmp_path), "--port", str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["wrapper"] == "kt_sglang.sglang.method.KTEPWrapperMethod"
    layers = result["layers"]
    assert layers["0"]["topk"] == "HashTopK" and layers["1"]["topk"] == "TopK"
    # SGLang's renaming of the release's names reached the router's table and bias
    assert "topk.tid2eid" in layers["0"]["loaded"]
    assert "gate.e_score_correction_bias" in layers["1"]["loaded"]
    for layer in layers.values():
        assert layer["activation"].startswith("Glu(kind='silu', limit=7.0"), layer
        assert layer["gpu_slots"] == 0  # cold experts take no GPU slot
        assert layer["shared_loaded"], "the shared expert's weights differ from the checkpoint's"
        assert layer["clamped_fraction"] > 0.01  # the clamp at swiglu_limit is exercised
        assert layer["rel_err"] < 0.02, layer
        for alternative in ("unscaled", "unclamped", "sigmoid_scores", "other_routing"):
            assert layer[f"rel_err_vs_{alternative}"] > 0.05, (alternative, layer)
