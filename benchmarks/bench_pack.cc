// bench_pack: the packd kernels against their limit and their peers, in one run
// on the same data.
//
// clang-format off
//   bench_pack --smoke
//   bench_pack --dtype=bfloat16 --num-prompts=2 --g-sizes=8 --completion-lens=1024 \
//       --hidden-dim=4096 --vocab-sizes=32768 --mask-densities=0.1,0.3,1.0 --json=out.json
// clang-format on
//
// Every row is a median over --repeats runs after a warm-up. Ratios compare
// with the limit, a memcpy of the same bytes into a touched buffer split across
// the same threads packd uses, and with libtorch's x[mask] / nonzero +
// index_select / index_copy_ (packing with libtorch's own ops).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIndexing.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/buffer.h"
#include "base/status_macros.h"
#include "base/torch_interop.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/pack.h"
#include "kernels/registry.h"
#include "kernels/thread_pool.h"
#include "workloads/mask_patterns.h"

ABSL_FLAG(bool, smoke, false,
          "Tiny shapes and few repeats; checks results against torch");
ABSL_FLAG(std::string, device, "cpu", "Device to pack on");
ABSL_FLAG(std::string, dtype, "bfloat16", "dtype of the hidden states");
ABSL_FLAG(int, num_prompts, 2, "Prompts per batch");
ABSL_FLAG(std::string, g_sizes, "8",
          "Completions per prompt (comma-separated); B = prompts * g");
ABSL_FLAG(std::string, completion_lens, "1024",
          "Sequence lengths S (comma-separated)");
ABSL_FLAG(int, hidden_dim, 4096, "Hidden size: the tail of the hidden states");
ABSL_FLAG(std::string, vocab_sizes, "32768,151936",
          "Vocabulary sizes for the memory columns");
ABSL_FLAG(std::string, mask_densities, "0.1,0.3,1.0",
          "Fractions of active positions");
ABSL_FLAG(std::string, mask_kinds, "prefix,holes",
          "Mask patterns: prefix (a completion then padding per row) and holes "
          "(positions active independently; also called random)");
ABSL_FLAG(std::string, token_densities, "0.1,0.5,1.0",
          "Densities for the [64, 4096] int64 token-id case; empty to skip it");
ABSL_FLAG(
    int, threads, 0,
    "CPU threads for packd and the memcpy limit (0: all hardware threads)");
ABSL_FLAG(int, repeats, 20, "Timed runs per row (the median is reported)");
ABSL_FLAG(std::string, json, "", "Also write the rows as JSON to this file");
ABSL_FLAG(int, grpo_groups, 64, "Shared prompts: GRPO groups (prompts)");
ABSL_FLAG(int, grpo_members, 8, "Shared prompts: responses per prompt");
ABSL_FLAG(int, grpo_prompt, 1024,
          "Shared prompts: the prompt's tokens (responses are 128..1024)");

namespace packd {
namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  std::string op, impl, mask, dtype, memory;
  int64_t B = 0, S = 0, tail_bytes = 0, active_rows = 0, bytes_moved = 0;
  double density = 0, median_ms = 0, gbps = 0, vs_limit = 0;
};

