"""Bad input is a ValueError / RuntimeError naming the argument, never a crash."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import make_hidden, make_routing, make_weights

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.methods import METHODS, parse_method
from kt_sglang.engine.pools import physical_cores

E, K, H, I = 8, 2, 256, 192


def new_layer(**kw):
    args = dict(
        layer_idx=0,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=None,
        cpuinfer_threads=1,
        threadpool_count=1,
        method="AMXINT8",
    )
    args.update(kw)
    return KTMoEWrapper(**args)


@pytest.fixture
def layer():
    w = new_layer()
    gate, up, down = make_weights(E, I, H)
    w.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    return w


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is larger than num_experts=8"),
        (dict(num_experts=0), "num_experts must be a positive integer"),
        (dict(num_experts=2**31), "num_experts=2147483648 is larger than the engine takes"),
        (dict(hidden_size=2**40), "hidden_size=1099511627776 is larger than the engine takes"),
        (dict(hidden_size=-4), "hidden_size must be a positive integer"),
        (dict(cpuinfer_threads=0), r"cpuinfer_threads 0: this machine has \d+ physical cores; use 1\.\."),
        (dict(cpuinfer_threads=physical_cores() + 1), "physical cores; use 1"),
        (dict(threadpool_count=99, cpuinfer_threads=1), "threadpool_count=99"),
        (
            dict(threadpool_count=2, cpuinfer_threads=1, numa_nodes=[0, 0]),
            "at least one thread per pool",
        ),
        (dict(numa_nodes=[7]), "numa_nodes names node 7"),
        (dict(method="LLAMAFILE"), "LLAMAFILE computes each GGUF tensor in its own type: give weight_path"),
        (dict(method="FP8", group_size=64), "group_size=64 is not allowed for FP8: use one of \\[128\\]"),
        (dict(method="INT3"), "unknown method 'INT3'"),
        (dict(group_size=48), "group_size=48 is not allowed for AMXINT8"),
        (dict(isa="sse"), "isa='sse' is not an ISA path"),
        (
            dict(gpu_experts_mask=torch.zeros(E - 1, dtype=torch.bool)),
            r"gpu_experts_mask has shape \(7,\)",
        ),
        (
            dict(gpu_experts_mask=torch.zeros(E, dtype=torch.int32)),
            "gpu_experts_mask has dtype torch.int32",
        ),
        (dict(chunked_prefill_size=0), "chunked_prefill_size must be a positive integer"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        new_layer(**kwargs)


def test_more_pools_than_nodes_names_the_fix():
    from kt_sglang.engine.pools import machine_nodes

    n = len(machine_nodes())
    if physical_cores() < n + 1:
        pytest.skip("needs more cores than NUMA nodes")
    with pytest.raises(ValueError, match=r"more than the .* NUMA node\(s\).*numa_nodes"):
        new_layer(threadpool_count=n + 1, cpuinfer_threads=n + 1)


def test_isa_env_variable(monkeypatch):
    monkeypatch.setenv("KT_SGLANG_ISA", "avx9000")
    with pytest.raises(ValueError, match="KT_SGLANG_ISA='avx9000' is not an ISA path"):
        new_layer()
    monkeypatch.setenv("KT_SGLANG_ISA", "scalar")
    assert new_layer().isa == "scalar"


@pytest.mark.parametrize(
    "variable,bad,message",
    [
        (
            "KT_SGLANG_PREFETCH_BYTES",
            ("abc", "-1", "70000"),
            "is not a byte count (0: no prefetch): use 0 to 65536",
        ),
        (
            "KT_SGLANG_SPIN_US",
            ("abc", "-5", "1e3", "99999999999999999999"),
            "is not a spin time in microseconds",
        ),
    ],
)
def test_engine_env_variables(variable, bad, message, tmp_path):
    """Read once per process, so checked in a fresh one: a bad value fails the layer's construction
    with one ValueError naming the variable, before any worker starts."""
    make = "from kt_sglang import KTMoEWrapper; KTMoEWrapper(0, 8, 2, 256, 192, None, 1, 1, method='BF16')"
    for value in bad:
        r = subprocess.run(
            [sys.executable, "-c", make],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,  # not the source tree, whose kt_sglang has no built engine
            env={**os.environ, variable: value},
        )
        assert r.returncode != 0
        assert f"ValueError: {variable}='{value}' {message}" in r.stderr, r.stderr[-1500:]
        assert "terminate called" not in r.stderr


def test_stats_interval_env_variable(monkeypatch, tmp_path):
    from kt_sglang.placement.stats import StatsRecorder

    for bad in ("abc", "-2", "nan"):
        monkeypatch.setenv("KT_SGLANG_STATS_INTERVAL_S", bad)
        with pytest.raises(
            ValueError, match=f"KT_SGLANG_STATS_INTERVAL_S='{bad}' is not a number of seconds"
        ):
            StatsRecorder(tmp_path / "stats.json", 8)
    for good in ("0", "0.5"):  # 0: the demo's "write as you go"
        monkeypatch.setenv("KT_SGLANG_STATS_INTERVAL_S", good)
        assert StatsRecorder(tmp_path / "stats.json", 8).interval_s == float(good)


def test_unsupported_isa_is_a_clear_error(monkeypatch):
    from kt_sglang.engine.native import _native

    missing = [i for i in ("avx2", "avx512", "amx") if i not in _native.supported_isas()]
    if not missing:
        pytest.skip("needs a CPU without one of the ISA paths (this one runs them all)")
    monkeypatch.setenv("KT_SGLANG_ISA", missing[0])
    with pytest.raises(ValueError, match="this CPU cannot run"):
        new_layer()


def test_weight_errors():
    w = new_layer()
    gate, up, down = (t.bfloat16() for t in make_weights(E, I, H))
    with pytest.raises(ValueError, match="up_proj has dtype torch.float32 but gate_proj has torch.bfloat16"):
        w.load_weights_from_tensors(gate, up.float(), down)
    with pytest.raises(ValueError, match="gate_proj has dtype torch.int8"):
        w.load_weights_from_tensors(gate.to(torch.int8), up, down)
    with pytest.raises(ValueError, match=r"down_proj has shape \(8, 192, 256\)"):
        w.load_weights_from_tensors(gate, up, down.transpose(1, 2).contiguous())
    with pytest.raises(ValueError, match="up_proj is not contiguous"):
        w.load_weights_from_tensors(gate, up.transpose(1, 2).contiguous().transpose(1, 2), down)
    with pytest.raises(ValueError, match="the tensors hold 4 experts but num_experts=8"):
        w.load_weights_from_tensors(gate[:4].clone(), up[:4].clone(), down[:4].clone())
    with pytest.raises(ValueError, match="physical_to_logical_map has 3 entries"):
        w.load_weights_from_tensors(gate, up, down, [0, 1, 2])
    with pytest.raises(ValueError, match=r"physical_to_logical_map names experts \[8\]"):
        w.load_weights_from_tensors(gate, up, down, [0, 1, 2, 3, 4, 5, 6, 8])
    with pytest.raises(RuntimeError, match="forward before the weights were loaded"):
        w.forward(make_hidden(2, H), *make_routing(2, E, K))


def test_forward_errors(layer):
    x = make_hidden(3, H)
    ids, weights = make_routing(3, E, K)
    with pytest.raises(ValueError, match=r"hidden_states has shape \(3, 255\)"):
        layer.forward(x[:, :255], ids, weights)
    with pytest.raises(ValueError, match=r"topk_ids has shape \(3, 3\)"):
        layer.forward(x, torch.zeros(3, 3, dtype=torch.int64), weights)
    with pytest.raises(ValueError, match="topk_ids has dtype torch.float32"):
        layer.forward(x, ids.float(), weights)
    with pytest.raises(ValueError, match=r"topk_weights has shape \(2, 2\)"):
        layer.forward(x, ids, weights[:2])
    bad = ids.clone()
    bad[1, 0] = E
    with pytest.raises(ValueError, match=r"topk_ids holds expert id 8 at token 1, slot 0, outside \[-1, 8\)"):
        layer.forward(x, bad, weights)
    bad[1, 0] = -2
    with pytest.raises(ValueError, match=r"expert id -2"):
        layer.forward(x, bad, weights)
    with pytest.raises(RuntimeError, match="sync_forward without submit_forward"):
        layer.sync_forward(x)
    layer.submit_forward(x, ids, weights)
    with pytest.raises(RuntimeError, match="submit_forward called twice"):
        layer.submit_forward(x, ids, weights)
    layer.sync_forward(x)


def test_engine_checks_ids_itself(layer):
    """Ids that bypass Python are checked before use: at submit when the batch size is known, when
    the task runs when it is read then (from a CUDA graph's buffers)."""
    x = make_hidden(4, H)
    ids = torch.tensor([[0, 1], [2, 3], [4, 100], [5, 6]], dtype=torch.int64)
    weights = torch.rand(4, K)
    out = torch.zeros(4, H, dtype=torch.bfloat16)
    message = r"expert id 100 at token 2, slot 1, outside \[-1, 8\)"
    with pytest.raises(ValueError, match=message):
        layer._layer.submit_forward(
            4, 0, x.data_ptr(), ids.data_ptr(), True, weights.data_ptr(), 0, out.data_ptr(), False
        )
    tokens = torch.tensor([4], dtype=torch.int32)
    task = layer._layer.submit_forward(
        0, tokens.data_ptr(), x.data_ptr(), ids.data_ptr(), True, weights.data_ptr(), 0, out.data_ptr(), False
    )
    with pytest.raises(ValueError, match=message):
        layer._runner.wait(task)
    # The runner goes on: the next forward works.
    ok_ids, ok_w = make_routing(4, E, K)
    assert layer.forward(x, ok_ids, ok_w).shape == (4, H)


def test_engine_names_the_token_of_a_later_chunk():
    """A prefill computed in chunks names the bad id's token in the whole batch, not in its chunk."""
    layer = new_layer(chunked_prefill_size=2)
    gate, up, down = make_weights(E, I, H)
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    x = make_hidden(4, H)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [-7, 6]], dtype=torch.int32)
    out = torch.zeros(4, H, dtype=torch.bfloat16)
    tokens = torch.tensor([4], dtype=torch.int32)
    weights = torch.rand(4, K)
    task = layer._layer.submit_forward(
        0,
        tokens.data_ptr(),
        x.data_ptr(),
        ids.data_ptr(),
        False,
        weights.data_ptr(),
        0,
        out.data_ptr(),
        False,
    )
    with pytest.raises(ValueError, match=r"expert id -7 at token 3, slot 0, outside \[-1, 8\)"):
        layer._runner.wait(task)


