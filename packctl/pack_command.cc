// packctl pack: one batch packed (with a layout, or a GRPO stream), its bytes
// and metadata checked against the reference packed here, its first call
// timed apart from the warm ones.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/layout.h"
#include "kernels/shared_prefix.h"
#include "packctl/packctl.h"

namespace packd::packctl {
namespace {

// The layout `options` ask for (docs/design.md §10, §14) for `batch`.
absl::StatusOr<LayoutOptions> LayoutOf(const PackCommandOptions& options,
                                       const Batch& batch) {
  LayoutOptions layout;
  layout.pad_multiple = options.pad_multiple;
  layout.cp_size = options.cp_size;
  layout.cp_rank = options.cp_rank;
  const std::string fixed = options.fixed;
  if (!fixed.empty()) {
    std::vector<std::string> parts = absl::StrSplit(fixed, ',');
    int64_t v[3] = {0, 0, 0};
    if (parts.size() > 3) {
      return absl::InvalidArgumentError(
          "--fixed takes TOKENS,SEQUENCES,MAX_SEQLEN");
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      if (!absl::SimpleAtoi(parts[i], &v[i])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--fixed=", fixed, ": \"", parts[i], "\" is not an integer"));
      }
    }
    layout.fixed = {v[0], v[1], v[2]};
  }
  if (const int G = options.batch.groups; G > 0) {
    const int64_t P = options.batch.prefix, B = batch.shape[0];
    SharedPrefix shared;
    for (int64_t b = 0; b < B; ++b) {
      shared.groups.push_back(b / G);
      shared.prefix_lengths.push_back(P);
    }
    if (options.batch.input.empty()) shared.same_inputs = {0};
    layout.shared_prefix = std::move(shared);
  }
  return layout;
}

// The bytes a Pack of `batch` with `layout` returns (each output row x's row
// of the token it holds, zeros for padding), and its Layout.
absl::StatusOr<std::string> LaidOutBytes(const Batch& batch,
                                         const LayoutOptions& layout,
                                         Layout* out) {
  std::vector<int64_t> starts = {0}, positions;
  for (int64_t b = 0; b < batch.shape[0]; ++b) {
    for (int64_t s = 0; s < batch.shape[1]; ++s) {
      if (batch.mask[b * batch.shape[1] + s]) {
        positions.push_back(b * batch.shape[1] + s);
      }
    }
    starts.push_back(static_cast<int64_t>(positions.size()));
  }
  absl::StatusOr<Layout> laid =
      layout.shared_prefix.has_value()
          ? MakeSharedLayout(starts, layout, /*with_position_ids=*/false)
          : MakeLayout(starts, layout);
  if (!laid.ok()) return laid.status();
  laid->ExpandRuns();  // a shared stream is made of runs
  const int64_t width = batch.row_bytes();
  std::string bytes;
  for (int64_t token : laid->source) {
    if (token < 0) {
      bytes.append(width, '\0');
    } else {
      bytes.append(batch.x.data() + positions[token] * width, width);
    }
  }
  *out = *std::move(laid);
  return bytes;
}

std::string Head(const google::protobuf::RepeatedField<int64_t>& values) {
  const int head = std::min(values.size(), 9);
  return absl::StrCat(
      "[", absl::StrJoin(values.begin(), values.begin() + head, ", "),
      values.size() > head ? ", ..." : "", "]");
}

// What a shared stream saves, and its metadata.
void PrintStream(const Batch& batch, int G, int64_t prefix,
                 const v1::PackResponse& response) {
  const v1::SharedLayout& s = response.shared();
  int64_t active = 0;
  for (uint8_t m : batch.mask) active += m;
  const int64_t rows = response.total_active();
  const double saved_mib =
      static_cast<double>(active - rows) * batch.row_bytes() / 1048576.0;
  std::printf("shared:       %lld groups of %d, prompt %lld\n",
              static_cast<long long>((batch.shape[0] + G - 1) / G), G,
              static_cast<long long>(prefix));
  std::printf(
      "stream:       %lld rows for %lld active tokens: %.1f%% fewer (%.2fx), "
      "%.1f MiB less\n",
      static_cast<long long>(rows), static_cast<long long>(active),
      active > 0 ? 100.0 * (active - rows) / active : 0.0,
      rows > 0 ? static_cast<double>(active) / rows : 0.0, saved_mib);
  std::printf(
      "segments:     %d   max_seqlen_q: %lld   max_seqlen_k: %lld   keys: "
      "%d   targets: %d\n",
      s.segment_row_size(), static_cast<long long>(s.max_seqlen_q()),
      static_cast<long long>(s.max_seqlen_k()), s.kv_index_size(),
      s.pred_index_size());
  std::printf("kv_index:     %s\n", Head(s.kv_index()).c_str());
  std::printf("pred_index:   %s\n", Head(s.pred_index()).c_str());
}

template <typename Values, typename Field>
bool SameValues(const Values& want, const Field& got) {
  return std::equal(want.begin(), want.end(), got.begin(), got.end());
}