double MedianMs(int repeats, const std::function<void()>& fn) {
  fn();  // warm-up: pools, page tables, caches
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    fn();
    ms.push_back(
        std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

std::vector<double> ParseDoubles(const std::string& text) {
  std::vector<double> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    double v = 0;
    if (!absl::SimpleAtod(part, &v)) {
      std::fprintf(stderr, "bench_pack: \"%s\" is not a number\n",
                   std::string(part).c_str());
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

std::vector<int64_t> ParseInts(const std::string& text) {
  std::vector<int64_t> out;
  for (double v : ParseDoubles(text)) out.push_back(static_cast<int64_t>(v));
  return out;
}

// A [B, S] bool mask of `pattern` (workloads/mask_patterns.h).
at::Tensor MakeMask(std::mt19937_64& rng, int64_t B, int64_t S, double density,
                    MaskPattern pattern) {
  std::vector<uint8_t> active = MaskActivity(pattern, B, S, density, rng);
  return at::from_blob(active.data(), {B, S}, at::kByte).to(at::kBool);
}

class Bench {
 public:
  Bench(int repeats, bool check) : repeats_(repeats), check_(check) {}

  // Pack and scatter rows for one x and mask.
  void Run(const at::Tensor& x, const at::Tensor& mask,
           const std::string& mask_kind, double density) {
    const int64_t B = x.size(0), S = x.size(1);
    const TensorView mask_view = AsView(mask);
    const std::vector<TensorView> inputs = {AsView(x)};
    const int64_t rows = mask.sum().item<int64_t>();
    const int64_t row_bytes = B * S == 0 ? 0 : x.nbytes() / (B * S);
    const int64_t packed_bytes = rows * row_bytes;
    const int64_t dense_bytes = x.nbytes();
    Row base;
    base.mask = mask_kind;
    base.dtype = DTypeName(FromScalarType(x.scalar_type()));
    base.B = B;
    base.S = S;
    base.tail_bytes = row_bytes;
    base.density = density;
    base.active_rows = rows;

    // ---- pack: bytes moved = the active rows, read once and written once.
    base.op = "pack";
    base.bytes_moved = packed_bytes;
    at::Tensor src_copy =
        x.flatten().view(at::kByte).narrow(0, 0, packed_bytes).clone();
    at::Tensor touched =
        at::empty({std::max<int64_t>(packed_bytes, 1)}, at::kByte);
    std::memset(touched.data_ptr(), 0, touched.nbytes());
    const double limit = Add(
        base, "memcpy (limit)", "caller buffer, touched",
        [&] {
          ParallelCopy(touched.data_ptr(), src_copy.data_ptr(), packed_bytes);
        },
        0);
    at::Tensor out = at::empty(x.index({mask}).sizes(), x.options());
    std::memset(out.data_ptr(), 0, out.nbytes());
    const std::vector<TensorView> outputs = {AsView(out)};
    PackOptions into;
    into.outputs = outputs;
    Add(
        base, "packd", "caller buffer, touched",
        [&] { Check(Pack(inputs, mask_view, into)); }, limit);
    Add(
        base, "packd end to end", "packd host pool (warm after first call)",
        [&] { Check(Pack(inputs, mask_view)); }, limit);
    Add(
        base, "torch x[mask]", "torch allocator, fresh each call",
        [&] { at::Tensor r = x.index({mask}); }, limit);
    Add(
        base, "torch nonzero+index_select", "torch allocator, fresh each call",
        [&] {
          at::Tensor r = x.flatten(0, 1).index_select(
              0, mask.flatten().nonzero().squeeze(1));
        },
        limit);
    if (check_) Verify(x.index({mask}), AsView(out), "pack");

    // ---- scatter: bytes moved = the whole dense output, active rows copied
    // and the rest zeroed.
    base.op = "scatter";
    base.bytes_moved = dense_bytes;
    const at::Tensor packed = x.index({mask});
    const std::vector<TensorView> packed_views = {AsView(packed)};
    at::Tensor dense_src =
        at::empty({std::max<int64_t>(dense_bytes, 1)}, at::kByte);
    at::Tensor dense_dst =
        at::empty({std::max<int64_t>(dense_bytes, 1)}, at::kByte);
    std::memset(dense_src.data_ptr(), 1, dense_src.nbytes());
    std::memset(dense_dst.data_ptr(), 0, dense_dst.nbytes());
    const double scatter_limit = Add(
        base, "memcpy (limit)", "caller buffer, touched",
        [&] {
          ParallelCopy(dense_dst.data_ptr(), dense_src.data_ptr(), dense_bytes);
        },
        0);
    at::Tensor dense = at::empty(x.sizes(), x.options());
    std::memset(dense.data_ptr(), 0xA5, dense.nbytes());
    const std::vector<TensorView> dense_views = {AsView(dense)};
    ScatterOptions scatter_into;
    scatter_into.outputs = dense_views;
    Add(
        base, "packd", "caller buffer, touched",
        [&] { Check(Scatter(packed_views, mask_view, scatter_into)); },
        scatter_limit);
    Add(
        base, "packd end to end", "packd host pool (warm after first call)",
        [&] { Check(Scatter(packed_views, mask_view)); }, scatter_limit);
    Add(
        base, "torch index_copy_", "torch zeros, fresh each call",
        [&] {
          at::Tensor d = at::zeros(x.sizes(), x.options());
          d.flatten(0, 1).index_copy_(0, mask.flatten().nonzero().squeeze(1),
                                      packed);
        },
        scatter_limit);
    if (check_) {
      at::Tensor expected = at::zeros(x.sizes(), x.options());
      expected.index_put_({mask}, packed);
      Verify(expected, AsView(dense), "scatter");
    }
  }

  void Print() const {
    std::printf("%-7s %-27s %-6s %-8s %5s %11s %5s %7s %9s %9s %8s %7s  %s\n",
                "op", "impl", "mask", "dtype", "B", "S", "dens", "rows", "MiB",
                "ms", "GB/s", "x limit", "output memory");
    for (const Row& r : rows_) {
      std::printf(
          "%-7s %-27s %-6s %-8s %5lld %11s %5.2f %7lld %9.2f %9.3f %8.2f %7.2f "
          " %s\n",
          r.op.c_str(), r.impl.c_str(), r.mask.c_str(), r.dtype.c_str(),
          static_cast<long long>(r.B),
          absl::StrFormat("%d x %dB", r.S, r.tail_bytes).c_str(), r.density,
          static_cast<long long>(r.active_rows), r.bytes_moved / 1048576.0,
          r.median_ms, r.gbps, r.vs_limit, r.memory.c_str());
    }
  }

  // Ratios of packd to its peers, per configuration, as the targets state them.
  void PrintRatios() const {
    std::printf(
        "\nratios per configuration (packd end to end / torch is a speed-up: "
        "higher is "
        "better)\n");
    std::printf("%-7s %-6s %-8s %11s %5s %10s %10s %14s %14s\n", "op", "mask",
                "dtype", "S x row", "dens", "touched/", "e2e/", "e2e/torch",
                "e2e/torch");
    std::printf("%-7s %-6s %-8s %11s %5s %10s %10s %14s %14s\n", "", "", "", "",
                "", "memcpy", "memcpy", "x[mask]|copy_", "index_select");
    for (size_t i = 0; i < rows_.size(); ++i) {
      const Row& limit = rows_[i];
      if (limit.impl != "memcpy (limit)") continue;
      double touched = 0, e2e = 0, torch_a = 0, torch_b = 0;
      for (size_t j = i + 1;
           j < rows_.size() && rows_[j].impl != "memcpy (limit)"; ++j) {
        const Row& r = rows_[j];
        if (r.impl == "packd") touched = r.median_ms;
        if (r.impl == "packd end to end") e2e = r.median_ms;
        if (r.impl == "torch x[mask]" || r.impl == "torch index_copy_")
          torch_a = r.median_ms;
        if (r.impl == "torch nonzero+index_select") torch_b = r.median_ms;
      }
      if (touched == 0 && e2e == 0) continue;  // a layout's (its own table)
      auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
      std::printf(
          "%-7s %-6s %-8s %11s %5.2f %10.2f %10.2f %14.2f %14s\n",
          limit.op.c_str(), limit.mask.c_str(), limit.dtype.c_str(),
          absl::StrFormat("%d x %dB", limit.S, limit.tail_bytes).c_str(),
          limit.density, ratio(limit.median_ms, touched),
          ratio(limit.median_ms, e2e), ratio(torch_a, e2e),
          torch_b > 0 ? absl::StrFormat("%.2f", ratio(torch_b, e2e)).c_str()
                      : "-");
    }
  }

  void WriteJson(const std::string& path) const {
    std::ofstream f(path);
    f << "[\n";
    for (size_t i = 0; i < rows_.size(); ++i) {
      const Row& r = rows_[i];
      f << absl::StrFormat(
          "  {\"op\": \"%s\", \"impl\": \"%s\", \"mask\": \"%s\", \"dtype\": "
          "\"%s\", \"B\": %d, "
          "\"S\": %d, \"tail_bytes\": %d, \"density\": %g, \"active_rows\": "
          "%d, "
          "\"bytes_moved\": %d, \"median_ms\": %.4f, \"gbps\": %.3f, "
          "\"vs_limit\": %.4f, \"memory\": \"%s\"}%s\n",
          r.op, r.impl, r.mask, r.dtype, r.B, r.S, r.tail_bytes, r.density,
          r.active_rows, r.bytes_moved, r.median_ms, r.gbps, r.vs_limit,
          r.memory, i + 1 < rows_.size() ? "," : "");
    }
    f << "]\n";
  }

  // A layout Pack (docs/design.md §10) of x into caller buffers, as a row
  // "packd layout" against a memcpy of the bytes it writes; and the plain
  // Pack of the same batch into a caller buffer. Returns {layout ms, plain
  // ms, limit ms}.
  struct LayoutTimes {
    double layout = 0, plain = 0, limit = 0;
    double documents = 0;  // the plain Pack with the same segment ids
  };
  LayoutTimes RunLayout(const at::Tensor& x, const at::Tensor& mask,
                        const at::Tensor& ids, const LayoutOptions& layout,
                        const std::string& what, double density) {
    const TensorView mask_view = AsView(mask);
    const std::vector<TensorView> inputs = {AsView(x)};
    PackOptions options;
    options.layout = layout;
    if (ids.defined()) options.segment_ids = AsView(ids);
    // The results once, as the reference and for their shapes.
    absl::StatusOr<PackResult> want = Pack(inputs, mask_view, options);
    Check(want);
    std::vector<at::Tensor> outs;
    std::vector<TensorView> out_views;
    int64_t bytes = 0;
    for (const auto* results : {&want->packed, &want->shifted}) {
      for (const ResultTensor& r : *results) {
        outs.push_back(at::zeros(
            std::vector<int64_t>(r.view.shape.begin(), r.view.shape.end()),
            x.options()));
        out_views.push_back(AsView(outs.back()));
        bytes += r.view.nbytes();
      }
    }
    Row base;
    base.op = "pack";
    base.mask = what;
    base.dtype = DTypeName(FromScalarType(x.scalar_type()));
    base.B = x.size(0);
    base.S = x.size(1);
    base.tail_bytes = x.numel() > 0 ? x.nbytes() / (x.size(0) * x.size(1)) : 0;
    base.density = density;
    base.active_rows = want->packed[0].view.shape[0];
    base.bytes_moved = bytes;
    at::Tensor src = at::ones({std::max<int64_t>(bytes, 1)}, at::kByte);
    at::Tensor dst = at::zeros({std::max<int64_t>(bytes, 1)}, at::kByte);
    LayoutTimes t;
    t.limit = Add(
        base, "memcpy (limit)", "caller buffer, touched",
        [&] { ParallelCopy(dst.data_ptr(), src.data_ptr(), bytes); }, 0);
    PackOptions into = options;
    into.outputs = out_views;
    t.layout = Add(
        base, "packd layout", "caller buffers, touched",
        [&] { Check(Pack(inputs, mask_view, into)); }, t.limit);
    for (size_t i = 0; i < outs.size(); ++i) {
      const TensorView& w = i < want->packed.size()
                                ? want->packed[i].view
                                : want->shifted[i - want->packed.size()].view;
      if (check_) Verify(outs[i], w, "layout pack");
    }
    at::Tensor plain_out = at::zeros(x.index({mask}).sizes(), x.options());
    const std::vector<TensorView> plain_views = {AsView(plain_out)};
    PackOptions plain;
    plain.outputs = plain_views;
    t.plain =
        MedianMs(repeats_, [&] { Check(Pack(inputs, mask_view, plain)); });
    if (ids.defined()) {
      plain.segment_ids = AsView(ids);
      t.documents =
          MedianMs(repeats_, [&] { Check(Pack(inputs, mask_view, plain)); });
    }
    return t;
  }

  // Shared prompts (docs/design.md §14): Packs of `xs` ([B, S, *] each) into
  // caller buffers with each of `shared` (rows "packd shared", then "packd
  // shared + targets" when it has shifts), against the plain Pack of the same
  // batch (row "packd", their peer) and the memcpy of the bytes that writes.
  // Returns the milliseconds and bytes written of each, plain first.
  struct Timed {
    double ms = 0;
    int64_t bytes = 0;
  };
  std::vector<Timed> RunShared(const std::vector<at::Tensor>& xs,
                               const at::Tensor& mask,
                               const std::vector<LayoutOptions>& shared,
                               const std::string& what) {
    const TensorView mask_view = AsView(mask);
    std::vector<TensorView> inputs;
    std::vector<std::string> dtypes;
    Row base;
    base.op = "pack";
    base.mask = what;
    base.B = mask.size(0);
    base.S = mask.size(1);
    for (const at::Tensor& x : xs) {
      inputs.push_back(AsView(x));
      dtypes.push_back(DTypeName(FromScalarType(x.scalar_type())));
      base.tail_bytes += x.nbytes() / std::max<int64_t>(mask.numel(), 1);
    }
    base.dtype = absl::StrJoin(dtypes, "+");
    base.density =
        mask.sum().item<double>() / std::max<int64_t>(mask.numel(), 1);
    std::vector<Timed> out;
    double plain_ms = 0;
    for (size_t k = 0; k <= shared.size(); ++k) {
      PackOptions options;
      if (k > 0) options.layout = shared[k - 1];
      absl::StatusOr<PackResult> want = Pack(inputs, mask_view, options);
      Check(want);
      std::vector<at::Tensor> buffers;
      std::vector<TensorView> views;
      int64_t bytes = 0;
      for (const auto* results : {&want->packed, &want->shifted}) {
        for (const ResultTensor& r : *results) {
          buffers.push_back(at::zeros(
              std::vector<int64_t>(r.view.shape.begin(), r.view.shape.end()),
              at::TensorOptions().dtype(ToScalarType(r.view.dtype))));
          views.push_back(AsView(buffers.back()));
          bytes += r.view.nbytes();
        }
      }
      Row row = base;
      row.active_rows = want->packed[0].view.shape[0];
      row.bytes_moved = bytes;
      PackOptions into = options;
      into.outputs = views;
      auto pack = [&] { Check(Pack(inputs, mask_view, into)); };
      if (k == 0) {
        at::Tensor src = at::ones({std::max<int64_t>(bytes, 1)}, at::kByte);
        at::Tensor dst = at::zeros({std::max<int64_t>(bytes, 1)}, at::kByte);
        const double limit = Add(
            row, "memcpy (limit)", "caller buffer, touched",
            [&] { ParallelCopy(dst.data_ptr(), src.data_ptr(), bytes); }, 0);
        plain_ms = Add(row, "packd", "caller buffers, touched", pack, limit);
        out.push_back({plain_ms, bytes});
      } else {
        const LayoutOptions& o = shared[k - 1];
        const std::string impl = !o.shifts.empty() ? "packd shared + targets"
                                 : o.shared_prefix->same_inputs.empty()
                                     ? "packd shared"
                                     : "packd shared, checked";
        // The peer is the plain Pack: vs_limit is plain ms / this ms.
        out.push_back(
            {Add(row, impl, "caller buffers, touched", pack, plain_ms), bytes});
      }
      for (size_t i = 0; i < buffers.size(); ++i) {
        const TensorView& w = i < want->packed.size()
                                  ? want->packed[i].view
                                  : want->shifted[i - want->packed.size()].view;
        if (check_) Verify(buffers[i], w, "shared pack");
      }
    }
    return out;
  }

  int failures() const { return failures_; }

  // Times fn as a row of the JSON (not of the tables printed above), against
  // a limit or peer of limit_ms (0: none). Returns the median ms.
  double Time(Row row, const std::string& impl, const std::string& memory,
              const std::function<void()>& fn, double limit_ms) {
    return Add(std::move(row), impl, memory, fn, limit_ms);
  }

 private:
  double Add(Row row, const std::string& impl, const std::string& memory,
             const std::function<void()>& fn, double limit_ms) {
    row.impl = impl;
    row.memory = memory;
    row.median_ms = MedianMs(repeats_, fn);
    row.gbps = row.median_ms > 0 ? row.bytes_moved / (row.median_ms * 1e6) : 0;
    row.vs_limit =
        row.median_ms > 0 && limit_ms > 0 ? limit_ms / row.median_ms : 1.0;
    rows_.push_back(row);
    return row.median_ms;
  }

  template <typename T>
  void Check(const absl::StatusOr<T>& r) {
    if (!r.ok()) {
      std::fprintf(stderr, "bench_pack: %s\n", r.status().ToString().c_str());
      std::exit(1);
    }
  }

  void Verify(const at::Tensor& expected, const TensorView& actual,
              const char* what) {
    if (expected.nbytes() != actual.nbytes() ||
        std::memcmp(expected.data_ptr(), actual.data, expected.nbytes()) != 0) {
      std::fprintf(stderr, "bench_pack: %s result differs from torch\n", what);
      ++failures_;
    }
  }

  const int repeats_;
  const bool check_;
  std::vector<Row> rows_;
  int failures_ = 0;
};

// The seed's memory columns: logits for every position against
// pack-before-projection.
void AddMemoryLines(int64_t B, int64_t S, int64_t hidden, int64_t itemsize,
                    int64_t active, const std::vector<int64_t>& vocab_sizes,
                    const std::string& kind, double density,
                    std::vector<std::string>* lines) {
  for (int64_t V : vocab_sizes) {
    const double dense = static_cast<double>(B) * S * V * itemsize;
    const double plan = (B + 1) * 8.0 + active * 8.0;  // cu_seqlens + indices
    const double packed = active * hidden * itemsize +
                          static_cast<double>(active) * V * itemsize + plan;
    lines->push_back(
        absl::StrFormat("%-6s %5d %5d %5.2f %7d %8d %14.1f %14.1f %8.2f", kind,
                        B, S, density, active, V, dense / 1048576,
                        packed / 1048576, packed > 0 ? dense / packed : 0.0));
  }
}

// The seed spells flags with hyphens (--num-prompts); abseil names them with
// underscores. Accept both by rewriting the name part of each --flag before
// parsing.
std::vector<std::string> UnderscoreFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& a = args[i];
    if (a == "--") break;
    if (a.rfind("--", 0) != 0) continue;
    const size_t end = std::min(a.find('='), a.size());
    std::replace(a.begin() + 2, a.begin() + end, '-', '_');
  }
  return args;
}

// What the flags ask for (--smoke shrinks it to a few small cases).
struct Config {
  Device device;
  DType dtype = DType::kBFloat16;
  int64_t prompts = 0, hidden = 0;
  std::vector<int64_t> g_sizes, lens, vocab;
  std::vector<double> densities, token_densities;
  int64_t token_rows = 64, token_len = 4096;
  int64_t grpo_groups = 64, grpo_members = 8, grpo_prompt = 1024;
  int64_t grpo_response_min = 128, grpo_response_max = 1024;
  int repeats = 0;
  std::vector<MaskPattern> patterns;
};

absl::StatusOr<Config> ConfigFromFlags() {
  Config c;
  PACKD_ASSIGN_OR_RETURN(c.device,
                         ParseDevice(absl::GetFlag(FLAGS_device), "--device"));
  if (c.device.kind != DeviceKind::kCpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device=", c.device.ToString(),
        ": this benchmark measures the CPU backend; GPU kernels are measured "
        "by tests/gpu/run_gpu_checks.sh"));
  }
  if (!ParseDType(absl::GetFlag(FLAGS_dtype), &c.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dtype=", absl::GetFlag(FLAGS_dtype), " is not a dtype"));
  }
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_mask_kinds),
                                               ',', absl::SkipEmpty())) {
    MaskPattern pattern;
    if (!ParseMaskPattern(std::string_view(name.data(), name.size()),
                          &pattern)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--mask_kinds: \"", name, "\" is not prefix, holes or random"));
    }
    c.patterns.push_back(pattern);
  }
  c.prompts = absl::GetFlag(FLAGS_num_prompts);
  c.g_sizes = ParseInts(absl::GetFlag(FLAGS_g_sizes));
  c.lens = ParseInts(absl::GetFlag(FLAGS_completion_lens));
  c.hidden = absl::GetFlag(FLAGS_hidden_dim);
  c.vocab = ParseInts(absl::GetFlag(FLAGS_vocab_sizes));
  c.densities = ParseDoubles(absl::GetFlag(FLAGS_mask_densities));
  c.token_densities = ParseDoubles(absl::GetFlag(FLAGS_token_densities));
  c.repeats = absl::GetFlag(FLAGS_repeats);
  c.grpo_groups = absl::GetFlag(FLAGS_grpo_groups);
  c.grpo_members = absl::GetFlag(FLAGS_grpo_members);
  c.grpo_prompt = absl::GetFlag(FLAGS_grpo_prompt);
  if (c.grpo_groups < 1 || c.grpo_members < 1 || c.grpo_prompt < 1) {
    return absl::InvalidArgumentError(
        "--grpo_groups, --grpo_members and --grpo_prompt must be positive");
  }
  if (absl::GetFlag(FLAGS_smoke)) {
    c.prompts = 2;
    c.g_sizes = {2};
    c.lens = {64};
    c.hidden = 64;
    c.vocab = {128};
    c.token_rows = 8;
    c.token_len = 128;
    c.grpo_groups = 4;
    c.grpo_members = 3;
    c.grpo_prompt = 32;
    c.grpo_response_min = 8;
    c.grpo_response_max = 32;
    c.repeats = 2;
  }
  return c;
}

