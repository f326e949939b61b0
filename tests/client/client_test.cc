// packd::Client, PackWithGrad and packctl against the real packd binary.
#include "client/client.h"

#include <ATen/ATen.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/torch_interop.h"
#include "client/autograd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/pack.h"
#include "tests/e2e/server_process.h"
#include "tests/kernels/test_util.h"

#ifndef PACKCTL_BINARY
#error "PACKCTL_BINARY must name packctl"
#endif

namespace packd {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using testing::PackdCommand;
using testing::Rng;
using testing::RunCommand;
using testing::SameBytes;
using testing::ServerProcess;
using testing::UnusedPort;

class ClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = ServerProcess::Start().release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.address = server_->address();
    options.shared_memory_threshold_bytes = 0;  // inline unless a test asks
    client_ = std::move(*Client::Connect(options));
  }
  static ServerProcess* server_;
  std::unique_ptr<Client> client_;
};

ServerProcess* ClientTest::server_ = nullptr;

TEST_F(ClientTest, PackEveryDtypeWithMetadata) {
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kInt32, 5, 77, 0.4, MaskPattern::kHoles);
  std::vector<at::Tensor> xs;
  for (DType d : kAllDTypes)
    xs.push_back(testing::RandomTensor(rng, d, {5, 77, 3}));
  PackCallOptions options;
  options.with_position_ids = true;
  options.cu_seqlens_int32 = true;
  absl::StatusOr<PackedBatch> r = client_->Pack(xs, mask, options);
  ASSERT_TRUE(r.ok()) << r.status();
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_TRUE(SameBytes(testing::ReferencePack(xs[i], mask), r->packed[i]))
        << i;
  }
  const testing::ReferenceMeta meta = testing::ReferenceMetadata(mask);
  EXPECT_EQ(r->cu_seqlens.scalar_type(), at::kInt);
  EXPECT_TRUE(at::equal(r->cu_seqlens,
                        at::tensor(meta.cu_seqlens, at::kLong).to(at::kInt)));
  EXPECT_TRUE(
      at::equal(r->position_ids, at::tensor(meta.position_ids, at::kLong)));
  EXPECT_TRUE(at::equal(r->last_index, at::tensor(meta.last_index, at::kLong)));
  EXPECT_EQ(r->total_active, meta.total_active);
  EXPECT_EQ(r->max_seqlen, meta.max_seqlen);
}

TEST_F(ClientTest, ScatterAndErrorsCarryTheServersCode) {
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 3, 50, 0.5, MaskPattern::kPrefix);
  const int64_t total = mask.sum().item<int64_t>();
  const at::Tensor packed =
      testing::RandomTensor(rng, DType::kBFloat16, {total, 2, 3});
  absl::StatusOr<std::vector<at::Tensor>> dense =
      client_->Scatter({packed}, mask, std::vector<int64_t>{2, 3});
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_TRUE(SameBytes(testing::ReferenceScatter(packed, mask, {3, 50, 2, 3}),
                        (*dense)[0]));

  dense = client_->Scatter({packed}, mask, std::vector<int64_t>{6});
  EXPECT_EQ(dense.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dense.status().message()),
              HasSubstr("tail_shape [6] does not match"));
  absl::StatusOr<PackedBatch> r = client_->Pack({at::zeros({3, 49})}, mask);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(r.status().message()),
      HasSubstr(
          "inputs[0].shape [3, 49] does not start with mask shape [3, 50]"));
  PackCallOptions gpu;
  gpu.device = "cuda:0";
  r = client_->Pack({at::zeros({3, 50})}, mask, gpu);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  r = client_->Pack({at::zeros({3, 50}, at::kComplexFloat)}, mask);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

// A layout through the client (docs/design.md §10): the same bytes and arrays
// as the op library's Pack of the same batch, shifted labels included, and a
// differentiable Pack whose backward scatters with the layout, through the
// shared-memory path too.
TEST_F(ClientTest, LayoutsForParallelAttention) {
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 4, 37, 0.6, MaskPattern::kHoles);
  const at::Tensor ids = at::randint(0, 3, {4, 37}, at::kInt);
  const at::Tensor x = testing::RandomTensor(rng, DType::kBFloat16, {4, 37, 6});
  const at::Tensor tok = testing::RandomTensor(rng, DType::kInt64, {4, 37});
  PackCallOptions options;
  options.segment_ids = ids;
  options.with_position_ids = true;
  options.cu_seqlens_int32 = true;
  options.layout.pad_multiple = 8;
  options.layout.cp_size = 2;
  options.layout.cp_rank = 1;
  options.layout.with_seq_idx = true;
  options.layout.pad_values = {0.5, -1};
  options.layout.shifts = {{1, -100}};
  options.with_token_mask = true;
  // Multimodal positions from tok: a run of three image tokens (value 9)
  // after the first token of row 0's first document.
  at::Tensor tok_ids = tok.clone();
  tok_ids.masked_fill_(tok_ids.eq(9), 8);
  const at::Tensor row0 = at::nonzero(mask[0]).flatten();
  ASSERT_GE(row0.numel(), 4);
  at::Tensor doc_ids = ids.clone();
  for (int k = 0; k < 4; ++k) {
    const int64_t s = row0[k].item<int64_t>();
    doc_ids[0][s] = ids[0][row0[0].item<int64_t>()];
    if (k > 0) tok_ids[0][s] = 9;
  }
  options.segment_ids = doc_ids;
  options.mrope = MRopeOptions{};
  options.mrope->input = 1;
  options.mrope->image_token_id = 9;
  options.mrope->video_token_id = 10;
  options.mrope->spatial_merge_size = 2;
  options.mrope->grids = {{1, 2, 6}};
  absl::StatusOr<PackedBatch> r = client_->Pack({x, tok_ids}, mask, options);
  ASSERT_TRUE(r.ok()) << r.status();
  PackOptions op;
  op.segment_ids = AsView(doc_ids);
  op.with_position_ids = true;
  op.layout = options.layout;
  op.with_token_mask = true;
  op.mrope = options.mrope;
  absl::StatusOr<PackResult> want =
      packd::Pack({AsView(x), AsView(tok_ids)}, AsView(mask), op);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(std::string(static_cast<const char*>(r->token_mask.data_ptr()),
                        r->token_mask.numel()),
            want->token_mask);
  EXPECT_TRUE(at::equal(r->mrope_position_ids,
                        at::tensor(want->mrope_position_ids).view({3, -1})));
  EXPECT_TRUE(SameBytes(r->packed[0], want->packed[0].view));
  EXPECT_TRUE(SameBytes(r->packed[1], want->packed[1].view));
  ASSERT_EQ(r->shifted.size(), 1u);
  EXPECT_TRUE(SameBytes(r->shifted[0], want->shifted[0].view));
  EXPECT_TRUE(at::equal(r->cu_seqlens_padded,
                        at::tensor(want->cu_seqlens_padded).to(at::kInt)));
  EXPECT_EQ(r->cu_seqlens_padded.scalar_type(), at::kInt);
  EXPECT_EQ(r->max_seqlen_padded, want->max_seqlen_padded);
  EXPECT_TRUE(at::equal(r->seq_idx, at::tensor(want->seq_idx)));
  EXPECT_TRUE(at::equal(r->position_ids, at::tensor(want->position_ids)));

  // Backward through the layout (CP; Ulysses), inline and through shared
  // memory: every field that places rows reaches the Scatter.
  for (int64_t threshold : {int64_t{0}, int64_t{1}}) {
    ClientOptions client_options;
    client_options.address = server_->address();
    client_options.shared_memory_threshold_bytes = threshold;
    std::unique_ptr<Client> client = *Client::Connect(client_options);
    LayoutOptions layout;
    if (threshold == 0) {
      layout.pad_multiple = 8;
      layout.cp_size = 2;
      layout.cp_rank = 0;
    } else {
      layout.sp_size = 3;
      layout.sp_rank = 2;
      layout.fixed.tokens = 120;
    }
    at::Tensor xd = at::randn({4, 37, 3}, at::kDouble).requires_grad_();
    absl::StatusOr<at::Tensor> packed =
        PackWithGrad(*client, xd, mask, layout, ids);
    ASSERT_TRUE(packed.ok()) << packed.status();
    const at::Tensor weight = at::randn(packed->sizes(), at::kDouble);
    (*packed * weight).sum().backward();
    ScatterOptions back;
    back.layout = layout;
    back.segment_ids = AsView(ids);
    absl::StatusOr<ScatterResult> dense =
        packd::Scatter({AsView(weight)}, AsView(mask), back);
    ASSERT_TRUE(dense.ok()) << dense.status();
    EXPECT_TRUE(SameBytes(xd.grad(), dense->dense[0].view)) << threshold;
  }

  // Errors carry the server's code and message.
  options.mrope.reset();
  options.segment_ids = ids;
  options.layout.pad_multiple = 6;
  r = client_->Pack({x, tok}, mask, options);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("pad_multiple 6 is not a multiple of 2 * cp_size = 4"));
}

