// The only pybind11 file: thin wrappers, no logic. Tensors cross as data pointers; the Python side
// (kt_sglang.engine) validates dtypes, shapes and devices before calling in.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/amx/tile_model.h"
#include "kt/aligned_vector.h"
#include "kt/cpu_features.h"
#include "kt/cuda_host.h"
#include "kt/kernels.h"
#include "kt/kt_kernel_layout.h"
#include "kt/lora.h"
#include "kt/membench.h"
#include "kt/moe_layer.h"
#include "kt/packing.h"
#include "kt/quantize.h"
#include "kt/runner.h"
#include "kt/stream_forward.h"
#include "kt/topology.h"

namespace py = pybind11;
using namespace kt;

namespace {

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

CanonicalMatrix canonical(Method method, int64_t N, int64_t K, int group, uintptr_t weight, uintptr_t scales,
                          uintptr_t mins) {
  CanonicalMatrix m{method, N, K, group};
  m.weight = ptr<void>(weight), m.scales = ptr<void>(scales), m.mins = ptr<void>(mins);
  return m;
}

const char* const kTensorDTypes[] = {"bfloat16", "float16",       "float32",       "int8",
                                     "uint8",    "float8_e4m3fn", "float8_e8m0fnu"};
const char* const kTensorShapes[] = {"N,K", "N,K/2", "N,K/group", "N/group,K/group", "N", "1"};

// K padded as a layer pads it: to the group and to 64.
int64_t padded_k(int64_t K, int group) {
  return round_up(K, std::max<int64_t>(group, kKAlign));
}

// Scratch shared by the layers of one runner; opaque to Python.
struct Workspace {
  std::shared_ptr<MoeWorkspace> impl = make_workspace();
};

// What one fine-tuning forward keeps for its backward; opaque to Python.
struct SftSavedHandle {
  std::shared_ptr<SftSaved> impl = make_sft_saved();
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kt-sglang native CPU expert engine";

  py::enum_<Method> method_enum(m, "Method");
  for (const auto& t : kMethodTable) method_enum.value(t.name, t.method);
  py::enum_<DType>(m, "DType")
      .value("float32", DType::kFloat32)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16);