// Hidden states [prompts * g, S, hidden] for every shape, pattern and density,
// with the seed's memory lines for each.
void RunHiddenStates(const Config& c, std::mt19937_64& rng, Bench& bench,
                     std::vector<std::string>* memory_lines) {
  for (int64_t g : c.g_sizes) {
    for (int64_t S : c.lens) {
      const int64_t B = c.prompts * g;
      const at::Tensor x =
          at::randint(-1000, 1000, {B, S, c.hidden}, at::kFloat)
              .to(ToScalarType(c.dtype));
      for (MaskPattern pattern : c.patterns) {
        for (double density : c.densities) {
          const at::Tensor mask = MakeMask(rng, B, S, density, pattern);
          bench.Run(x, mask, MaskPatternName(pattern), density);
          AddMemoryLines(B, S, c.hidden, ItemSize(c.dtype),
                         mask.sum().item<int64_t>(), c.vocab,
                         MaskPatternName(pattern), density, memory_lines);
        }
      }
    }
  }
}

// Token ids: 8-byte rows, where one memcpy per run is the wrong tool under a
// fragmented mask.
void RunTokenIds(const Config& c, std::mt19937_64& rng, Bench& bench) {
  const at::Tensor ids =
      at::randint(0, 1 << 30, {c.token_rows, c.token_len}, at::kLong);
  for (MaskPattern pattern : c.patterns) {
    for (double density : c.token_densities) {
      bench.Run(ids, MakeMask(rng, c.token_rows, c.token_len, density, pattern),
                MaskPatternName(pattern), density);
    }
  }
}

