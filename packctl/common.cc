#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "packctl/packctl.h"
#include "proto/tensor_codec.h"
#include "workloads/mask_patterns.h"

namespace packd::packctl {
namespace {

// The contents of `path`, which must hold exactly `bytes` bytes (`flag` names
// it in the error).
absl::StatusOr<std::vector<char>> ReadExactly(const std::string& flag,
                                              const std::string& path,
                                              int64_t bytes,
                                              const std::string& needs) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read --", flag, "=", path));
  std::vector<char> out(bytes + 1);
  f.read(out.data(), bytes + 1);
  if (f.gcount() > bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, " holds more than the ", bytes,
                     " bytes ", needs, " needs"));
  }
  if (f.gcount() < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, " holds ", f.gcount(), " bytes; ",
                     needs, " needs ", bytes));
  }
  out.resize(bytes);
  return out;
}

// The packed bytes of x in a reply.
absl::StatusOr<std::string> PackedBytes(const Wire<v1::PackResponse>& reply) {
  if (reply->packed_size() != 1) {
    return absl::InternalError(absl::StrCat("the server returned ",
                                            reply->packed_size(),
                                            " packed tensors for one input"));
  }
  const Payload bytes = reply.BytesOf(reply->packed(0));
  std::string out(bytes.size, '\0');
  bytes.CopyOut(0, bytes.size, out.data());
  return out;
}

}  // namespace

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "packctl: %s\n", message.c_str());
  return code;
}

std::string Batch::Packed() const {
  std::string out;
  for (int64_t i = 0; i < rows(); ++i) {
    if (mask[i]) out.append(x.data() + i * row_bytes(), row_bytes());
  }
  return out;
}

absl::StatusOr<Batch> MakeBatch(const BatchSpec& spec) {
  Batch batch;
  for (absl::string_view part : absl::StrSplit(spec.shape, ',')) {
    int64_t d = 0;
    if (!absl::SimpleAtoi(part, &d) || d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shape=", spec.shape, " is not B,S[,tail...]"));
    }
    batch.shape.push_back(d);
  }
  if (batch.shape.size() < 2)
    return absl::InvalidArgumentError("--shape needs at least B,S");
  if (!ParseDType(spec.dtype, &batch.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype=", spec.dtype, " is not a dtype"));
  }
  MaskPattern pattern;
  if (!ParseMaskPattern(spec.mask, &pattern)) {
    return absl::InvalidArgumentError("--mask must be prefix or holes");
  }
  absl::StatusOr<int64_t> bytes = ByteSize(batch.dtype, batch.shape, "--shape");
  if (!bytes.ok()) return bytes.status();
  const std::string what =
      absl::StrCat("shape ", spec.shape, " of ", DTypeName(batch.dtype));
  std::mt19937_64 rng(std::random_device{}());
  if (!spec.input.empty()) {
    absl::StatusOr<std::vector<char>> x =
        ReadExactly("input", spec.input, *bytes, what);
    if (!x.ok()) return x.status();
    batch.x = *std::move(x);
  } else {
    // Random bytes: packing moves bytes and never reads them as numbers. A
    // bool is 0 or 1.
    batch.x.resize(*bytes);
    for (char& c : batch.x) c = static_cast<char>(rng());
    if (batch.dtype == DType::kBool) {
      for (char& c : batch.x) c &= 1;
    }
  }
  const int64_t B = batch.shape[0], S = batch.shape[1];
  if (const int G = spec.groups; G != 0) {
    const int64_t P = spec.prefix;
    if (G < 0 || P <= 0 || P >= S) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--groups=", G, " --prefix=", P, ": groups of G > 0 rows need a ",
          "prompt of 0 < P < S = ", S, " positions"));
    }
  }
  if (!spec.mask_file.empty()) {
    absl::StatusOr<std::vector<char>> mask =
        ReadExactly("mask_file", spec.mask_file, B * S,
                    absl::StrCat("a [", B, ", ", S, "] mask"));
    if (!mask.ok()) return mask.status();
    for (char c : *mask) batch.mask.push_back(c != 0);
  } else if (spec.groups > 0) {
    // GRPO rows: the prompt, then a response of 1 .. S - P tokens.
    const int64_t P = spec.prefix;
    batch.mask.assign(B * S, 0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t length = std::min(
          S, P + 1 + static_cast<int64_t>(rng() % std::max<int64_t>(S - P, 1)));
      std::fill_n(batch.mask.begin() + b * S, length, 1);
    }
  } else {
    batch.mask = MaskActivity(pattern, B, S, spec.density, rng);
  }
  const int G = spec.groups;
  if (G > 0 && spec.input.empty()) {
    // Generated x: every member's prompt its group's first row's, as a
    // rollout's token ids are (the server checks it: same_inputs).
    const int64_t width = batch.row_bytes(), P = spec.prefix;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t first = b / G * G;
      std::copy_n(batch.x.begin() + first * S * width, P * width,
                  batch.x.begin() + b * S * width);
    }
  }
  return batch;
}