// Large inline calls go as two halves of the rows on two connections: the
// joined result must be the one call's, metadata and documents included.
TEST_F(ClientTest, SplitCallsEqualOneCall) {
  ClientOptions options;
  options.address = server_->address();
  options.shared_memory_threshold_bytes = 0;
  options.split_threshold_bytes = 1;  // every call splits
  std::unique_ptr<Client> split = std::move(*Client::Connect(options));
  options.split_threshold_bytes = 0;  // none does
  std::unique_ptr<Client> whole = std::move(*Client::Connect(options));
  Rng rng = Rng::Fresh();
  for (int64_t B : {2, 5, 8}) {
    const at::Tensor mask = testing::RandomMask(rng, DType::kFloat32, B, 37,
                                                0.5, MaskPattern::kHoles);
    mask.narrow(0, 0, 1).zero_();  // an empty row in the first half
    const at::Tensor ids = at::randint(0, 3, {B, 37}, at::kLong);
    std::vector<at::Tensor> xs;
    for (DType d : kAllDTypes)
      xs.push_back(testing::RandomTensor(rng, d, {B, 37, 3}));
    PackCallOptions call;
    call.with_position_ids = true;
    call.segment_ids = ids;
    absl::StatusOr<PackedBatch> a = split->Pack(xs, mask, call);
    absl::StatusOr<PackedBatch> b = whole->Pack(xs, mask, call);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    for (size_t i = 0; i < xs.size(); ++i) {
      EXPECT_TRUE(SameBytes(testing::ReferencePack(xs[i], mask), a->packed[i]))
          << i;
    }
    for (const auto& [x, y] : {std::pair{a->cu_seqlens, b->cu_seqlens},
                               {a->position_ids, b->position_ids},
                               {a->last_index, b->last_index},
                               {a->doc_cu_seqlens, b->doc_cu_seqlens},
                               {a->doc_row, b->doc_row},
                               {a->doc_last_index, b->doc_last_index}}) {
      EXPECT_TRUE(at::equal(x, y)) << B << ": " << x << " vs " << y;
    }
    EXPECT_EQ(a->total_active, b->total_active);
    EXPECT_EQ(a->max_seqlen, b->max_seqlen);
    EXPECT_EQ(a->doc_max_seqlen, b->doc_max_seqlen);

    const at::Tensor packed =
        testing::RandomTensor(rng, DType::kBFloat16, {a->total_active, 2, 3});
    absl::StatusOr<std::vector<at::Tensor>> dense =
        split->Scatter({packed, packed.view({-1, 6})}, mask);
    ASSERT_TRUE(dense.ok()) << dense.status();
    EXPECT_TRUE(SameBytes(
        testing::ReferenceScatter(packed, mask, {B, 37, 2, 3}), (*dense)[0]));
    EXPECT_TRUE(SameBytes(
        testing::ReferenceScatter(packed.view({-1, 6}), mask, {B, 37, 6}),
        (*dense)[1]));
  }
  // Shapes that do not split go whole, with the whole call's error.
  const at::Tensor mask = at::ones({4, 8}, at::kBool);
  absl::StatusOr<PackedBatch> r = split->Pack({at::zeros({4, 7})}, mask);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("inputs[0].shape [4, 7] does not start with mask "
                        "shape [4, 8]"));
  absl::StatusOr<std::vector<at::Tensor>> d =
      split->Scatter({at::zeros({31, 2})}, mask);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("32"));
}

// Inline tensors of several MiB arrive in many slices: gathered (on the host,
// only up to each row's last active position), they must pack and scatter
// exactly, whatever the mask.
TEST_F(ClientTest, LargeInlineCallsAreExact) {
  Rng rng = Rng::Fresh();
  ClientOptions options;
  options.address = server_->address();
  options.shared_memory_threshold_bytes = 0;
  options.split_threshold_bytes = 0;
  std::unique_ptr<Client> whole = std::move(*Client::Connect(options));
  for (MaskPattern pattern : {MaskPattern::kPrefix, MaskPattern::kHoles}) {
    at::Tensor mask =
        testing::RandomMask(rng, DType::kFloat32, 8, 512, 0.4, pattern);
    mask[1].zero_();
    mask[2].fill_(1);
    mask[3][511] = -0.0;          // inactive
    mask[4][500] = std::nan("");  // active
    const at::Tensor x =
        testing::RandomTensor(rng, DType::kFloat32, {8, 512, 256});
    for (Client* client : {client_.get(), whole.get()}) {
      absl::StatusOr<PackedBatch> r = client->Pack({x}, mask);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(SameBytes(testing::ReferencePack(x, mask), r->packed[0]));
      absl::StatusOr<std::vector<at::Tensor>> dense =
          client->Scatter({r->packed[0]}, mask);
      ASSERT_TRUE(dense.ok()) << dense.status();
      EXPECT_TRUE(SameBytes(
          testing::ReferenceScatter(r->packed[0], mask, {8, 512, 256}),
          (*dense)[0]));
    }
  }
}