// Segment ids of documents of 64 to 1024 tokens laid end to end in each row.
at::Tensor DocumentIds(std::mt19937_64& rng, int64_t B, int64_t S) {
  at::Tensor ids = at::empty({B, S}, at::kInt);
  int32_t* p = ids.data_ptr<int32_t>();
  std::uniform_int_distribution<int64_t> len(64, 1024);
  for (int64_t b = 0; b < B; ++b) {
    int32_t id = 0;
    for (int64_t s = 0; s < S;) {
      const int64_t end = std::min(S, s + len(rng));
      for (; s < end; ++s) p[b * S + s] = id;
      ++id;
    }
  }
  return ids;
}

// The mask scan against a memcpy of the mask's bytes, and what documents
// (segment ids) add to a pack: token ids [64, 4096] int64 and hidden states
// [16, 1024, 4096] bf16 at density 0.3. The rows go to the JSON too: op
// "scan" (impl "memcpy (limit)" and "packd") and op "pack" (impl "packd" and
// "packd segment ids", the latter against the former).
void RunScanAndDocuments(const Config& c, std::mt19937_64& rng, Bench& bench) {
  const int64_t tb = c.token_rows, ts = c.token_len;
  const int64_t hb = c.prompts * c.g_sizes[0], hs = c.lens[0];
  std::printf(
      "\nmask scan and documents (median of %d; ratios: the limit or the same "
      "pack without segment ids over this row)\n",
      c.repeats);
  std::printf("%-44s %-22s %8s %10s %8s\n", "what", "shape", "density", "ms",
              "ratio");
  Backend* span = *Registry::Get(Device::Cpu());
  const Stream no_stream;
  for (double density : {0.1, 0.5, 1.0}) {
    const at::Tensor mask = MakeMask(rng, tb, ts, density, MaskPattern::kHoles);
    at::Tensor copy = at::zeros_like(mask);
    Row row;
    row.op = "scan";
    row.mask = "holes";
    row.dtype = "bool";
    row.B = tb;
    row.S = ts;
    row.tail_bytes = 1;
    row.density = density;
    row.active_rows = mask.sum().item<int64_t>();
    row.bytes_moved = mask.nbytes();
    const double limit = bench.Time(
        row, "memcpy (limit)", "in cache",
        [&] { std::memcpy(copy.data_ptr(), mask.data_ptr(), mask.nbytes()); },
        0);
    const double scan = bench.Time(
        row, "packd", "in cache",
        [&] {
          if (!span->Plan(AsView(mask), no_stream).ok()) std::exit(1);
        },
        limit);
    const std::string shape = absl::StrFormat("[%d, %d] bool", tb, ts);
    std::printf("%-44s %-22s %8.2f %10.4f %8.2f\n",
                "memcpy of the mask bytes (limit)", shape.c_str(), density,
                limit, 1.0);
    std::printf("%-44s %-22s %8.2f %10.4f %8.2f\n", "mask scan (plan)",
                shape.c_str(), density, scan, limit / scan);
  }
  auto pair = [&](const char* name, const at::Tensor& x, const at::Tensor& mask,
                  const at::Tensor& ids, double density) {
    const std::vector<TensorView> inputs = {AsView(x)};
    PackOptions plain, docs;
    docs.segment_ids = AsView(ids);
    Row row;
    row.op = "pack";
    row.mask = absl::StrCat("documents, ", name);
    row.dtype = DTypeName(FromScalarType(x.scalar_type()));
    row.B = x.size(0);
    row.S = x.size(1);
    row.tail_bytes = x.nbytes() / (row.B * row.S);
    row.density = density;
    row.active_rows = mask.sum().item<int64_t>();
    row.bytes_moved = row.active_rows * row.tail_bytes;
    const double a = bench.Time(
        row, "packd", "packd-allocated",
        [&] {
          if (!Pack(inputs, AsView(mask), plain).ok()) std::exit(1);
        },
        0);
    const double b = bench.Time(
        row, "packd segment ids", "packd-allocated",
        [&] {
          if (!Pack(inputs, AsView(mask), docs).ok()) std::exit(1);
        },
        a);
    const std::string shape =
        absl::StrFormat("[%s] %s", absl::StrJoin(x.sizes(), ", "),
                        DTypeName(FromScalarType(x.scalar_type())));
    std::printf("%-44s %-22s %8.2f %10.4f %8s\n",
                absl::StrCat("pack ", name).c_str(), shape.c_str(), density, a,
                "");
    std::printf("%-44s %-22s %8.2f %10.4f %8.2f\n",
                absl::StrCat("pack ", name, " + segment ids").c_str(),
                shape.c_str(), density, b, b / a);
  };
  const at::Tensor ids = at::randint(0, 1 << 30, {tb, ts}, at::kLong);
  const at::Tensor token_mask = MakeMask(rng, tb, ts, 0.5, MaskPattern::kHoles);
  pair("token ids", ids, token_mask, DocumentIds(rng, tb, ts), 0.5);
  const at::Tensor hidden =
      at::randint(-1000, 1000, {hb, hs, c.hidden}, at::kFloat)
          .to(at::kBFloat16);
  const at::Tensor hidden_mask =
      MakeMask(rng, hb, hs, 0.3, MaskPattern::kPrefix);
  pair("hidden states", hidden, hidden_mask, DocumentIds(rng, hb, hs), 0.3);
}