  // kMethodTable as Python data: what kt_sglang.engine.methods builds its enum, checks and CLI
  // choices from.
  m.def("method_table", [] {
    py::list out;
    for (const auto& t : kMethodTable) {
      py::list groups, aliases, tensors;
      for (int g : t.allowed_groups)
        if (g) groups.append(g);
      for (const char* a : t.aliases)
        if (a) aliases.append(a);
      for (const auto& c : t.tensors)
        if (c.name)
          tensors.append(py::make_tuple(c.name, kTensorDTypes[static_cast<int>(c.dtype)],
                                        kTensorShapes[static_cast<int>(c.shape)]));
      out.append(py::dict(
          py::arg("method") = t.method, py::arg("name") = t.name, py::arg("aliases") = aliases,
          py::arg("summary") = t.summary, py::arg("default_group") = t.default_group,
          py::arg("allowed_groups") = groups,
          py::arg("int8_activations") = t.gate_up_input == Activation::kInt8,
          py::arg("int8_h") = t.down_input == Activation::kInt8, py::arg("weight_bits") = t.weight_bits,
          py::arg("scale_bytes") = t.scale_bytes, py::arg("scale_extra_bytes") = t.scale_extra_bytes,
          py::arg("quantizes_dense") = t.quantizes_dense, py::arg("weight_zero") = t.weight_zero,
          py::arg("weight_codes") = t.weight_codes ? py::object(py::str(t.weight_codes)) : py::none(),
          py::arg("checkpoint_format") =
              t.checkpoint_format ? py::object(py::str(t.checkpoint_format)) : py::none(),
          py::arg("tensors") = tensors, py::arg("error_bound") = t.error_bound));
    }
    return out;
  });
  m.def("parse_method", [](const std::string& name) { return parse_method(name); });
  m.attr("packed_file_version") = MoeLayer::kPackedFileVersion;
  m.def("packed_group_bytes", [](Method method, int group) { return group_bytes(method, group); });

  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    return py::dict(
        py::arg("vendor") = f.vendor, py::arg("brand") = f.brand, py::arg("avx2") = f.avx2,
        py::arg("fma") = f.fma, py::arg("f16c") = f.f16c, py::arg("avx512f") = f.avx512f,
        py::arg("avx512bw") = f.avx512bw, py::arg("avx512vl") = f.avx512vl, py::arg("avx512dq") = f.avx512dq,
        py::arg("avx512_vnni") = f.avx512_vnni, py::arg("avx512_bf16") = f.avx512_bf16,
        py::arg("avx512_vbmi") = f.avx512_vbmi, py::arg("amx_tile") = f.amx_tile,
        py::arg("amx_int8") = f.amx_int8, py::arg("amx_bf16") = f.amx_bf16, py::arg("os_avx") = f.os_avx,
        py::arg("os_avx512") = f.os_avx512, py::arg("os_amx") = f.os_amx,
        py::arg("amx_permitted") = f.amx_permitted, py::arg("amx_permission_error") = f.amx_permission_error);
  });
  m.def(
      "amx_tile_program",
      [](const std::string& backend, uintptr_t config, const std::vector<py::tuple>& program) {
        using Op = amx_model::TileOp;
        static const std::pair<const char*, Op::Kind> kinds[] = {
            {"load", Op::kLoad},     {"store", Op::kStore},      {"zero", Op::kZero},
            {"dpbssd", Op::kDpbssd}, {"dpbsud", Op::kDpbsud},    {"dpbusd", Op::kDpbusd},
            {"dpbuud", Op::kDpbuud}, {"dpbf16ps", Op::kDpbf16ps}};
        std::vector<Op> ops;
        for (const py::tuple& t : program) {
          const auto name = t[0].cast<std::string>();
          const auto* kind = std::find_if(std::begin(kinds), std::end(kinds),
                                          [&](const auto& k) { return name == k.first; });
          if (kind == std::end(kinds)) throw std::invalid_argument("unknown tile instruction '" + name + "'");
          Op op{kind->second, {t[1].cast<int>(), 0, 0}};
          if (op.kind == Op::kLoad || op.kind == Op::kStore)
            op.memory = reinterpret_cast<void*>(t[2].cast<uintptr_t>()), op.stride = t[3].cast<int64_t>();
          else if (op.kind != Op::kZero)
            op.tile[1] = t[2].cast<int>(), op.tile[2] = t[3].cast<int>();
          ops.push_back(op);
        }
        const void* cfg = reinterpret_cast<const void*>(config);
        if (backend == "model") return amx_model::run_program(cfg, ops);
        if (backend != "hardware") throw std::invalid_argument("backend is 'model' or 'hardware'");
        if (!isa_supported(Isa::kAmx)) throw std::invalid_argument("this CPU cannot run the 'amx' kernels");
        amx_model::run_program(cfg, ops, /*dry_run=*/true);  // a fault is an exception, not a SIGILL
        kernels::amx::run_tile_program(cfg, ops);
      },
      py::arg("backend"), py::arg("config"), py::arg("program"),
      "Runs a tile program on the AMX model or the tile unit: (name, tile, ...) tuples, see tile_model.h.");
  m.def("amx_model_counters", [] {
    const amx_model::Counters c = amx_model::counters();
    return py::dict(py::arg("configs") = c.configs, py::arg("loads") = c.loads, py::arg("stores") = c.stores,
                    py::arg("zeros") = c.zeros, py::arg("dots") = c.dots,
                    py::arg("load_bytes") = c.load_bytes, py::arg("store_bytes") = c.store_bytes,
                    py::arg("macs") = c.macs);
  });
  m.def("amx_model_reset_counters", &amx_model::reset_counters);
  m.def("isa_paths", [] {
    std::vector<std::string> out;
    for (Isa isa : kAllIsas) out.emplace_back(isa_name(isa));
    return out;
  });
  m.def("supported_isas", [] {
    std::vector<std::string> out;
    for (Isa isa : supported_isas()) out.emplace_back(isa_name(isa));
    return out;
  });
  m.def("best_isa", [] { return std::string(isa_name(best_isa())); });
  m.def("weight_prefetch_bytes", &weight_prefetch_bytes);
  m.def("selected_isa", [] { return std::string(isa_name(selected_isa())); });
  m.def("kernel_families", [](const std::string& isa) {
    const auto parsed = parse_isa(isa);
    if (!parsed) throw std::invalid_argument("unknown ISA '" + isa + "'");
    const KernelTable& t = kernel_table(*parsed);
    py::dict out;
    for (const auto& mt : kMethodTable) {
      const MethodKernels& k = t.method(mt.method);
      out[py::str(std::string(mt.name) + " (bf16 input)")] = isa_name(k.isa_a16);
      if (k.gemm_q8) out[py::str(std::string(mt.name) + " (int8 input)")] = isa_name(k.isa_q8);
    }
    out["SiLU and weighted accumulation"] = isa_name(t.isa_vector);
    out["fine-tuning (adapters, transposed tiles)"] = isa_name(t.lora.isa);
    return out;
  });
  // One method's GEMM of one ISA's table on packed panels (per-kernel tests): m rows of K bf16 values,
  // or of K int8 values quantized per group with their scales and scaled sums, given row-major and
  // gathered here into the engine's tiled layout (kt/kernels.h), which every family reads.
  m.def(
      "gemm",
      [](const std::string& isa, Method method, bool int8_input, int m, int64_t K, int group, uintptr_t rows,
         uintptr_t scales, uintptr_t sums, uintptr_t panels, int npanels, uintptr_t c) {
        const auto parsed = parse_isa(isa);
        if (!parsed) throw std::invalid_argument("unknown ISA '" + isa + "'");
        const MethodKernels& k = kernel_table(*parsed).method(method);
        if (m < 1 || K % group != 0 || K % kKAlign != 0)
          throw std::invalid_argument("gemm: need m >= 1 and K a multiple of the group and of 64");
        if (int8_input && !k.gemm_q8) throw std::invalid_argument("this method has no int8-input kernel");
        const int64_t row_bytes = K * (int8_input ? 1 : 2), ldc = int64_t{npanels} * kPanelWidth;
        AlignedVector<uint8_t> tiled(static_cast<size_t>(round_up(m, kRowBlock) * row_bytes));
        std::vector<const void*> r(m);
        std::vector<const float*> s(m), t(m);
        for (int i = 0; i < m; ++i) {
          uint8_t* row = tiled.data() + i / kRowBlock * kRowBlock * row_bytes + i % kRowBlock * kChunkBytes;
          for (int64_t ch = 0; ch < row_bytes / kChunkBytes; ++ch)
            std::memcpy(row + ch * kTiledChunkStride,
                        ptr<const uint8_t>(rows) + i * row_bytes + ch * kChunkBytes, kChunkBytes);
          r[i] = row;
          s[i] = ptr<const float>(scales) + i * (K / group), t[i] = ptr<const float>(sums) + i * (K / group);
        }
        py::gil_scoped_release release;
        if (int8_input)
          k.gemm_q8(m, K, group,
                    QuantRows{reinterpret_cast<const int8_t* const*>(r.data()), kTiledChunkStride, s.data(),
                              t.data()},
                    ptr<const uint8_t>(panels), npanels, ptr<float>(c), ldc);
        else
          k.gemm_a16(m, K, group,
                     Bf16Rows{reinterpret_cast<const uint16_t* const*>(r.data()), kTiledChunkStride},
                     ptr<const uint8_t>(panels), npanels, ptr<float>(c), ldc);
      },
      py::arg("isa"), py::arg("method"), py::arg("int8_input"), py::arg("m"), py::arg("K"), py::arg("group"),
      py::arg("rows"), py::arg("scales"), py::arg("sums"), py::arg("panels"), py::arg("npanels"),
      py::arg("c"));
  m.def(
      "packed_bytes",
      [](Method method, int group, int64_t N, int64_t K) {
        return packed_matrix_bytes(method, group,
                                   PackRegion{0, round_up(N, kPanelWidth), 0, padded_k(K, group)});
      },
      "Bytes of one packed [N, K] matrix (N padded to 16 channels, K as a layer pads it).");
  m.def(
      "pack_matrix",
      [](Method method, int group, int64_t N, int64_t K, uintptr_t weight, uintptr_t scales, uintptr_t mins,
         uintptr_t out) {
        const CanonicalMatrix src = canonical(method, N, K, group, weight, scales, mins);
        if (!src.complete()) throw std::invalid_argument("pack_matrix: a tensor of the method is missing");
        const PackRegion region{0, round_up(N, kPanelWidth), 0, padded_k(K, group)};
        py::gil_scoped_release release;
        pack_panels(src, region, 0, region.rows / kPanelWidth, ptr<uint8_t>(out));
      },
      "Packs a canonical [N, K] matrix into caller-allocated panels (packed_bytes long).");
  m.def(
      "quantize_activations",
      [](uintptr_t x, int m, int64_t K, int group, uintptr_t q, uintptr_t scales, uintptr_t sums,
         bool per_row) {
        if (K % group != 0) throw std::invalid_argument("K must be a multiple of the group");
        for (int i = 0; i < m; ++i)
          quantize_activation_row(ptr<const float>(x) + i * K, K, group, per_row, ptr<int8_t>(q) + i * K,
                                  ptr<float>(scales) + i * (K / group), ptr<float>(sums) + i * (K / group));
      },
      py::arg("x"), py::arg("m"), py::arg("K"), py::arg("group"), py::arg("q"), py::arg("scales"),
      py::arg("sums"), py::arg("per_row") = false,
      "Quantizes fp32 rows [m, K] to int8 per group (with per_row: one scale per row in every group's "
      "slot), as the engine does its activations.");

  // The element-wise kernels of one ISA's table, for tests (contiguous fp32 / bf16 buffers of n).
  auto table_of = [](const std::string& isa) -> const KernelTable& {
    const auto parsed = parse_isa(isa);
    if (!parsed) throw std::invalid_argument("unknown ISA '" + isa + "'");
    return kernel_table(*parsed);
  };
  m.def(
      "silu_mul",
      [table_of](const std::string& isa, uintptr_t gate, uintptr_t up, int64_t n, uintptr_t h) {
        table_of(isa).silu_mul(ptr<const float>(gate), ptr<const float>(up), n, ptr<uint16_t>(h));
      },
      py::arg("isa"), py::arg("gate"), py::arg("up"), py::arg("n"), py::arg("h"));
  m.def(
      "add_weighted",
      [table_of](const std::string& isa, uintptr_t y, uintptr_t c, float weight, int64_t n) {
        table_of(isa).add_weighted(ptr<float>(y), ptr<const float>(c), weight, n);
      },
      py::arg("isa"), py::arg("y"), py::arg("c"), py::arg("weight"), py::arg("n"));
  m.def(
      "sum_to_bf16",
      [table_of](const std::string& isa, const std::vector<uintptr_t>& parts, int64_t n, bool accumulate,
                 uintptr_t out) {
        std::vector<const float*> p;
        for (uintptr_t a : parts) p.push_back(ptr<const float>(a));
        table_of(isa).sum_to_bf16(p.data(), static_cast<int>(p.size()), n, accumulate, ptr<uint16_t>(out));
      },
      py::arg("isa"), py::arg("parts"), py::arg("n"), py::arg("accumulate"), py::arg("out"));
  m.def("topology", [] {
    const Topology& t = topology();
    py::list nodes;
    for (const auto& n : t.nodes)
      nodes.append(py::dict(py::arg("os_index") = n.os_index, py::arg("cores") = n.cores,
                            py::arg("memory_bytes") = n.memory_bytes));
    return py::dict(py::arg("nodes") = nodes, py::arg("hwloc_version") = t.hwloc_version,
                    py::arg("membind_supported") = t.membind_supported);
  });

  m.def("measure_read_bandwidth", &measure_read_bandwidth, py::arg("bytes"), py::arg("cpus"),
        py::arg("repeats") = 5, py::call_guard<py::gil_scoped_release>(),
        "Read bandwidth in GB/s: one pinned thread per cpu streams its slice of `bytes`.");

  py::class_<Runner, std::shared_ptr<Runner>>(m, "Runner")
      .def(py::init([](const std::vector<std::pair<int, std::vector<int>>>& pools) {
             std::vector<PoolSpec> specs;
             for (const auto& [node, cpus] : pools) specs.push_back({node, cpus});
             return std::make_shared<Runner>(std::move(specs));
           }),
           py::arg("pools"))
      .def("sync", &Runner::sync, py::arg("allow_pending") = 0, py::call_guard<py::gil_scoped_release>())
      .def("wait", &Runner::wait, py::arg("task_id"), py::call_guard<py::gil_scoped_release>())
      .def("pending", &Runner::pending)
      .def("pulls", &Runner::pulls)
      .def_property_readonly("num_threads", &Runner::num_threads)
      .def_property_readonly("num_pools", &Runner::num_pools)
      .def(
          "submit_failing_task",
          [](Runner& r, const std::string& message) {
            return r.submit([message](const WorkerContext& ctx) {
              if (ctx.tid == 0) throw std::runtime_error(message);
            });
          },
          "Enqueues a task that fails with `message` (tests the error path of sync).");

  py::class_<Workspace>(m, "Workspace").def(py::init<>());

  py::class_<MoeLayer>(m, "MoeLayer")
      .def(
          py::init([](std::shared_ptr<Runner> runner, const Workspace& ws, int num_experts, int top_k,
                      int64_t hidden, int64_t intermediate, Method method, int group, const std::string& isa,
                      int64_t max_chunk_tokens, int glu_kind, float glu_limit, float glu_alpha,
                      const std::vector<uint8_t>& absent, std::optional<Method> down_method, int down_group,
                      bool int8_input_per_row) {
            const auto parsed = parse_isa(isa);
            if (!parsed) throw std::invalid_argument("unknown ISA '" + isa + "'");
            MoeConfig c{num_experts, top_k,       hidden,     intermediate,    method,
                        group,       down_method, down_group, max_chunk_tokens};
            c.glu = GluConfig{static_cast<GluKind>(glu_kind), glu_limit, glu_alpha};
            c.absent = absent;
            c.int8_input_per_row = int8_input_per_row;
            return std::make_unique<MoeLayer>(c, std::move(runner), ws.impl, *parsed);
          }),
          py::arg("runner"), py::arg("workspace"), py::arg("num_experts"), py::arg("top_k"),
          py::arg("hidden"), py::arg("intermediate"), py::arg("method"), py::arg("group"), py::arg("isa"),
          py::arg("max_chunk_tokens"), py::arg("glu_kind") = 0, py::arg("glu_limit") = 0.0f,
          py::arg("glu_alpha") = 1.702f, py::arg("absent") = std::vector<uint8_t>{},
          py::arg("down_method") = std::nullopt, py::arg("down_group") = 0,
          py::arg("int8_input_per_row") = false,
          "absent: [num_experts] 1 = held elsewhere (a GPU slot): no packed weights, never computed here; "
          "down_method, down_group: the down projection's where they differ from gate/up's (None: the same); "
          "int8_input_per_row: int8 inputs with one scale per token for gate/up and per row of h for down "
          "(weights with one scale per row over all of K: kt-kernel's numerics)")
      .def(
          "load_biases",
          [](MoeLayer& l, uintptr_t gate, uintptr_t up, uintptr_t down) {
            py::gil_scoped_release release;
            l.load_biases(ptr<const float>(gate), ptr<const float>(up), ptr<const float>(down));
          },
          "fp32 [E, I], [E, I], [E, H] expert biases (0 = none).")
      .def("load_dense",
           [](MoeLayer& l, uintptr_t gate, uintptr_t up, uintptr_t down, DType dtype, int64_t source_experts,
              const std::vector<int64_t>& slot_to_source) {
             py::gil_scoped_release release;
             l.load_dense(ptr<void>(gate), ptr<void>(up), ptr<void>(down), dtype, source_experts,
                          slot_to_source);
           })
      .def(
          "load_canonical",
          [](MoeLayer& l, const std::vector<std::tuple<uintptr_t, uintptr_t, uintptr_t>>& gate,
             const std::vector<std::tuple<uintptr_t, uintptr_t, uintptr_t>>& up,
             const std::vector<std::tuple<uintptr_t, uintptr_t, uintptr_t>>& down, bool partial) {
            const MoeConfig& c = l.config();
            auto build = [&](const auto& src, Method method, int group, int64_t N, int64_t K) {
              std::vector<CanonicalMatrix> out;
              for (const auto& [w, s, mn] : src) out.push_back(canonical(method, N, K, group, w, s, mn));
              return out;
            };
            auto g = build(gate, c.method, c.group, c.intermediate, c.hidden);
            auto u = build(up, c.method, c.group, c.intermediate, c.hidden);
            auto d = build(down, *c.down_method, c.down_group, c.hidden, c.intermediate);
            py::gil_scoped_release release;
            l.load_canonical(g, u, d, partial);
          },
          py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("partial") = false,
          "partial: a held slot of null pointers is left as it is (a few experts a call)")
      .def(
          "submit_forward",
          [](MoeLayer& l, int64_t tokens, uintptr_t tokens_ptr, uintptr_t hidden, uintptr_t ids,
             bool ids_int64, uintptr_t weights, uintptr_t mask, uintptr_t out, bool incremental,
             bool out_fp32) {
            ForwardArgs a;
            a.tokens = tokens, a.tokens_ptr = ptr<const int32_t>(tokens_ptr);
            a.hidden = ptr<const uint16_t>(hidden), a.expert_ids = ptr<const void>(ids);
            a.ids_int64 = ids_int64, a.weights = ptr<const float>(weights);
            a.skip_mask = ptr<const bool>(mask), a.incremental = incremental;
            if (out_fp32)
              a.out_f32 = ptr<float>(out);
            else
              a.out = ptr<uint16_t>(out);
            return l.submit_forward(a);
          },
          py::arg("tokens"), py::arg("tokens_ptr"), py::arg("hidden"), py::arg("ids"), py::arg("ids_int64"),
          py::arg("weights"), py::arg("mask"), py::arg("out"), py::arg("incremental"),
          py::arg("out_fp32") = false,
          "Enqueues a forward; `out` is bf16 [tokens, hidden], or fp32 with out_fp32.")
      .def("drain", &MoeLayer::drain, py::call_guard<py::gil_scoped_release>(),
           "Waits until every forward this layer submitted has finished.")
      .def_property_readonly("isa", [](const MoeLayer& l) { return std::string(isa_name(l.isa())); })
      .def_property_readonly("group", [](const MoeLayer& l) { return l.config().group; })
      .def_property_readonly("int8_input_per_row",
                             [](const MoeLayer& l) { return l.config().int8_input_per_row; })
      .def_property_readonly("down_method", [](const MoeLayer& l) { return *l.config().down_method; })
      .def_property_readonly("down_group", [](const MoeLayer& l) { return l.config().down_group; })
      .def_property_readonly("packed_bytes", &MoeLayer::packed_bytes)
      .def_property_readonly("file_gate_up_bytes", &MoeLayer::file_gate_up_bytes)
      .def_property_readonly("file_down_bytes", &MoeLayer::file_down_bytes)
      .def_property_readonly("mapped", &MoeLayer::mapped)
      .def(
          "export_packed",
          [](const MoeLayer& l, int slot, uintptr_t gate_up, uintptr_t down) {
            py::gil_scoped_release release;
            l.export_packed(slot, ptr<uint8_t>(gate_up), ptr<uint8_t>(down));
          },
          py::arg("slot"), py::arg("gate_up"), py::arg("down"),
          "Copies a held slot's packed weights into the packed file layout (buffers of file_gate_up_bytes "
          "and file_down_bytes).")
      .def("map_packed", &MoeLayer::map_packed, py::arg("path"), py::arg("gate_up_offset"),
           py::arg("down_offset"), py::arg("file_experts"), py::arg("slot_to_file"),
           py::call_guard<py::gil_scoped_release>(),
           "Takes the held slots' weights from a packed file (one pool: computes from the mapping).")
      .def_property_readonly("pool_slices", &MoeLayer::pool_slices)
      .def(
          "packed_view",
          [](const MoeLayer& l) {
            py::list pools;
            for (int p = 0; p < l.num_pools(); ++p) {
              const MoeLayer::PackedSlice s = l.packed_slice(p);
              pools.append(py::dict(py::arg("i_begin") = s.i_begin, py::arg("i_end") = s.i_end,
                                    py::arg("gate_up") = reinterpret_cast<uintptr_t>(s.gate_up),
                                    py::arg("down") = reinterpret_cast<uintptr_t>(s.down),
                                    py::arg("gate_up_bytes") = s.gate_up_bytes,
                                    py::arg("down_bytes") = s.down_bytes));
            }
            return py::dict(py::arg("pools") = pools, py::arg("storage") = l.storage(),
                            py::arg("hidden_padded") = l.hidden_padded(),
                            py::arg("gate_up_block") = l.gate_up_block(), py::arg("mapped") = l.mapped());
          },
          "Where the packed weights are, per pool (expert e at gate_up + storage[e] * gate_up_bytes, "
          "storage -1: not held), for readers of the packed layout (GPU prefill streaming).");

  m.def(
      "check_expert_ids",
      [](uintptr_t ids, bool ids_int64, int64_t tokens, int top_k, int num_experts) {
        check_expert_ids(ptr<const void>(ids), ids_int64, tokens, top_k, num_experts);
      },
      "Raises ValueError naming the first id of a contiguous [tokens, top_k] tensor outside [-1, E).");
  m.def("cuda_host_launch_available", &cuda_host_launch_available);
  m.def("cuda_host_launch_status", &cuda_host_launch_status);
  m.def(
      "stream_signal",
      [] {
        switch (stream_signal()) {
          case StreamSignal::kMemoryOps:
            return "memops";
          case StreamSignal::kHostFunctions:
            return "host-functions";
          case StreamSignal::kNone:
            break;
        }
        return "none";
      },
      "How a CUDA stream hands work to the engine: memops, host-functions or none (no driver).");
  m.def("stream_signal_status", &stream_signal_status);
  m.def("stream_signal_fall_back", &stream_signal_fall_back, py::arg("why"),
        "Host functions from now on where memops was chosen (a failed probe on the device).");
  m.def("host_device_pointer", [](uintptr_t host) { return host_device_pointer(ptr<const void>(host)); });
  m.def("stream_write_value32", &stream_write_value32, py::arg("stream"), py::arg("device_word"),
        py::arg("value"));
  m.def("stream_wait_value32", &stream_wait_value32, py::arg("stream"), py::arg("device_word"),
        py::arg("value"));
  m.def(
      "signal_thread_stats",
      [] {
        const SignalThreadStats s = signal_thread_stats();
        return py::dict(py::arg("armed") = s.armed, py::arg("forwards") = s.forwards);
      },
      "The signal thread's armed StreamForwards and the forwards they ran.");
  py::class_<StreamForward>(m, "StreamForward")
      .def(py::init([](MoeLayer& layer, std::shared_ptr<Runner> runner, uintptr_t tokens_ptr,
                       int64_t max_tokens, uintptr_t hidden, uintptr_t ids, bool ids_int64, uintptr_t weights,
                       uintptr_t mask, uintptr_t out, bool out_fp32, uintptr_t signal_words) {
             ForwardArgs a;
             a.tokens_ptr = ptr<const int32_t>(tokens_ptr), a.max_tokens = max_tokens;
             a.hidden = ptr<const uint16_t>(hidden), a.expert_ids = ptr<const void>(ids);
             a.ids_int64 = ids_int64, a.weights = ptr<const float>(weights);
             a.skip_mask = ptr<const bool>(mask);
             if (out_fp32)
               a.out_f32 = ptr<float>(out);
             else
               a.out = ptr<uint16_t>(out);
             return std::make_unique<StreamForward>(layer, std::move(runner), a, ptr<uint32_t>(signal_words));
           }),
           py::arg("layer"), py::arg("runner"), py::arg("tokens_ptr"), py::arg("max_tokens"),
           py::arg("hidden"), py::arg("ids"), py::arg("ids_int64"), py::arg("weights"), py::arg("mask"),
           py::arg("out"), py::arg("out_fp32") = false, py::arg("signal_words") = 0, py::keep_alive<1, 2>(),
           "signal_words: StreamForward.SIGNAL_WORDS zeroed uint32 of pinned memory (0: host functions only)")
      .def_readonly_static("SIGNAL_WORDS", &StreamForward::kSignalWords)
      .def_readonly_static("READY", &StreamForward::kReady)
      .def_readonly_static("DONE", &StreamForward::kDone)
      .def("submit", &StreamForward::submit, py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("sync", &StreamForward::sync, py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("check", &StreamForward::check)
      .def("arm", &StreamForward::arm, "The signal thread watches the ready word from now on.")
      .def_property_readonly("signalled_forwards", &StreamForward::signalled_forwards);

  py::class_<SftSavedHandle>(m, "SftSaved")
      .def(py::init<>())
      .def_property_readonly("nbytes", [](const SftSavedHandle& h) { return sft_saved_bytes(*h.impl); })
      .def_property_readonly("tokens", [](const SftSavedHandle& h) { return sft_saved_tokens(*h.impl); });
  py::class_<SftMoe>(m, "SftMoe")
      .def(py::init([](MoeLayer& layer, int rank, float alpha, bool skip_lora) {
             return std::make_unique<SftMoe>(layer, LoraConfig{rank, alpha, skip_lora});
           }),
           py::keep_alive<1, 2>())
      .def("set_lora",
           [](SftMoe& s, DType dtype, const std::vector<uintptr_t>& weights,
              const std::vector<uintptr_t>& grads) {
             if (weights.size() != kNumLoraTensors || grads.size() != kNumLoraTensors)
               throw std::invalid_argument("need six LoRA tensors and six gradients");
             LoraTensors t;
             t.dtype = dtype;
             for (int i = 0; i < kNumLoraTensors; ++i)
               t.weight[i] = ptr<const void>(weights[i]), t.grad[i] = ptr<void>(grads[i]);
             py::gil_scoped_release release;
             s.set_lora(t);
           })
      .def(
          "submit_forward",
          [](SftMoe& s, int64_t tokens, uintptr_t hidden, uintptr_t ids, bool ids_int64, uintptr_t weights,
             uintptr_t mask, uintptr_t out, SftSavedHandle* save) {
            SftForwardArgs a;
            a.tokens = tokens, a.hidden = ptr<const uint16_t>(hidden), a.expert_ids = ptr<const void>(ids);
            a.ids_int64 = ids_int64, a.weights = ptr<const float>(weights);
            a.skip_mask = ptr<const bool>(mask), a.out = ptr<uint16_t>(out);
            return s.submit_forward(a, save ? save->impl : nullptr);
          },
          py::arg("tokens"), py::arg("hidden"), py::arg("ids"), py::arg("ids_int64"), py::arg("weights"),
          py::arg("mask"), py::arg("out"), py::arg("save").none(true))
      .def("submit_backward",
           [](SftMoe& s, const SftSavedHandle& saved, uintptr_t grad_out, uintptr_t grad_in,
              uintptr_t grad_weights) {
             SftBackwardArgs a;
             a.grad_out = ptr<const uint16_t>(grad_out), a.grad_in = ptr<float>(grad_in);
             a.grad_weights = ptr<float>(grad_weights);
             return s.submit_backward(saved.impl, a);
           })
      .def("drain", &SftMoe::drain, py::call_guard<py::gil_scoped_release>());

  m.def(
      "quantize_matrix",
      [](Method method, int group, uintptr_t src, DType dtype, int64_t N, int64_t K, uintptr_t weight,
         uintptr_t scales, uintptr_t mins) {
        CanonicalMatrix dst = canonical(method, N, K, group, weight, scales, mins);
        py::gil_scoped_release release;
        quantize_rows(ptr<const void>(src), dtype, dst, 0, N);
      },
      "Quantizes a dense [N, K] matrix into caller-allocated canonical tensors (quantize.h).");
  m.def(
      "read_kt_kernel_tiles",
      [](uintptr_t src, int64_t src_bytes, uintptr_t dst, int64_t dst_bytes, int64_t rows, int64_t row_bytes,
         int64_t row_block, int64_t k_block_bytes, bool int4) {
        const KtKernelTiles t{rows, row_bytes, row_block, k_block_bytes, int4};
        check_kt_kernel_tiles(t);
        if (src_bytes != rows * row_bytes || dst_bytes != rows * row_bytes)
          throw std::invalid_argument("read_kt_kernel_tiles: buffers of " + std::to_string(src_bytes) +
                                      " and " + std::to_string(dst_bytes) + " bytes for a matrix of " +
                                      std::to_string(rows * row_bytes));
        py::gil_scoped_release release;
        read_kt_kernel_tiles(t, ptr<const uint8_t>(src), ptr<uint8_t>(dst));
      },
      "kt-kernel's packed matrix (its tile order) -> canonical row-major bytes (kt_kernel_layout.h).");
}