// A bearer token from a file or the environment, on every call.
TEST(ClientAuthTest, TokenFromFileOrEnvironment) {
  char dir[] = "/tmp/packd-client-auth-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/tokens";
  std::ofstream(path) << "cc-token\n";
  auto server = ServerProcess::Start({"--auth_token_file=" + path});
  ASSERT_NE(server, nullptr);
  const at::Tensor x = at::randn({2, 3, 4});
  const at::Tensor mask = at::ones({2, 3}, at::kBool);
  ClientOptions options;
  options.address = server->address();
  options.token_env = "";  // none
  std::unique_ptr<Client> anonymous = std::move(*Client::Connect(options));
  EXPECT_EQ(anonymous->Pack({x}, mask).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(*anonymous->Health(), "SERVING");  // health needs no token
  options.token_file = path;
  std::unique_ptr<Client> with_file = std::move(*Client::Connect(options));
  absl::StatusOr<PackedBatch> r = with_file->Pack({x}, mask);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(SameBytes(testing::ReferencePack(x, mask), r->packed[0]));
  options.token_file = "";
  options.token_env = "PACKD_CLIENT_TEST_TOKEN";
  setenv("PACKD_CLIENT_TEST_TOKEN", "cc-token", 1);
  std::unique_ptr<Client> with_env = std::move(*Client::Connect(options));
  EXPECT_TRUE(with_env->Pack({x}, mask).ok());
  unsetenv("PACKD_CLIENT_TEST_TOKEN");
  options.token_env = "";
  options.token_file = std::string(dir) + "/missing";
  EXPECT_EQ(Client::Connect(options).status().code(),
            absl::StatusCode::kFailedPrecondition);
  std::filesystem::remove_all(dir);
}

// The halves travel as two calls: each fits a server limit the whole batch
// passes.
TEST(ClientSplitTest, HalvesAreSeparateCalls) {
  auto server = ServerProcess::Start({"--max_message_bytes=100000"});
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.address = server->address();
  options.shared_memory_threshold_bytes = 0;
  options.split_threshold_bytes = 1;
  std::unique_ptr<Client> split = std::move(*Client::Connect(options));
  options.split_threshold_bytes = 0;
  std::unique_ptr<Client> whole = std::move(*Client::Connect(options));
  const at::Tensor x = at::randn({8, 64, 64});  // 128 KiB
  const at::Tensor mask = at::rand({8, 64}) < 0.5;
  EXPECT_EQ(whole->Pack({x}, mask).status().code(),
            absl::StatusCode::kResourceExhausted);
  absl::StatusOr<PackedBatch> r = split->Pack({x}, mask);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(SameBytes(testing::ReferencePack(x, mask), r->packed[0]));
}

TEST_F(ClientTest, DocumentsWithinRows) {
  const at::Tensor mask =
      at::tensor({1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0}, at::kInt).view({2, 6});
  const at::Tensor ids =
      at::tensor({4, 4, 9, 4, 5, 5, 5, 5, 6, 0, 0, 0}, at::kLong).view({2, 6});
  const at::Tensor x = at::randn({2, 6, 3});
  PackCallOptions options;
  options.with_position_ids = true;
  options.segment_ids = ids;
  options.cu_seqlens_int32 = true;
  absl::StatusOr<PackedBatch> r = client_->Pack({x}, mask, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(SameBytes(x.index({mask.ne(0)}), r->packed[0]));
  EXPECT_TRUE(
      at::equal(r->doc_cu_seqlens, at::tensor({0, 3, 5, 7, 8}, at::kInt)));
  EXPECT_TRUE(at::equal(r->doc_row, at::tensor({0, 0, 1, 1}, at::kLong)));
  EXPECT_TRUE(
      at::equal(r->doc_last_index, at::tensor({3, 5, 1, 2}, at::kLong)));
  EXPECT_EQ(r->doc_max_seqlen, 3);
  EXPECT_TRUE(at::equal(r->position_ids,
                        at::tensor({0, 1, 2, 0, 1, 0, 1, 0}, at::kLong)));
  options.segment_ids = ids.to(at::kFloat);
  r = client_->Pack({x}, mask, options);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("segment_ids"));
}

TEST_F(ClientTest, DeviceMemoryFollowsTheIpcOffsetRule) {
  // A tensor 4 KiB + 256 B into an exported allocation is addressed by that
  // offset from the allocation's start.
  std::vector<char> allocation(1 << 16);
  absl::StatusOr<v1::RegionSlice> slice =
      DeviceSlice("w0", allocation.data(), allocation.data() + 4352, 1024);
  ASSERT_TRUE(slice.ok()) << slice.status();
  EXPECT_EQ(slice->region(), "w0");
  EXPECT_EQ(slice->offset(), 4352u);
  EXPECT_EQ(slice->byte_size(), 1024u);
  EXPECT_EQ(DeviceSlice("w0", allocation.data() + 8, allocation.data(), 1)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A zero handle is refused, with the server's code: FAILED_PRECONDITION
  // where the server has no cuda:0.
  const absl::Status status = client_->RegisterDeviceMemory(
      "w0", std::string(64, '\0'), "cuda:0", 1 << 16);
  EXPECT_FALSE(status.ok());
  absl::StatusOr<v1::ServerInfo> info = client_->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  bool has_cuda0 = false;
  for (const v1::DeviceInfo& d : info->devices()) {
    has_cuda0 = has_cuda0 || d.name() == "cuda:0";
  }
  if (!has_cuda0) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  }
}

// PlanCallOptions reach the server: costs, groups, padding, pipeline order
// and loss tokens all show in the plan; the short form still plans by tokens.
TEST_F(ClientTest, PlansByCostWithGroupsAndPadding) {
  std::vector<int64_t> lengths;
  for (int i = 0; i < 60; ++i) lengths.push_back(100 + 97 * i % 3000);
  PlanCallOptions o;
  o.num_ranks = 2;
  o.micro_batch_multiple = 2;
  o.cost_per_token = 24576;
  o.cost_per_token_squared = 1;
  o.pad_multiple = 64;
  o.pipeline_order = true;
  for (int i = 0; i < 60; ++i) o.groups.push_back(i / 3);
  for (int i = 0; i < 60; ++i) o.loss_tokens.push_back(i % 4 ? lengths[i] : 0);
  absl::StatusOr<v1::PlanResponse> plan =
      client_->PlanMicroBatches(lengths, 8192, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->micro_batches_per_rank() % 2, 0);
  EXPECT_EQ(plan->global_sequences(), 45);
  for (const v1::MicroBatch& mb : plan->micro_batches()) {
    int64_t padded = 0;
    double cost = 0;
    for (int64_t i : mb.samples()) {
      const double p = static_cast<double>((lengths[i] + 63) / 64 * 64);
      padded += static_cast<int64_t>(p);
      cost += 24576 * p + p * p;
      // The other samples of its group are here too.
      for (int64_t j = i / 3 * 3; j < i / 3 * 3 + 3; ++j) {
        EXPECT_NE(std::find(mb.samples().begin(), mb.samples().end(), j),
                  mb.samples().end());
      }
    }
    EXPECT_EQ(mb.padded_tokens(), padded);
    // Within the budget, or one group that alone exceeds it.
    if (mb.padded_tokens() > 8192) EXPECT_EQ(mb.samples_size(), 3);
    EXPECT_DOUBLE_EQ(mb.cost(), cost);
  }
  EXPECT_LT(plan->cost_imbalance(), 1.05);
  absl::StatusOr<v1::PlanResponse> by_tokens =
      client_->PlanMicroBatches(lengths, 8192, 2);
  ASSERT_TRUE(by_tokens.ok()) << by_tokens.status();
  EXPECT_EQ(by_tokens->micro_batches(0).cost(),
            static_cast<double>(by_tokens->micro_batches(0).tokens()));
  o.costs = {1.0};
  EXPECT_EQ(client_->PlanMicroBatches(lengths, 8192, o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The micro-batches of a step, through the C++ client: the plan, then each.
struct Step {
  v1::PlanResponse plan;
  std::vector<StepMicroBatch> micro_batches;
};
absl::StatusOr<Step> RunStep(Client& client,
                             const std::vector<at::Tensor>& tensors,
                             const at::Tensor& mask, int64_t budget,
                             const StepCallOptions& options) {
  Step step;
  absl::Status status = client.PackMicroBatches(
      tensors, mask, budget, options,
      [&](const v1::PlanResponse& plan) {
        step.plan = plan;
        return absl::OkStatus();
      },
      [&](StepMicroBatch mb) {
        step.micro_batches.push_back(std::move(mb));
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return step;
}

at::Tensor RowsOf(const at::Tensor& t, const std::vector<int64_t>& rows) {
  return t.index_select(0, at::tensor(rows, at::kLong));
}

// Every dtype, fresh random data: each micro-batch is torch's boolean pack of
// its rows, every row is in exactly one micro-batch, and the plan's loss
// tokens are the positions active in both masks.
TEST_F(ClientTest, PackMicroBatchesAreTorchsPackOfTheirRows) {
  Rng rng = Rng::Fresh();
  const int64_t B = 23, S = 61;
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kFloat32, B, S, 0.6, MaskPattern::kHoles);
  const at::Tensor loss_mask =
      testing::RandomMask(rng, DType::kUInt8, B, S, 0.5, MaskPattern::kHoles);
  std::vector<at::Tensor> xs;
  for (DType d : kAllDTypes)
    xs.push_back(testing::RandomTensor(rng, d, {B, S, 2}));
  StepCallOptions options;
  options.plan.num_ranks = 3;
  options.plan.cost_per_token = 10;
  options.plan.cost_per_token_squared = 1;
  options.loss_mask = loss_mask;
  options.pack.with_position_ids = true;
  absl::StatusOr<Step> step = RunStep(*client_, xs, mask, 200, options);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->plan.global_loss_tokens(),
            (mask.ne(0) & loss_mask.ne(0)).sum().item<int64_t>());
  ASSERT_EQ(step->micro_batches.size(),
            static_cast<size_t>(step->plan.micro_batches_size()));
  std::vector<int> seen(B, 0);
  for (size_t k = 0; k < step->micro_batches.size(); ++k) {
    const StepMicroBatch& mb = step->micro_batches[k];
    const v1::MicroBatch& planned = step->plan.micro_batches(k);
    EXPECT_EQ(mb.rank, planned.rank());
    EXPECT_EQ(mb.index, k % step->plan.micro_batches_per_rank());
    ASSERT_EQ(mb.samples, std::vector<int64_t>(planned.samples().begin(),
                                               planned.samples().end()));
    for (int64_t b : mb.samples) ++seen[b];
    const at::Tensor rows_mask = RowsOf(mask, mb.samples);
    for (size_t i = 0; i < xs.size(); ++i) {
      EXPECT_TRUE(SameBytes(
          testing::ReferencePack(RowsOf(xs[i], mb.samples), rows_mask),
          mb.batch.packed[i]))
          << "micro-batch " << k << ", input " << i;
    }
    const testing::ReferenceMeta meta = testing::ReferenceMetadata(rows_mask);
    EXPECT_TRUE(at::equal(mb.batch.cu_seqlens, at::tensor(meta.cu_seqlens)));
    EXPECT_TRUE(
        at::equal(mb.batch.position_ids, at::tensor(meta.position_ids)));
    EXPECT_EQ(mb.batch.total_active, planned.tokens());
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), B);
}

// Node-local with shared memory: a step's first call of a shape comes inline
// and says what its results take; every later one comes through the arena the
// client keeps (its results copied out), with the same bytes.
TEST_F(ClientTest, AStepsResultsComeThroughSharedMemoryFromItsSecondCall) {
  Rng rng = Rng::Fresh();
  const int64_t B = 30, S = 256;
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, B, S, 0.6, MaskPattern::kPrefix);
  const at::Tensor tokens = at::randint(0, 1000, {B, S}, at::kLong);
  const at::Tensor hidden =
      testing::RandomTensor(rng, DType::kBFloat16, {B, S, 3});
  ClientOptions o;
  o.address = server_->address();
  o.shared_memory_threshold_bytes = 1;
  std::unique_ptr<Client> client = std::move(*Client::Connect(o));
  StepCallOptions options;
  options.plan.num_ranks = 2;
  options.pack.layout.pad_multiple = 8;
  options.pack.layout.shifts = {{0, -100}};
  options.pack.with_position_ids = true;
  absl::StatusOr<Step> first =
      RunStep(*client, {tokens, hidden}, mask, 1000, options);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_GT(first->micro_batches.size(), 1u);
  for (const StepMicroBatch& mb : first->micro_batches) {
    EXPECT_FALSE(mb.through_shared_memory);
  }
  for (int pass = 0; pass < 2; ++pass) {
    absl::StatusOr<Step> again =
        RunStep(*client, {tokens, hidden}, mask, 1000, options);
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_EQ(again->micro_batches.size(), first->micro_batches.size());
    for (size_t k = 0; k < again->micro_batches.size(); ++k) {
      const StepMicroBatch& a = first->micro_batches[k];
      const StepMicroBatch& b = again->micro_batches[k];
      EXPECT_TRUE(b.through_shared_memory) << "micro-batch " << k;
      EXPECT_EQ(a.samples, b.samples);
      for (size_t i = 0; i < 2; ++i) {
        EXPECT_TRUE(SameBytes(a.batch.packed[i], b.batch.packed[i]));
      }
      EXPECT_TRUE(SameBytes(a.batch.shifted[0], b.batch.shifted[0]));
      EXPECT_TRUE(at::equal(a.batch.position_ids, b.batch.position_ids));
    }
  }
}

// With documents and a layout (padding, shifted labels, position ids): each
// micro-batch is exactly Pack of its rows; only the ranks asked come; bad
// requests are INVALID_ARGUMENT; a callback's error ends the call.
TEST_F(ClientTest, PackMicroBatchesWithALayoutAreTheirRowsPacked) {
  Rng rng = Rng::Fresh();
  const int64_t B = 19, S = 48;
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, B, S, 0.8, MaskPattern::kPrefix);
  const at::Tensor segment_ids =
      at::randint(0, 4, {B, S}, at::kLong).cumsum(1).to(at::kInt);
  const at::Tensor tokens = at::randint(0, 1000, {B, S}, at::kLong);
  const at::Tensor hidden =
      testing::RandomTensor(rng, DType::kBFloat16, {B, S, 5});
  StepCallOptions options;
  options.plan.num_ranks = 4;
  options.plan.micro_batch_multiple = 2;
  options.plan.cost_per_token_squared = 1;
  options.ranks = {3, 1};
  options.pack.segment_ids = segment_ids;
  options.pack.with_position_ids = true;
  options.pack.layout.pad_multiple = 4;
  options.pack.layout.shifts = {{0, -100}};
  absl::StatusOr<Step> step =
      RunStep(*client_, {tokens, hidden}, mask, 160, options);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->plan.micro_batches_per_rank() % 2, 0);
  ASSERT_EQ(step->micro_batches.size(),
            2 * static_cast<size_t>(step->plan.micro_batches_per_rank()));
  for (const StepMicroBatch& mb : step->micro_batches) {
    EXPECT_TRUE(mb.rank == 1 || mb.rank == 3);
    PackCallOptions pack = options.pack;
    pack.segment_ids = RowsOf(segment_ids, mb.samples);
    absl::StatusOr<PackedBatch> expected =
        client_->Pack({RowsOf(tokens, mb.samples), RowsOf(hidden, mb.samples)},
                      RowsOf(mask, mb.samples), pack);
    ASSERT_TRUE(expected.ok()) << expected.status();
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(SameBytes(expected->packed[i], mb.batch.packed[i]));
    }
    EXPECT_TRUE(SameBytes(expected->shifted[0], mb.batch.shifted[0]));
    EXPECT_TRUE(at::equal(expected->position_ids, mb.batch.position_ids));
    EXPECT_TRUE(at::equal(expected->doc_cu_seqlens, mb.batch.doc_cu_seqlens));
    EXPECT_TRUE(
        at::equal(expected->cu_seqlens_padded, mb.batch.cu_seqlens_padded));
    // The plan counted padded documents: the layout's rows.
    int64_t planned = 0;
    for (const v1::MicroBatch& p : step->plan.micro_batches()) {
      if (std::vector<int64_t>(p.samples().begin(), p.samples().end()) ==
          mb.samples) {
        planned = p.padded_tokens();
      }
    }
    EXPECT_EQ(mb.batch.packed[0].size(0), planned);
  }
  StepCallOptions bad = options;
  bad.plan.loss_tokens = std::vector<int64_t>(B, 1);
  absl::StatusOr<Step> refused = RunStep(*client_, {tokens}, mask, 160, bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("plan.loss_tokens"));
  bad = options;
  bad.ranks = {4};
  refused = RunStep(*client_, {tokens}, mask, 160, bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("ranks[0]"));
  int received = 0;
  absl::Status stopped = client_->PackMicroBatches(
      {tokens}, mask, 160, options,
      [](const v1::PlanResponse&) { return absl::OkStatus(); },
      [&](StepMicroBatch) {
        ++received;
        return absl::AbortedError("enough");
      });
  EXPECT_EQ(stopped.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(received, 1);
  // The server goes on serving.
  EXPECT_TRUE(RunStep(*client_, {tokens}, mask, 160, options).ok());
}