@pytest.mark.parametrize("method", [m.value for m in METHODS if METHODS[m].quantizes_dense])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_non_finite_weights_are_refused_by_position(method, bad, dtype):
    """One inf or NaN among the weights: quantized, it would give finite, wrong outputs (or vanish)."""
    E, k, H, I = 4, 2, 256, 192
    gate, up, down = (torch.randn(E, n, m).to(dtype) for n, m in ((I, H), (I, H), (H, I)))
    up[2, 17, 33] = bad
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 1, method=method)
    kind = "NaN" if bad != bad else "infinite"
    with pytest.raises(ValueError, match=f"expert 2 up_proj: weight at row 17, column 33 is {kind}"):
        layer.load_weights_from_tensors(gate, up, down)


# One-byte floats without an infinity: their NaN codes.
NAN_CODES = {torch.float8_e8m0fnu: 0xFF, torch.float8_e4m3fn: 0x7F}


@pytest.mark.parametrize("method", [m.value for m in METHODS])
def test_non_finite_canonical_tensors_are_refused_by_position(method):
    """Already-quantized matrices (a converted directory, an FP8 or INT4 checkpoint): scales, mins
    and bf16 weights must be finite, e4m3 weights not NaN."""
    from kt_sglang.engine.canonical import quantize, random_canonical

    def make(n, m):
        if METHODS[parse_method(method)].quantizes_dense:
            return quantize(method, torch.randn(n, m))
        return random_canonical(method, n, m)

    E, k, H, I = 2, 1, 256, 128
    mats = {
        p: [make(n, m) for _ in range(E)]
        for p, (n, m) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))
    }
    bad = mats["down"][1]
    if bad.weight.dtype == torch.float8_e4m3fn:
        bad.weight.view(torch.uint8)[3, 5] = 0x7F  # e4m3fn's NaN
        match = "expert 1 down: weight at row 3, column 5 is NaN"
    elif bad.scales is not None and bad.scales.dtype in NAN_CODES:
        bad.scales.view(torch.uint8)[3, 0] = NAN_CODES[bad.scales.dtype]
        match = "expert 1 down: scales at row 3, column 0 is NaN"
    elif bad.scales is not None:
        bad.scales[3, 0] = float("inf")
        match = "expert 1 down: scales at row 3, column 0 is infinite"
    else:
        bad.weight[3, 5] = float("inf")
        match = "expert 1 down: weight at row 3, column 5 is infinite"
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 1, method=method)
    with pytest.raises(ValueError, match=match):
        layer.load_canonical(mats["gate"], mats["up"], mats["down"])