bool SameStream(const SharedLayout& want, const v1::SharedLayout& got) {
  return SameValues(want.cu_seqlens_q, got.cu_seqlens_q()) &&
         SameValues(want.cu_seqlens_k, got.cu_seqlens_k()) &&
         SameValues(want.kv_index, got.kv_index()) &&
         SameValues(want.pred_index, got.pred_index()) &&
         SameValues(want.target_cu_seqlens, got.target_cu_seqlens()) &&
         SameValues(want.segment_row, got.segment_row()) &&
         want.max_seqlen_q == got.max_seqlen_q() &&
         want.max_seqlen_k == got.max_seqlen_k();
}

}  // namespace

int PackCommand(Connection& connection, const PackCommandOptions& options) {
  absl::StatusOr<Batch> batch = MakeBatch(options.batch);
  if (!batch.ok()) return Fail(kUsage, std::string(batch.status().message()));
  absl::StatusOr<LayoutOptions> layout = LayoutOf(options, *batch);
  if (!layout.ok()) return Fail(kUsage, std::string(layout.status().message()));
  absl::StatusOr<PackResult> r =
      PackInline(connection, *batch, true, *layout, options.token_mask);
  if (!r.ok()) return Fail(kRpcError, r.status().ToString());
  // The same call again, warm: what a caller that keeps its client pays.
  const int warm_calls = std::max(0, options.warm_calls);
  double warm_ms = 0;
  for (int i = 0; i < warm_calls; ++i) {
    absl::StatusOr<PackResult> again =
        PackInline(connection, *batch, true, *layout);
    if (!again.ok()) return Fail(kRpcError, again.status().ToString());
    if (again->packed != r->packed) {
      return Fail(kCheckFailed,
                  "pack: a warm call returned other bytes than the first");
    }
    warm_ms = i == 0 ? again->ms : std::min(warm_ms, again->ms);
  }
  const v1::PackResponse& response = r->reply.message();
  std::printf("x:            [%s] %s (%.1f MiB)\n",
              absl::StrJoin(batch->shape, ", ").c_str(),
              DTypeName(batch->dtype), batch->x.size() / 1048576.0);
  std::printf("packed:       [%s] (%.1f MiB)\n",
              absl::StrJoin(response.packed(0).shape(), ", ").c_str(),
              r->packed.size() / 1048576.0);
  std::printf("total_active: %lld   max_seqlen: %lld\n",
              static_cast<long long>(response.total_active()),
              static_cast<long long>(response.max_seqlen()));
  std::printf("cu_seqlens:   %s\n", Head(response.cu_seqlens()).c_str());
  const bool shared = layout->shared_prefix.has_value();
  if (layout->any() && !shared) {
    std::printf("cu_seqlens_padded: %s   max_seqlen_padded: %lld\n",
                Head(response.cu_seqlens_padded()).c_str(),
                static_cast<long long>(response.max_seqlen_padded()));
  }
  if (layout->any()) {
    std::printf("position_ids: %s\n", Head(response.position_ids()).c_str());
  }
  if (shared)
    PrintStream(*batch, options.batch.groups, options.batch.prefix, response);
  const std::string& token_mask = response.token_mask();
  if (options.token_mask) {
    const auto tokens = std::count(token_mask.begin(), token_mask.end(), '\1');
    std::printf("token_mask:   %lld token rows, %lld pad or ghost rows\n",
                static_cast<long long>(tokens),
                static_cast<long long>(token_mask.size() - tokens));
  }
  std::printf(
      "time:         %.2f ms the first call (the connection, the first touch "
      "of fresh memory)\n",
      r->ms);
  if (warm_calls > 0) {
    std::printf("              %.2f ms a warm call (the best of %d)\n", warm_ms,
                warm_calls);
  }
  const std::string& output = options.output;
  if (!output.empty()) {
    std::ofstream f(output, std::ios::binary);
    f.write(r->packed.data(), static_cast<std::streamsize>(r->packed.size()));
    if (!f) return Fail(kUsage, "cannot write --output=" + output);
  }
  // Every byte checked against packing here, row by row; a stream's metadata
  // against the op library's.
  Layout laid;
  absl::StatusOr<std::string> want =
      layout->any() ? LaidOutBytes(*batch, *layout, &laid) : batch->Packed();
  if (!want.ok()) return Fail(kCheckFailed, want.status().ToString());
  if (r->packed != *want) {
    return Fail(kCheckFailed,
                "pack: the packed bytes differ from the rows of x the mask "
                "selects (laid out)");
  }
  if (options.token_mask) {
    std::string want_mask(response.total_active(), '\1');
    if (layout->any()) {
      want_mask.clear();
      for (int64_t token : laid.source) want_mask.push_back(token >= 0);
    }
    if (token_mask != want_mask) {
      return Fail(kCheckFailed,
                  "pack: the token mask differs from the layout's token rows");
    }
  }
  if (shared && !SameStream(*laid.shared, response.shared())) {
    return Fail(kCheckFailed,
                "pack: the stream's kv_index, pred_index or cu_seqlens differ "
                "from the op library's");
  }
  std::printf("checked:      the packed bytes equal the masked rows of x%s%s\n",
              shared          ? " in the stream, and its metadata"
              : layout->any() ? ", laid out"
                              : "",
              options.token_mask ? "; the token mask its token rows" : "");
  return kOk;
}

}  // namespace packd::packctl