// Context parallelism and Ulysses in a step (docs/design.md §12): a row's plan
// length is its rows on one GPU (divided by cp_size; by sp_size, rounded up),
// its loss tokens the whole row's (more than its length: the planner's bound
// does not apply), every rank gets the same plan, and each micro-batch is
// exactly Pack of its rows with the rank's layout.
TEST_F(ClientTest, ContextParallelAndUlyssesStepsPlanPerGpu) {
  Rng rng = Rng::Fresh();
  const int64_t B = 11, S = 24;
  const at::Tensor mask = at::ones({B, S}, at::kBool);
  const at::Tensor segment_ids =
      at::randint(0, 2, {B, S}, at::kLong).cumsum(1).to(at::kInt);
  const at::Tensor tokens = at::randint(0, 1000, {B, S}, at::kLong);
  const at::Tensor loss_mask = at::rand({B, S}).lt(0.9);
  for (const bool ulysses : {false, true}) {
    const int32_t size = ulysses ? 3 : 2;
    std::optional<v1::PlanResponse> first_plan;
    for (int32_t rank = 0; rank < size; ++rank) {
      StepCallOptions options;
      options.plan.num_ranks = 3;
      options.loss_mask = loss_mask;
      options.pack.segment_ids = segment_ids;
      options.pack.layout.shifts = {{0, -100}};
      if (ulysses) {
        options.pack.layout.sp_size = size;
        options.pack.layout.sp_rank = rank;
      } else {
        options.pack.layout.pad_multiple = 4;
        options.pack.layout.cp_size = size;
        options.pack.layout.cp_rank = rank;
      }
      absl::StatusOr<Step> step =
          RunStep(*client_, {tokens}, mask, 48, options);
      ASSERT_TRUE(step.ok()) << step.status();
      if (first_plan.has_value()) {
        EXPECT_EQ(step->plan.SerializeAsString(),
                  first_plan->SerializeAsString());
      } else {
        first_plan = step->plan;
      }
      EXPECT_EQ(step->plan.global_loss_tokens(),
                (mask.ne(0) & loss_mask.ne(0)).sum().item<int64_t>());
      for (const StepMicroBatch& mb : step->micro_batches) {
        PackCallOptions pack = options.pack;
        pack.segment_ids = RowsOf(segment_ids, mb.samples);
        absl::StatusOr<PackedBatch> expected = client_->Pack(
            {RowsOf(tokens, mb.samples)}, RowsOf(mask, mb.samples), pack);
        ASSERT_TRUE(expected.ok()) << expected.status();
        EXPECT_TRUE(SameBytes(expected->packed[0], mb.batch.packed[0]));
        EXPECT_TRUE(SameBytes(expected->shifted[0], mb.batch.shifted[0]));
        // Its rows on this GPU are within what the plan counted for them.
        const v1::MicroBatch& planned = step->plan.micro_batches(
            mb.rank * step->plan.micro_batches_per_rank() + mb.index);
        EXPECT_LE(mb.batch.packed[0].size(0), planned.tokens());
        if (!ulysses) EXPECT_EQ(mb.batch.packed[0].size(0), planned.tokens());
      }
    }
  }
  // A layout the micro-batches would refuse is refused before the plan.
  StepCallOptions bad;
  bad.pack.layout.cp_size = 2;
  bool planned = false;
  absl::Status refused = client_->PackMicroBatches(
      {tokens}, mask, 48, bad,
      [&](const v1::PlanResponse&) {
        planned = true;
        return absl::OkStatus();
      },
      [](StepMicroBatch) { return absl::OkStatus(); });
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("batch.pad_multiple 0 is not a multiple of 2 * "
                        "cp_size = 4"));
  EXPECT_FALSE(planned);
}