_PENDING_SCRIPT = """
import gc, sys, torch
sys.path.insert(0, {tests!r})
from conftest import make_hidden, make_routing, make_weights
from kt_sglang import KTMoEWrapper
E, K, H, I = 64, 8, 1024, 512
g, u, d = make_weights(E, I, H, seed=1)
x = make_hidden(512, H)
ids, w = make_routing(512, E, K)
for i in range(6):
    m = KTMoEWrapper(0, E, K, H, I, None, 2, 1, method="BF16")
    m.load_weights_from_tensors(g, u, d)
    m.submit_forward(x, ids, w)
    del m
    gc.collect()
    junk = [torch.full((1 << 20,), 7, dtype=torch.int64) for _ in range(8)]  # reuse the freed memory
m = KTMoEWrapper(0, E, K, H, I, None, 2, 1, method="BF16")
m.load_weights_from_tensors(g, u, d)
print(float(m.forward(x, ids, w).float().abs().sum()) > 0)
m.submit_forward(x, ids, w)  # and exit with it pending
"""


def test_dropping_a_layer_with_a_pending_task_waits_for_it(tmp_path):
    """The pending task read the freed layer and buffers (a crash, or a garbage batch size later)."""
    script = _PENDING_SCRIPT.format(tests=os.path.dirname(__file__))
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "True" and not r.stderr.strip(), r.stderr[-3000:]