// Layouts (docs/design.md §10) against the memcpy of what they write and
// against the plain Pack of the same batch: hidden states [16, 1024, 4096]
// bf16 at density 0.3 with pad_multiple 16, cp 4 and one shift, and token
// ids [64, 4096] with documents, pad 8 and a shift.
void RunLayouts(const Config& c, std::mt19937_64& rng, Bench& bench) {
  // As packd serves (--keep_freed_memory, the default): the layout's arrays
  // reuse freed memory instead of faulting in fresh pages every call. Only
  // this section runs so (the sections before measure against torch's
  // allocator as it comes).
  KeepFreedMemoryMapped();
  const int64_t tb = c.token_rows, ts = c.token_len;
  const int64_t hb = c.prompts * c.g_sizes[0], hs = c.lens[0];
  struct Case {
    std::string name;
    at::Tensor x, mask, ids;
    LayoutOptions layout;
    double density;
  };
  std::vector<Case> cases;
  {
    Case h;
    h.name = "hidden states, pad 16, cp 4 (rank 1), 1 shift";
    h.x = at::randint(-1000, 1000, {hb, hs, c.hidden}, at::kFloat)
              .to(at::kBFloat16);
    h.mask = MakeMask(rng, hb, hs, 0.3, MaskPattern::kPrefix);
    h.layout.pad_multiple = 16;
    h.layout.cp_size = 4;
    h.layout.cp_rank = 1;
    h.layout.shifts = {{0, 0}};
    h.density = 0.3;
    cases.push_back(std::move(h));
  }
  {
    Case t;
    t.name = "token ids, documents, pad 8, 1 shift";
    t.x = at::randint(0, 1 << 30, {tb, ts, 1}, at::kLong);
    t.mask = MakeMask(rng, tb, ts, 0.5, MaskPattern::kHoles);
    t.ids = DocumentIds(rng, tb, ts);
    t.layout.pad_multiple = 8;
    t.layout.shifts = {{0, -100}};
    t.density = 0.5;
    cases.push_back(std::move(t));
  }
  std::printf(
      "\nlayouts (median of %d): a layout Pack into caller buffers against "
      "the memcpy of the bytes it writes, and against the plain Pack of the "
      "same batch\n",
      c.repeats);
  std::printf("%-48s %9s %9s %9s %9s %8s %7s %7s\n", "case", "limit ms",
              "layout ms", "plain ms", "docs ms", "x limit", "/plain", "/docs");
  for (Case& k : cases) {
    const Bench::LayoutTimes t =
        bench.RunLayout(k.x, k.mask, k.ids, k.layout,
                        k.name.substr(0, k.name.find(',')), k.density);
    const std::string docs =
        t.documents > 0 ? absl::StrFormat("%.3f", t.documents) : "-";
    const std::string over_docs =
        t.documents > 0 ? absl::StrFormat("%.2f", t.layout / t.documents) : "-";
    std::printf("%-48s %9.3f %9.3f %9.3f %9s %8.2f %7.2f %7s\n", k.name.c_str(),
                t.limit, t.layout, t.plain, docs.c_str(), t.limit / t.layout,
                t.layout / t.plain, over_docs.c_str());
  }
}