// Shared prompts through the client (docs/design.md §14): Pack is the op
// library's, its metadata as tensors; Scatter in both modes; PackWithGrad's
// backward is the stream's Scatter; a step keeps each group whole, and each
// micro-batch is Pack of its rows.
TEST_F(ClientTest, SharedPromptsThroughTheClient) {
  Rng rng = Rng::Fresh();
  const int64_t B = 8, S = 12;
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, B, S, 0.9, MaskPattern::kPrefix);
  const std::vector<int64_t> active = [&] {
    const at::Tensor a = mask.ne(0).sum(1).to(at::kLong);
    return std::vector<int64_t>(a.data_ptr<int64_t>(),
                                a.data_ptr<int64_t>() + B);
  }();
  SharedPrefix shared;
  for (int64_t b = 0; b < B; ++b) shared.groups.push_back(b % 3);
  for (int64_t b = 0; b < B; ++b) {
    int64_t p = S;
    for (int64_t m = b % 3; m < B; m += 3) p = std::min(p, active[m]);
    shared.prefix_lengths.push_back(p / 2);
  }
  const at::Tensor tokens = at::randint(0, 1000, {B, S}, at::kLong);
  PackCallOptions options;
  options.with_position_ids = true;
  options.layout.shared_prefix = shared;
  options.layout.shifts = {{0, -100}};
  absl::StatusOr<PackedBatch> r = client_->Pack({tokens}, mask, options);
  ASSERT_TRUE(r.ok()) << r.status();
  PackOptions op;
  op.with_position_ids = true;
  op.layout = options.layout;
  absl::StatusOr<PackResult> want =
      packd::Pack({AsView(tokens)}, AsView(mask), op);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(SameBytes(r->packed[0], want->packed[0].view));
  EXPECT_TRUE(SameBytes(r->shifted[0], want->shifted[0].view));
  EXPECT_EQ(r->total_active, want->total_active);
  ASSERT_TRUE(r->shared.has_value());
  EXPECT_TRUE(
      at::equal(r->shared->kv_index, at::tensor(want->shared->kv_index)));
  EXPECT_TRUE(
      at::equal(r->shared->pred_index, at::tensor(want->shared->pred_index)));
  EXPECT_TRUE(at::equal(r->shared->cu_seqlens_k,
                        at::tensor(want->shared->cu_seqlens_k)));
  EXPECT_EQ(r->shared->max_seqlen_k, want->shared->max_seqlen_k);

  // Per-target values back to [B, S], and the stream's gradient.
  ScatterCallOptions back;
  back.layout.shared_prefix = shared;
  back.layout.shared_prefix->targets = true;
  absl::StatusOr<std::vector<at::Tensor>> dense =
      client_->Scatter({r->shifted[0]}, mask, back);
  ASSERT_TRUE(dense.ok()) << dense.status();
  ScatterOptions lib;
  lib.layout = back.layout;
  absl::StatusOr<ScatterResult> lib_dense =
      packd::Scatter({AsView(r->shifted[0])}, AsView(mask), lib);
  ASSERT_TRUE(lib_dense.ok()) << lib_dense.status();
  EXPECT_TRUE(SameBytes((*dense)[0], lib_dense->dense[0].view));
  LayoutOptions layout;
  layout.shared_prefix = shared;
  at::Tensor x = at::randn({B, S, 3}, at::kDouble).requires_grad_();
  absl::StatusOr<at::Tensor> packed = PackWithGrad(*client_, x, mask, layout);
  ASSERT_TRUE(packed.ok()) << packed.status();
  const at::Tensor weight = at::randn(packed->sizes(), at::kDouble);
  (*packed * weight).sum().backward();
  lib = {};
  lib.layout = layout;
  lib_dense = packd::Scatter({AsView(weight)}, AsView(mask), lib);
  ASSERT_TRUE(lib_dense.ok()) << lib_dense.status();
  EXPECT_TRUE(SameBytes(x.grad(), lib_dense->dense[0].view));

  // A step: groups whole in one micro-batch, each micro-batch its rows packed.
  StepCallOptions step;
  step.plan.num_ranks = 2;
  step.pack = options;
  absl::StatusOr<Step> ran = RunStep(*client_, {tokens}, mask, 24, step);
  ASSERT_TRUE(ran.ok()) << ran.status();
  std::set<int64_t> seen;
  for (const StepMicroBatch& mb : ran->micro_batches) {
    std::set<int64_t> groups;
    for (int64_t b : mb.samples) groups.insert(b % 3);
    for (int64_t g : groups) {
      for (int64_t b = g; b < B; b += 3) {
        EXPECT_TRUE(std::count(mb.samples.begin(), mb.samples.end(), b))
            << "group " << g << " is split";
      }
    }
    PackCallOptions pack = options;
    pack.layout.shared_prefix->groups.clear();
    pack.layout.shared_prefix->prefix_lengths.clear();
    for (int64_t b : mb.samples) {
      pack.layout.shared_prefix->groups.push_back(shared.groups[b]);
      pack.layout.shared_prefix->prefix_lengths.push_back(
          shared.prefix_lengths[b]);
      seen.insert(b);
    }
    absl::StatusOr<PackedBatch> expected = client_->Pack(
        {RowsOf(tokens, mb.samples)}, RowsOf(mask, mb.samples), pack);
    ASSERT_TRUE(expected.ok()) << expected.status();
    EXPECT_TRUE(SameBytes(expected->packed[0], mb.batch.packed[0]));
    EXPECT_TRUE(SameBytes(expected->shifted[0], mb.batch.shifted[0]));
    EXPECT_TRUE(
        at::equal(expected->shared->pred_index, mb.batch.shared->pred_index));
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(B));
  // plan.groups are the shared prefix's: giving them too is refused.
  step.plan.groups = std::vector<int64_t>(B, 0);
  EXPECT_THAT(
      std::string(
          RunStep(*client_, {tokens}, mask, 24, step).status().message()),
      HasSubstr("plan.groups must be empty with batch.shared_prefix"));
}

// packd_step_micro_batches_held from a server's metrics, -1 when absent.
int64_t MicroBatchesHeld(const std::string& metrics) {
  const std::string text = testing::HttpGet(metrics, "/metrics");
  const std::string name = "\npackd_step_micro_batches_held ";
  const size_t at = text.find(name);
  return at == std::string::npos ? -1
                                 : std::stoll(text.substr(at + name.size()));
}