def test_converted_directory_brings_its_method(tmp_path):
    """--kt-method may be left out with a converted --kt-weight-path; given and different, it fails."""
    from kt_sglang.sglang.settings import KtSettingsError, early_server_args, resolve, split_argv
    from kt_sglang.tiny_model import write_tiny_moe
    from kt_sglang.weights.convert_cpu import main as convert_cpu

    model = write_tiny_moe(tmp_path / "m")
    out = tmp_path / "int8"
    assert convert_cpu(["--input-path", str(model), "--output", str(out), "--quant-method", "INT8"]) == 0
    source_dtype = __import__("json").loads((out / "kt_weights.json").read_text())["source_dtype"]
    assert source_dtype == "bf16"  # --input-type was read from the checkpoint

    def settings(*flags: str):
        argv = ["--model-path", str(model), "--kt-weight-path", str(out), "--kt-cpuinfer", "1", *flags]
        extra, rest = split_argv(argv)
        return resolve(early_server_args(rest), extra, argv)

    assert settings().method == "AMXINT8"
    with pytest.raises(KtSettingsError, match="holds AMXINT8 weights .*--kt-method is AMXINT4"):
        settings("--kt-method", "AMXINT4")


def test_engine_threads_leave_room_for_the_serving_process(tmp_path, monkeypatch):
    """Without --kt-cpuinfer the plugin takes the cores less a quarter (at least one); more than that
    warns, naming the rule."""
    from kt_sglang.engine import pools
    from kt_sglang.sglang.settings import early_server_args, resolve, split_argv
    from kt_sglang.tiny_model import write_tiny_moe

    for cores, expected in [(2, 1), (4, 3), (16, 12), (64, 48)]:
        monkeypatch.setattr(pools, "physical_cores", lambda cores=cores: cores)
        assert pools.serving_threads() == expected
    monkeypatch.undo()
    model = write_tiny_moe(tmp_path / "m")

    def settings(*flags: str):
        argv = ["--model-path", str(model), "--kt-weight-path", str(model), "--kt-method", "BF16", *flags]
        extra, rest = split_argv(argv)
        return resolve(early_server_args(rest), extra, argv)

    assert settings().cpuinfer == pools.serving_threads()
    cores = pools.physical_cores()
    if cores > pools.serving_threads():
        with pytest.warns(UserWarning, match=f"--kt-cpuinfer {cores} leaves fewer than"):
            settings("--kt-cpuinfer", str(cores))