void PackRequestFor(const Batch& batch, const v1::RegionSlice* x_in,
                    const v1::RegionSlice* results,
                    Wire<v1::PackRequest>* request) {
  const int64_t mask_shape[] = {batch.shape[0], batch.shape[1]};
  EncodeTensorHeader(DType::kBool, mask_shape, (*request)->mutable_mask());
  request->Carry(
      (*request)->mask(),
      Payload::Of(batch.mask.data(), static_cast<int64_t>(batch.mask.size())));
  v1::Tensor* x = (*request)->add_inputs();
  EncodeTensorHeader(batch.dtype, batch.shape, x);
  if (x_in != nullptr) {
    *x->mutable_region() = *x_in;
  } else {
    request->Carry(
        *x, Payload::Of(batch.x.data(), static_cast<int64_t>(batch.x.size())));
  }
  if (results != nullptr) *(*request)->add_outputs() = *results;
}

absl::StatusOr<PackResult> PackInline(Connection& connection,
                                      const Batch& batch,
                                      bool with_position_ids,
                                      const LayoutOptions& layout,
                                      bool with_token_mask) {
  Wire<v1::PackRequest> request;
  request->set_with_position_ids(with_position_ids);
  request->set_with_token_mask(with_token_mask);
  EncodeLayout(layout, &request.message());
  PackRequestFor(batch, nullptr, nullptr, &request);
  PackResult result;
  const auto start = std::chrono::steady_clock::now();
  absl::Status status =
      connection.RawCall(0, kPackMethod, request, &result.reply);
  result.ms = std::chrono::duration<double, std::milli>(
                  std::chrono::steady_clock::now() - start)
                  .count();
  if (!status.ok()) return status;
  absl::StatusOr<std::string> packed = PackedBytes(result.reply);
  if (!packed.ok()) return packed.status();
  result.packed = *std::move(packed);
  return result;
}

absl::Status ParseCost(const std::string& text, PlanOptions* options) {
  if (text.empty()) return absl::OkStatus();
  const std::vector<std::string> parts = absl::StrSplit(text, ',');
  if (parts.size() != 2 ||
      !absl::SimpleAtod(parts[0], &options->cost_per_token) ||
      !absl::SimpleAtod(parts[1], &options->cost_per_token_squared)) {
    return absl::InvalidArgumentError(
        "--cost must be A,B (cost = A*P + B*P^2), e.g. --cost=24576,1");
  }
  return absl::OkStatus();
}

void PrintPlanPicture(const v1::PlanResponse& plan, int32_t ranks) {
  constexpr int kWidth = 64;
  std::vector<double> rank_cost(ranks, 0);
  std::vector<int64_t> rank_tokens(ranks, 0);
  for (const v1::MicroBatch& mb : plan.micro_batches()) {
    rank_cost[mb.rank()] += mb.cost();
    rank_tokens[mb.rank()] += mb.tokens();
  }
  const double max = *std::max_element(rank_cost.begin(), rank_cost.end());
  double total = 0;
  for (double c : rank_cost) total += c;
  const double mean = total / ranks;
  std::printf(
      "\neach bar is a micro-batch, as wide as its cost; the costliest rank "
      "is %d columns\n",
      kWidth);
  for (int32_t r = 0; r < ranks; ++r) {
    std::string bar;
    double cumulative = 0;
    int drawn = 0, i = 0;
    for (const v1::MicroBatch& mb : plan.micro_batches()) {
      if (mb.rank() != r) continue;
      cumulative += mb.cost();
      const int end =
          max == 0 ? 0
                   : static_cast<int>(std::lround(kWidth * cumulative / max));
      bar.append(std::max(0, end - drawn), i++ % 2 == 0 ? '#' : '=');
      drawn = std::max(drawn, end);
    }
    bar.resize(kWidth, ' ');
    std::printf("rank %-4d |%s| %7.4f of mean, %lld tokens\n", r, bar.c_str(),
                mean == 0 ? 1.0 : rank_cost[r] / mean,
                static_cast<long long>(rank_tokens[r]));
  }
}

}  // namespace packd::packctl