// Backpressure is the stream's: while the reader is slow, the server holds at
// most two packed micro-batches (the one being sent and the next), not the
// step; once it has read them all, none.
TEST(ClientStep, ASlowReaderHoldsTheServerToTwoMicroBatches) {
  auto server = ServerProcess::Start({"--metrics_listen=127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  const std::string metrics = server->MetricsAddress();
  ASSERT_FALSE(metrics.empty()) << server->Log();
  ClientOptions options;
  options.address = server->address();
  std::unique_ptr<Client> client = std::move(*Client::Connect(options));
  const int64_t B = 96, S = 4096;
  const at::Tensor mask = at::ones({B, S}, at::kBool);
  const at::Tensor tokens = at::randint(0, 1000, {B, S}, at::kLong);
  const at::Tensor x = at::randn({B, S, 16});  // 2.3 MiB per 8 rows
  StepCallOptions step;
  int received = 0;
  std::vector<int64_t> held;
  absl::Status status = client->PackMicroBatches(
      {tokens, x}, mask, 8 * S, step,
      [](const v1::PlanResponse& plan) {
        EXPECT_EQ(plan.micro_batches_size(), 12);
        return absl::OkStatus();
      },
      [&](StepMicroBatch mb) {
        if (++received <= 4) {
          // While this reader waits, the server packs ahead (however slowly
          // a loaded machine lets it: up to 10 s), then stops: given another
          // 100 ms, it still holds no more than two.
          const absl::Time deadline = absl::Now() + absl::Seconds(10);
          while (MicroBatchesHeld(metrics) < 1 && absl::Now() < deadline) {
            absl::SleepFor(absl::Milliseconds(20));
          }
          absl::SleepFor(absl::Milliseconds(100));
          held.push_back(MicroBatchesHeld(metrics));
        }
        EXPECT_TRUE(SameBytes(testing::ReferencePack(RowsOf(x, mb.samples),
                                                     RowsOf(mask, mb.samples)),
                              mb.batch.packed[1]));
        return absl::OkStatus();
      });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(received, 12);
  ASSERT_EQ(held.size(), 4u);
  for (int64_t n : held) {
    EXPECT_GE(n, 1);  // it packs ahead
    EXPECT_LE(n, 2);  // and no further
  }
  int64_t after = MicroBatchesHeld(metrics);
  for (int i = 0; i < 100 && after != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    after = MicroBatchesHeld(metrics);
  }
  EXPECT_EQ(after, 0);
}

TEST_F(ClientTest, InfoAndHealth) {
  absl::StatusOr<v1::ServerInfo> info = client_->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->default_device(), "cpu");
  EXPECT_EQ(*client_->Health(""), "SERVING");
  EXPECT_EQ(*client_->Health(), "SERVING");
}

TEST_F(ClientTest, SharedMemoryTensorsTravelAsHandlesAndResultsAreReadInPlace) {
  Rng rng = Rng::Fresh();
  absl::StatusOr<std::unique_ptr<SharedMemory>> in =
      client_->CreateSharedMemory(8 << 20);
  absl::StatusOr<std::unique_ptr<SharedMemory>> out =
      client_->CreateSharedMemory(8 << 20);
  ASSERT_TRUE(in.ok() && out.ok()) << in.status() << out.status();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 8, 256, 0.3, MaskPattern::kHoles);
  at::Tensor x = (*in)->Empty({8, 256, 64}, at::kHalf);
  x.copy_(testing::RandomTensor(rng, DType::kFloat16,
                                {8, 256, 64}));  // written in place
  PackCallOptions options;
  options.results_in = out->get();
  absl::StatusOr<PackedBatch> r = client_->Pack({x}, mask, options);
  ASSERT_TRUE(r.ok()) << r.status();
  v1::RegionSlice slice;
  EXPECT_TRUE(
      (*out)->Contains(r->packed[0].data_ptr(), r->packed[0].nbytes(), &slice));
  EXPECT_TRUE(SameBytes(testing::ReferencePack(x, mask), r->packed[0]));

  // Registered on the server while alive, gone after.
  grpc::ClientContext context;
  v1::ListRegionsResponse list;
  ASSERT_TRUE(client_->stub()
                  .ListRegions(&context, v1::ListRegionsRequest(), &list)
                  .ok());
  EXPECT_EQ(list.regions_size(), 2);
  in->reset();
  out->reset();
  grpc::ClientContext context2;
  ASSERT_TRUE(client_->stub()
                  .ListRegions(&context2, v1::ListRegionsRequest(), &list)
                  .ok());
  EXPECT_EQ(list.regions_size(), 0);
}

TEST_F(ClientTest, AutomaticHandlesGiveTheSameBytesAsInline) {
  ClientOptions options;
  options.address = server_->address();
  options.shared_memory_threshold_bytes = 1;
  std::unique_ptr<Client> shm_client = std::move(*Client::Connect(options));
  Rng rng = Rng::Fresh();
  const at::Tensor mask = testing::RandomMask(rng, DType::kFloat32, 4, 300, 0.5,
                                              MaskPattern::kHoles);
  const at::Tensor x =
      testing::RandomTensor(rng, DType::kBFloat16, {4, 300, 33});
  absl::StatusOr<PackedBatch> a = shm_client->Pack({x}, mask);
  absl::StatusOr<PackedBatch> b = client_->Pack({x}, mask);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_TRUE(SameBytes(a->packed[0], b->packed[0]));
  absl::StatusOr<std::vector<at::Tensor>> da =
      shm_client->Scatter({a->packed[0]}, mask);
  ASSERT_TRUE(da.ok()) << da.status();
  EXPECT_TRUE(SameBytes(
      testing::ReferenceScatter(b->packed[0], mask, {4, 300, 33}), (*da)[0]));
  grpc::ClientContext context;
  v1::ListRegionsResponse list;
  ASSERT_TRUE(client_->stub()
                  .ListRegions(&context, v1::ListRegionsRequest(), &list)
                  .ok());
  EXPECT_EQ(list.regions_size(), 1);  // the automatic scratch segment
}

TEST_F(ClientTest, AutogradBackwardIsScatterOfTheGradient) {
  Rng rng = Rng::Fresh();
  for (double density : {0.4, 1.0, 0.0}) {
    SCOPED_TRACE(density);
    const at::Tensor mask = testing::RandomMask(rng, DType::kUInt8, 3, 40,
                                                density, MaskPattern::kHoles);
    at::Tensor x = at::randn({3, 40, 5}, at::kDouble).set_requires_grad(true);
    absl::StatusOr<at::Tensor> packed = PackWithGrad(*client_, x, mask);
    ASSERT_TRUE(packed.ok()) << packed.status();
    EXPECT_TRUE(SameBytes(x.detach().index({mask.ne(0)}), packed->detach()));
    const at::Tensor g = at::randn(packed->sizes(), at::kDouble);
    packed->backward(g);
    absl::StatusOr<std::vector<at::Tensor>> expected =
        client_->Scatter({g}, mask);
    ASSERT_TRUE(expected.ok());
    EXPECT_TRUE(SameBytes((*expected)[0], x.grad()));
    EXPECT_TRUE(
        SameBytes(testing::ReferenceScatter(g, mask, {3, 40, 5}), x.grad()));
  }
  absl::StatusOr<at::Tensor> bad =
      PackWithGrad(*client_, at::zeros({2, 2}), at::ones({3, 3}));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument)
      << bad.status();
}

// Every combination of empty tensors (no active row, B = 0, S = 0, an empty
// tail) and expanded or non-contiguous gradients, inline and through shared
// memory: x.grad equals torch's own, bit for bit.
TEST_F(ClientTest, BackwardOfEmptyTensorsAndStridedGradients) {
  ClientOptions shm_options;
  shm_options.address = server_->address();
  shm_options.shared_memory_threshold_bytes = 1;
  std::unique_ptr<Client> shm = std::move(*Client::Connect(shm_options));
  // Losses whose gradients reach packed expanded (stride 0, also when empty),
  // transposed, and plain.
  const std::vector<std::pair<const char*, at::Tensor (*)(const at::Tensor&)>>
      losses = {
          {"sum (expanded)", [](const at::Tensor& p) { return p.sum(); }},
          {"transposed",
           [](const at::Tensor& p) {
             const at::Tensor w = at::arange(p.numel(), p.options())
                                      .reshape({p.size(1), p.size(0)});
             return (p.t() * w).sum();
           }},
          {"weighted (contiguous)",
           [](const at::Tensor& p) {
             return (p * at::linspace(-1, 1, p.numel(), p.options())
                             .reshape(p.sizes()))
                 .sum();
           }},
      };
  Rng rng = Rng::Fresh();
  for (Client* client : {client_.get(), shm.get()}) {
    for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
             {2, 4, 8}, {0, 4, 8}, {2, 0, 8}, {2, 4, 0}}) {
      for (double density : {0.0, 1.0, 0.5}) {
        const at::Tensor mask =
            testing::RandomMask(rng, DType::kBool, shape[0], shape[1], density,
                                MaskPattern::kHoles);
        for (const auto& [name, loss] : losses) {
          SCOPED_TRACE(absl::StrCat(client == shm.get() ? "shm" : "inline",
                                    " x [", absl::StrJoin(shape, ", "),
                                    "], density ", density, ", ", name));
          at::Tensor x = at::randn(shape, at::kFloat).set_requires_grad(true);
          at::Tensor ref = x.detach().clone().set_requires_grad(true);
          absl::StatusOr<at::Tensor> packed = PackWithGrad(*client, x, mask);
          ASSERT_TRUE(packed.ok()) << packed.status();
          loss(*packed).backward();
          loss(ref.index({mask})).backward();
          ASSERT_TRUE(x.grad().defined());
          EXPECT_TRUE(SameBytes(ref.grad(), x.grad()));
        }
      }
    }
  }
}