def test_deferral_max_batch_reaches_the_layer_default(tmp_path):
    """--kt-deferral-max-batch: left out, the layer's default applies; given, it is kept."""
    from kt_sglang.layer.hybrid import DEFERRAL_MAX_TOKENS
    from kt_sglang.sglang.settings import early_server_args, resolve, split_argv
    from kt_sglang.tiny_model import write_tiny_moe

    model = write_tiny_moe(tmp_path / "m")

    def settings(*flags: str):
        argv = ["--model-path", str(model), "--kt-weight-path", str(model), "--kt-method", "BF16"]
        argv += ["--kt-cpuinfer", "1", *flags]
        extra, rest = split_argv(argv)
        return resolve(early_server_args(rest), extra, argv)

    assert settings().deferral_max_batch is None and DEFERRAL_MAX_TOKENS == 1
    assert settings("--kt-deferral-max-batch", "8").deferral_max_batch == 8


def test_kt_kernel_inference_methods_are_accepted():
    """kt-kernel's inference method names: LLAMAFILE takes each layer's method from its GGUF file
    (test_gguf.py); MOE_INT4/MOE_INT8 (its general, non-AMX kernels) select AMXINT4/AMXINT8, whose
    kernels run on every ISA."""
    from kt_sglang.engine.methods import FILE_METHODS, Method, parse_method

    kt_kernel = ["AMXINT4", "AMXINT8", "RAWINT4", "FP8", "BF16", "FP8_PERCHANNEL", "MOE_INT4", "MOE_INT8"]
    assert {parse_method(name).value for name in kt_kernel} <= {m.value for m in Method}
    assert parse_method("MOE_INT4") is Method.AMXINT4 and parse_method("moe_int8") is Method.AMXINT8
    assert FILE_METHODS == ("LLAMAFILE",)
    layer = new_layer(method="MOE_INT8")
    assert layer.method is Method.AMXINT8


def test_fine_tuning_refuses_experts_held_elsewhere():
    mask = torch.zeros(E, dtype=torch.bool)
    mask[0] = True
    with pytest.raises(ValueError, match="fine-tuning trains every expert on the CPU"):
        KTMoEWrapper(0, E, K, H, I, mask, 1, 1, mode="sft", method="AMXBF16_SFT")