// Shared prompts (docs/design.md §14): a GRPO batch of --grpo_groups groups
// of --grpo_members responses, each a --grpo_prompt-token prompt and a
// response of 128 .. 1024 tokens; its token ids (int64), log-probs and
// advantages (float32) packed with each prompt once, against the plain Pack
// of the same batch; and with their targets (labels, log-probs and
// advantages in target space) as a GRPO step asks.
void RunSharedPrompts(const Config& c, std::mt19937_64& rng, Bench& bench) {
  KeepFreedMemoryMapped();
  const int64_t G = c.grpo_members, P = c.grpo_prompt;
  const int64_t B = c.grpo_groups * G, S = P + c.grpo_response_max;
  std::vector<uint8_t> active(B * S, 0);
  std::uniform_int_distribution<int64_t> response(c.grpo_response_min,
                                                  c.grpo_response_max);
  for (int64_t b = 0; b < B; ++b) {
    std::fill_n(active.begin() + b * S, P + response(rng), 1);
  }
  const at::Tensor mask =
      at::from_blob(active.data(), {B, S}, at::kByte).to(at::kBool);
  at::Tensor ids = at::randint(0, 151936, {B, S}, at::kLong);
  for (int64_t b = 0; b < B; ++b) {  // every member's prompt its group's
    ids[b].narrow(0, 0, P).copy_(ids[b / G * G].narrow(0, 0, P));
  }
  const at::Tensor logprobs = -at::rand({B, S}, at::kFloat) * 5;
  const at::Tensor advantages = at::randn({B, S}, at::kFloat);
  LayoutOptions shared;
  shared.shared_prefix.emplace();
  for (int64_t b = 0; b < B; ++b) {
    shared.shared_prefix->groups.push_back(b / G);
    shared.shared_prefix->prefix_lengths.push_back(P);
  }
  LayoutOptions checked = shared;  // the token ids' prompts checked equal
  checked.shared_prefix->same_inputs = {0};
  LayoutOptions with_targets = checked;
  with_targets.shifts = {{0, 0}, {1, 0}, {2, 0}};
  const std::string what =
      absl::StrFormat("grpo %dx%d, prompt %d", c.grpo_groups, G, P);
  const std::vector<Bench::Timed> t = bench.RunShared(
      {ids, logprobs, advantages}, mask, {shared, checked, with_targets}, what);
  std::printf(
      "\nshared prompts (median of %d): %s, responses %d..%d; token ids, "
      "log-probs and advantages into caller buffers\n",
      c.repeats, what.c_str(), static_cast<int>(c.grpo_response_min),
      static_cast<int>(c.grpo_response_max));
  std::printf("%-36s %9s %10s %8s %10s\n", "pack", "ms", "MiB out", "/plain",
              "MiB saved");
  const char* names[] = {"plain", "shared (the stream)",
                         "shared, same_inputs checked",
                         "shared + targets (labels, lp, adv)"};
  for (size_t k = 0; k < t.size(); ++k) {
    std::printf("%-36s %9.3f %10.1f %8.2f %10.1f\n", names[k], t[k].ms,
                t[k].bytes / 1048576.0, t[k].ms / t[0].ms,
                (t[0].bytes - t[k].bytes) / 1048576.0);
  }
}