// Regions the client registers carry its lease; when the server drops one
// (lease run out, restart), the next call registers it again, contents and
// tensors intact, without the caller doing anything. Names never linger in
// /dev/shm.
TEST(ClientLeases, RegionsComeBackAfterTheirLeaseAndAfterARestart) {
  auto server = ServerProcess::Start();
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.address = server->address();
  options.lease_seconds = 1;
  std::unique_ptr<Client> client = std::move(*Client::Connect(options));
  absl::StatusOr<std::unique_ptr<SharedMemory>> in =
      client->CreateSharedMemory(1 << 20);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + (*in)->key()));
  Rng rng = Rng::Fresh();
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 6, 100, 0.5, MaskPattern::kHoles);
  at::Tensor x = (*in)->Empty({6, 100, 16}, at::kFloat);
  x.copy_(testing::RandomTensor(rng, DType::kFloat32, {6, 100, 16}));
  const at::Tensor expected = testing::ReferencePack(x, mask);
  auto regions = [&] {
    grpc::ClientContext context;
    v1::ListRegionsResponse list;
    EXPECT_TRUE(client->stub()
                    .ListRegions(&context, v1::ListRegionsRequest(), &list)
                    .ok());
    return list;
  };
  auto pack_is_exact = [&](const char* when) {
    SCOPED_TRACE(when);
    absl::StatusOr<PackedBatch> r = client->Pack({x}, mask);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(SameBytes(expected, r->packed[0]));
  };
  pack_is_exact("registered");
  v1::ListRegionsResponse list = regions();
  ASSERT_EQ(list.regions_size(), 1);
  EXPECT_EQ(list.regions(0).lease_seconds(), 1u);

  absl::SleepFor(absl::Milliseconds(1600));
  EXPECT_EQ(regions().regions_size(), 0) << "the lease did not run out";
  pack_is_exact("after the lease ran out");
  EXPECT_EQ(regions().regions_size(), 1);
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + (*in)->key()));

  ASSERT_TRUE(server->Restart());
  pack_is_exact("after a restart");
  EXPECT_EQ(regions().regions_size(), 1);
}

// dns:/// addresses (a headless Kubernetes Service) default to round_robin,
// which connects to every address the name resolves to; others keep gRPC's
// pick_first. Calls work either way.
TEST(ClientBalancing, DnsAddressesDefaultToRoundRobin) {
  const int port = UnusedPort();
  auto server =
      ServerProcess::Start({absl::StrCat("--listen=127.0.0.1:", port)});
  ASSERT_NE(server, nullptr);
  for (const auto& [address, policy] :
       std::vector<std::pair<std::string, std::string>>{
           {absl::StrCat("dns:///127.0.0.1:", port), "round_robin"},
           {absl::StrCat("127.0.0.1:", port), "pick_first"}}) {
    ClientOptions options;
    options.address = address;
    std::unique_ptr<Client> client = std::move(*Client::Connect(options));
    EXPECT_TRUE(client->Info().ok()) << address;
    EXPECT_EQ(client->LoadBalancingPolicy(), policy) << address;
  }
  ClientOptions chosen;
  chosen.address = absl::StrCat("dns:///127.0.0.1:", port);
  chosen.load_balancing_policy = "pick_first";
  std::unique_ptr<Client> client = std::move(*Client::Connect(chosen));
  EXPECT_TRUE(client->Info().ok());
  EXPECT_EQ(client->LoadBalancingPolicy(), "pick_first");
}

TEST(ClientResilience, RetriesUnavailableWithBackoffThenGivesUp) {
  ClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", UnusedPort());
  options.max_attempts = 3;
  options.initial_backoff = absl::Milliseconds(100);
  std::unique_ptr<Client> client = std::move(*Client::Connect(options));
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ServerInfo> info = client->Info();
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable)
      << info.status();
  EXPECT_GE(absl::Now() - start,
            absl::Milliseconds(300));  // waited 100 + 200 ms between tries
}

// A restart loses no call: while four clients call Pack in a loop, the server
// is stopped with SIGTERM (it drains) and started again on the same address,
// four times, and every call returns the exact result. Besides the draining
// server's UNAVAILABLE, a call that reaches the server while gRPC shuts it
// down is cancelled by gRPC itself (CANCELLED, grpc/grpc#41785), and the
// channel must reconnect within the retries' time: the client retries both,
// and reconnects on the retries' schedule.
TEST(ClientResilience, CallsLoseNothingToRollingRestarts) {
  auto server =
      ServerProcess::Start({absl::StrCat("--listen=127.0.0.1:", UnusedPort()),
                            "--drain_seconds=10"});
  ASSERT_NE(server, nullptr);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> calls{0};
  absl::Mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> workers;
  for (int w = 0; w < 4; ++w) {
    workers.emplace_back([&] {
      ClientOptions options;
      options.address = server->address();
      // Retries for longer than any restart takes here: the default, about
      // 5 s, covers one on an idle machine, and other tests may run beside.
      options.max_attempts = 20;
      std::unique_ptr<Client> client = std::move(*Client::Connect(options));
      while (!stop) {
        const at::Tensor x = at::randint(-100, 100, {4, 32, 8}, at::kFloat);
        const at::Tensor mask = at::rand({4, 32}) < 0.5;
        absl::StatusOr<PackedBatch> r = client->Pack({x}, mask);
        ++calls;
        if (r.ok() && SameBytes(r->packed[0], x.index({mask}))) continue;
        absl::MutexLock lock(&mu);
        failures.push_back(r.ok() ? "a wrong result" : r.status().ToString());
      }
    });
  }
  bool restarted = true;
  for (int i = 0; i < 4 && restarted; ++i) {
    // Up for longer than the longest backoff, so that every client is back.
    absl::SleepFor(absl::Milliseconds(2500));
    server->Signal(SIGTERM);
    EXPECT_EQ(server->Wait(absl::Seconds(20)), 0) << server->Log();
    restarted = server->Restart();
  }
  absl::SleepFor(absl::Milliseconds(300));
  stop = true;
  for (std::thread& t : workers) t.join();
  EXPECT_TRUE(restarted);
  EXPECT_THAT(failures, IsEmpty()) << "of " << calls << " calls";
  EXPECT_GT(calls, 100);
}

TEST(ClientResilience, DeadlineExceeded) {
  auto server = ServerProcess::Start({"--call_delay_ms=2000"},
                                     ServerProcess::Binary::kTesting);
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.address = server->address();
  options.deadline = absl::Milliseconds(300);
  std::unique_ptr<Client> client = std::move(*Client::Connect(options));
  absl::StatusOr<PackedBatch> r =
      client->Pack({at::zeros({1, 2})}, at::ones({1, 2}, at::kBool));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded)
      << r.status();
  EXPECT_FALSE(Client::Connect(ClientOptions{.address = ""}).ok());
}

// Runs packctl with `args`; returns its exit code and fills `output` (stdout
// and stderr).
int Packctl(const std::string& args, std::string* output) {
  return RunCommand(absl::StrCat(PACKCTL_BINARY, " ", args), output);
}

// --help says what each packctl command does, with an example of each, and
// lists the flags of packctl and packd under the tool's name, not under the
// path of the machine that built it.
TEST(Tools, HelpNamesEveryCommandAndTheFlagsWithoutBuildPaths) {
  std::string out;
  Packctl("--help", &out);
  for (const char* command :
       {"health", "info", "probe", "pack", "bench", "plan", "step"}) {
    EXPECT_THAT(out, HasSubstr(absl::StrCat("\n  ", command, " "))) << command;
    EXPECT_THAT(out, HasSubstr(absl::StrCat("packctl ", command)))
        << "an example of " << command;
  }
  EXPECT_THAT(out, HasSubstr("Flags from packctl:"));
  EXPECT_THAT(out, HasSubstr("--max_latency_ms"));
  EXPECT_THAT(out, Not(HasSubstr(".cc")));

  RunCommand(PackdCommand("--help"), &out);
  EXPECT_THAT(out, HasSubstr("Flags from packd:"));
  for (const char* flag :
       {"--listen", "--max_inflight_bytes", "--health_listen",
        "--tls_cert_file", "--auth_token_file"}) {
    EXPECT_THAT(out, HasSubstr(flag));
  }
  EXPECT_THAT(out, Not(HasSubstr(".cc")));
}