void PrintMemory(const std::vector<std::string>& memory_lines) {
  std::printf(
      "\nmemory: logits for every position (B*S*V) against "
      "pack-before-projection (packed hidden + N*V logits + plan)\n");
  std::printf("%-6s %5s %5s %5s %7s %8s %14s %14s %8s\n", "mask", "B", "S",
              "dens", "N", "V", "dense MiB", "packed MiB", "saving");
  for (const std::string& line : memory_lines) {
    std::printf("%s\n", line.c_str());
  }
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Benchmarks packd's pack and scatter against memcpy and libtorch");
  std::vector<std::string> args = UnderscoreFlagNames(argc, argv);
  std::vector<char*> arg_ptrs;
  for (std::string& a : args) arg_ptrs.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(arg_ptrs.size()), arg_ptrs.data());
  if (absl::GetFlag(FLAGS_threads) > 0) {
    ThreadPool::SetGlobalThreads(absl::GetFlag(FLAGS_threads));
  }
  absl::StatusOr<Config> config = ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "bench_pack: %s\n",
                 std::string(config.status().message()).c_str());
    return 2;
  }
  std::printf(
      "bench_pack: device %s, %d threads, %d repeats (median), libtorch %d "
      "thread(s)\n",
      config->device.ToString().c_str(), ThreadPool::Global().num_threads(),
      config->repeats, at::get_num_threads());
  std::mt19937_64 rng(42);
  Bench bench(config->repeats, /*check=*/true);
  std::vector<std::string> memory_lines;
  RunHiddenStates(*config, rng, bench, &memory_lines);
  RunTokenIds(*config, rng, bench);
  std::printf("\n");
  bench.Print();
  bench.PrintRatios();
  PrintMemory(memory_lines);
  RunScanAndDocuments(*config, rng, bench);
  RunLayouts(*config, rng, bench);
  RunSharedPrompts(*config, rng, bench);
  if (!absl::GetFlag(FLAGS_json).empty()) {
    bench.WriteJson(absl::GetFlag(FLAGS_json));  // the layout rows included
  }
  if (bench.failures() > 0) {
    std::fprintf(stderr, "bench_pack: %d result(s) differ from torch\n",
                 bench.failures());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace packd

int main(int argc, char** argv) { return packd::Main(argc, argv); }