// packctl needs no libtorch: it is the tool of the server image, which has
// none.
TEST(Tools, PackctlDoesNotLinkLibtorch) {
  FILE* pipe = popen(absl::StrCat("ldd ", PACKCTL_BINARY).c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), pipe)) > 0;)
    out.append(buf, n);
  ASSERT_EQ(pclose(pipe), 0) << out;
  EXPECT_THAT(out, HasSubstr("libgrpc++"));
  EXPECT_THAT(out, Not(HasSubstr("libtorch")));
  EXPECT_THAT(out, Not(HasSubstr("libc10")));
}

// Runs packctl with `args`: it exits with `code`, and says each of `says`.
void ExpectPackctl(const std::string& args, int code,
                   std::initializer_list<std::string> says = {}) {
  std::string out;
  EXPECT_EQ(Packctl(args, &out), code) << args << "\n" << out;
  for (const std::string& s : says) {
    EXPECT_THAT(out, HasSubstr(s)) << args;
  }
}

TEST_F(ClientTest, PackctlCommandsAndExitCodes) {
  const std::string at = absl::StrCat("--address=", server_->address(), " ");
  std::string out;
  ExpectPackctl(at + "health", 0,
                {"readiness (packd.v1.PackService): SERVING"});
  ExpectPackctl(at + "info", 0, {"default device:   cpu"});
  ExpectPackctl(at + "probe", 0, {"probe ok"});
  ExpectPackctl(at + "probe --max_latency_ms=0.000001", 1,
                {"over --max_latency_ms"});
  ExpectPackctl(at + "pack --shape=4,64,8 --dtype=float32 --density=1", 0,
                {"total_active: 256   max_seqlen: 64",
                 "cu_seqlens:   [0, 64, 128, 192, 256]"});
  ExpectPackctl(at + "pack --shape=4,64,8 --dtype=float32 --density=1 "
                     "--pad_multiple=48 --token_mask",
                0,
                {"token_mask:   256 token rows, 128 pad or ghost rows",
                 "laid out; the token mask its token rows"});

  const std::string lengths = ::testing::TempDir() + "/packctl_lengths.txt";
  {
    std::ofstream f(lengths);
    f << "100\n200\n300\n400\n";
  }
  // The picture: 100 + 400 and 200 + 300, each rank one full-width bar.
  ExpectPackctl(
      at + "plan --ranks=2 --max_tokens=500 --lengths_file=" + lengths, 0,
      {"packd:       1 micro-batches per rank (lower bound 1), cost imbalance "
       "1.00000",
       "global_loss_tokens: 1000",
       "rank 1    |" + std::string(64, '#') + "|  1.0000 of mean, 500 tokens"});
  ExpectPackctl(at +
                    "plan --ranks=2 --max_tokens=300 --cost=0,1 "
                    "--pad_multiple=64 --pipeline_order --lengths_file=" +
                    lengths,
                0, {"cost 0*P + 1*P^2", "peer slime"});
  ExpectPackctl(at + "plan --distribution=zipf", 2);
  ExpectPackctl(at + "plan --cost=24576", 2, {"--cost must be A,B"});
  // A step: the plan, its picture, every micro-batch's token ids checked.
  ExpectPackctl(
      at + "step --batch=32,512 --ranks=2 --max_tokens=2048 --cost=1024,1", 0,
      {"batch 32 x 512", "rank 1    |", "rank 1   #0 ", "micro-batches in"});
  // A GRPO batch with its prompts once: the stream, its saving and metadata,
  // checked; and the combinations shared prompts are not defined with.
  ExpectPackctl(
      at + "pack --shape=8,64,2 --dtype=float32 --groups=4 --prefix=16", 0,
      {"shared:       2 groups of 4, prompt 16", "fewer",
       "kv_index:     [0, 1, 2, 3,", "in the stream, and its metadata"});
  ExpectPackctl(at + "pack --shape=8,64 --groups=4 --prefix=64", 2,
                {"need a prompt of 0 < P < S = 64"});
  ExpectPackctl(at + "pack --shape=8,64 --groups=4 --prefix=8 --pad_multiple=8",
                3, {"shared_prefix with pad_multiple 8 is not"});
  ExpectPackctl(at + "step --batch=32", 2, {"is not B,S"});
  ExpectPackctl(at + "step --batch=4,8 --max_tokens=0", 3);

  const std::string input = ::testing::TempDir() + "/packctl_input.bin";
  {
    std::ofstream f(input, std::ios::binary);
    const at::Tensor x = at::arange(2 * 3 * 2, at::kInt);
    f.write(static_cast<const char*>(x.data_ptr()), x.nbytes());
  }
  EXPECT_EQ(
      Packctl(
          at + "pack --shape=2,3,2 --dtype=int32 --density=1 --input=" + input,
          &out),
      0)
      << out;
  EXPECT_EQ(
      Packctl(at + "pack --shape=2,3,5 --dtype=int32 --input=" + input, &out),
      2)
      << out;
  EXPECT_THAT(out, HasSubstr("holds 48 bytes"));

  // A batch from files, every dtype: the bytes packctl writes are torch's
  // x[mask], and a mask file of the wrong size is refused.
  const std::string mask_file = ::testing::TempDir() + "/packctl_mask.bin";
  const std::string output = ::testing::TempDir() + "/packctl_packed.bin";
  for (at::ScalarType dtype :
       {at::kBFloat16, at::kHalf, at::kFloat, at::kDouble, at::kByte, at::kChar,
        at::kShort, at::kInt, at::kLong, at::kBool}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor x = at::randint(-100, 100, {3, 7, 5}).to(dtype);
    const at::Tensor mask = at::rand({3, 7}) < 0.5;
    {
      std::ofstream f(input, std::ios::binary);
      f.write(static_cast<const char*>(x.data_ptr()), x.nbytes());
      std::ofstream m(mask_file, std::ios::binary);
      m.write(static_cast<const char*>(mask.data_ptr()), mask.nbytes());
    }
    ASSERT_EQ(Packctl(absl::StrCat(
                          at, "pack --shape=3,7,5 --dtype=",
                          DTypeName(FromScalarType(dtype)), " --input=", input,
                          " --mask_file=", mask_file, " --output=", output),
                      &out),
              0)
        << out;
    EXPECT_THAT(out, HasSubstr("checked:"));
    const at::Tensor want = x.index({mask});
    std::ifstream f(output, std::ios::binary);
    const std::string got((std::istreambuf_iterator<char>(f)),
                          std::istreambuf_iterator<char>());
    ASSERT_EQ(static_cast<int64_t>(got.size()), want.nbytes());
    EXPECT_EQ(std::memcmp(got.data(), want.data_ptr(), got.size()), 0);
  }
  EXPECT_EQ(Packctl(absl::StrCat(at, "pack --shape=3,6,5 --dtype=bool --input=",
                                 input, " --mask_file=", mask_file),
                    &out),
            2)
      << out;
  EXPECT_THAT(
      out, HasSubstr("holds more than the 90 bytes shape 3,6,5 of bool needs"));
  EXPECT_EQ(Packctl(absl::StrCat(at, "pack --shape=3,7,5 --dtype=bool --input=",
                                 input, " --mask_file=", mask_file, "x"),
                    &out),
            2)
      << out;
  EXPECT_THAT(out, HasSubstr("cannot read --mask_file"));

  const std::string json = ::testing::TempDir() + "/packctl_bench.json";
  EXPECT_EQ(
      Packctl(
          at + "bench --duration=0.5 --concurrency=2 --shape=2,64,16 --json=" +
              json,
          &out),
      0)
      << out;
  EXPECT_THAT(out, HasSubstr("latency ms: p50"));
  std::ifstream f(json);
  std::string text((std::istreambuf_iterator<char>(f)),
                   std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"p99_ms\""));
  EXPECT_EQ(Packctl(at + "bench --duration=0.5 --transport=shm --shape=2,64,16",
                    &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("transport shm"));

  EXPECT_EQ(Packctl(at + "frobnicate", &out), 2);
  EXPECT_EQ(Packctl(at + "pack --shape=4", &out), 2);
  EXPECT_EQ(
      Packctl(absl::StrCat("--address=127.0.0.1:", UnusedPort(), " probe"),
              &out),
      3);
}

}  // namespace
}  // namespace packd
