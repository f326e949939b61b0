// One packd::Client shared by many threads (docs/design.md §2: clients are
// safe to share, as gRPC stubs are), and the safety of its retries: a register
// call whose reply was lost, and attempts bounded by one deadline. Runs under
// ThreadSanitizer too (make tsan).
#include <ATen/ATen.h>
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "base/torch_interop.h"
#include "client/autograd.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "kernels/pack.h"
#include "planner/planner.h"
#include "tests/e2e/server_process.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using testing::Rng;
using testing::SameBytes;
using testing::ServerProcess;

// Iterations per thread: PACKD_SHARED_CLIENT_ITERATIONS, else 24 (fewer under
// ThreadSanitizer, which runs the same mix about 20 times slower).
int Iterations() {
  if (const char* n = std::getenv("PACKD_SHARED_CLIENT_ITERATIONS")) {
    return std::max(1, std::atoi(n));
  }
#if defined(__SANITIZE_THREAD__)
  return 6;
#else
  return 24;
#endif
}

// The paths a call of the client takes, by the bytes its tensors hold (see
// the thresholds below): inline in one call, inline in parts, or through a
// scratch segment of shared memory.
enum class Path { kInline, kSplit, kSharedMemory };
constexpr int64_t kSplitBytes = 24 << 10;
constexpr int64_t kShmBytes = 64 << 10;

// Region names this process has in /dev/shm (segments whose names were
// never unlinked).
int LinkedSegments() {
  const std::string mine = absl::StrCat("_", getpid(), "_");
  int n = 0;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (absl::StrContains(e->d_name, mine)) ++n;
    }
    closedir(d);
  }
  return n;
}

class SharedClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = ServerProcess::Start().release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }
  static int Regions() {
    auto stub = v1::PackService::NewStub(server_->Channel());
    grpc::ClientContext context;
    v1::ListRegionsResponse listed;
    EXPECT_TRUE(
        stub->ListRegions(&context, v1::ListRegionsRequest(), &listed).ok());
    return listed.regions_size();
  }
  static ServerProcess* server_;
};

ServerProcess* SharedClientTest::server_ = nullptr;

// A random [B, S, *tail] float tensor of about `bytes` bytes and its mask.
struct Case {
  at::Tensor x, mask;
  DType dtype;
};
Case RandomCase(Rng& rng, int64_t bytes, bool floating) {
  const std::vector<DType> dtypes =
      floating
          ? std::vector<DType>{DType::kFloat32, DType::kFloat64,
                               DType::kBFloat16, DType::kFloat16}
          : std::vector<DType>(std::begin(kAllDTypes), std::end(kAllDTypes));
  const DType dtype = dtypes[rng.Next() % dtypes.size()];
  const int64_t B = 3 + rng.Next() % 6, S = 8 + rng.Next() % 24;
  const int64_t item = ItemSize(dtype);
  const int64_t tail = std::max<int64_t>(1, bytes / (B * S * item));
  const MaskPattern pattern =
      rng.Next() % 2 ? MaskPattern::kHoles : MaskPattern::kPrefix;
  const DType mask_dtype = rng.Next() % 2 ? DType::kBool : DType::kInt32;
  return {testing::RandomTensor(rng, dtype, {B, S, tail}),
          testing::RandomMask(rng, mask_dtype, B, S, 0.2 + 0.6 * rng.Uniform(),
                              pattern),
          dtype};
}

// Packs c through the client with `layout` (whole, results inline) and with
// the op library, the reference: the same packed and shifted bytes.
void PackLikeTheLibrary(const Case& c, const LayoutOptions& layout,
                        Client& client, absl::StatusOr<PackedBatch>* r,
                        absl::StatusOr<PackResult>* want) {
  PackCallOptions laid;
  laid.layout = layout;
  *r = client.Pack({c.x}, c.mask, laid);
  ASSERT_TRUE(r->ok()) << r->status();
  PackOptions reference;
  reference.layout = layout;
  *want = packd::Pack({AsView(c.x)}, AsView(c.mask), reference);
  ASSERT_TRUE(want->ok()) << want->status();
  EXPECT_TRUE(SameBytes((*r)->packed[0], (*want)->packed[0].view));
  EXPECT_TRUE(SameBytes((*r)->shifted[0], (*want)->shifted[0].view));
}

// 8 threads share one client and mix every path (inline, split into parts over
// 3 connections, shared-memory scratch) with Pack, Scatter, a differentiable
// Pack, a layout Pack, a shared prefix's stream and targets, a plan and a
// streamed step; every result equals torch's, byte for byte. Before each call
// had its own scratch segment, 95 of 117 such calls returned another thread's
// rows or were refused.
TEST_F(SharedClientTest, ThreadsSharingOneClientEachGetTheirOwnResults) {
  ClientOptions options;
  options.address = server_->address();
  options.shared_memory_threshold_bytes = kShmBytes;
  options.split_threshold_bytes = kSplitBytes;
  options.connections = 3;
  options.idle_scratch_segments = 2;
  std::unique_ptr<Client> client = std::move(*Client::Connect(options));
  const uint64_t seed = Rng::Fresh().Next();
  const int iterations = Iterations();
  std::atomic<int> paths[3] = {0, 0, 0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      Rng rng{std::mt19937_64(seed + t)};
      for (int i = 0; i < iterations; ++i) {
        const Path path = static_cast<Path>(rng.Next() % 3);
        // Bytes of one input; the client counts the input and its result.
        const int64_t bytes = path == Path::kInline ? 4 << 10
                              : path == Path::kSplit
                                  ? 14 << 10
                                  : (40 << 10) + rng.Next() % (400 << 10);
        const int op = rng.Next() % 7;
        Case c = RandomCase(rng, bytes, /*floating=*/op == 2);
        const int64_t total = 2 * c.x.nbytes() + c.mask.nbytes();
        const Path taken = total >= kShmBytes     ? Path::kSharedMemory
                           : total >= kSplitBytes ? Path::kSplit
                                                  : Path::kInline;
        paths[static_cast<int>(taken)]++;
        SCOPED_TRACE(absl::StrCat("thread ", t, " call ", i, " op ", op,
                                  " path ", static_cast<int>(taken), " x ",
                                  c.x.size(0), "x", c.x.size(1), "x",
                                  c.x.size(2)));
        if (op == 0) {
          PackCallOptions pack;
          pack.with_position_ids = true;
          // Every other call also asks for the token mask and the (text-only)
          // multimodal positions of a token-ids input: such a call goes whole.
          const bool per_row = i % 2 == 1;
          std::vector<at::Tensor> inputs = {c.x};
          if (per_row) {
            pack.with_token_mask = true;
            pack.mrope = MRopeOptions{};
            pack.mrope->input = 1;
            pack.mrope->image_token_id = -1;
            pack.mrope->video_token_id = -2;
            inputs.push_back(
                at::arange(c.mask.numel(), at::kLong).view(c.mask.sizes()));
          }
          absl::StatusOr<PackedBatch> r = client->Pack(inputs, c.mask, pack);
          ASSERT_TRUE(r.ok()) << r.status();
          if (per_row) {
            EXPECT_TRUE(at::equal(r->token_mask,
                                  at::ones({r->total_active}, at::kByte)));
            EXPECT_TRUE(at::equal(r->mrope_position_ids,
                                  r->position_ids.expand({3, -1})));
          }
          EXPECT_TRUE(
              SameBytes(testing::ReferencePack(c.x, c.mask), r->packed[0]));
          const testing::ReferenceMeta meta =
              testing::ReferenceMetadata(c.mask);
          EXPECT_TRUE(
              at::equal(r->cu_seqlens, at::tensor(meta.cu_seqlens, at::kLong)));
          EXPECT_TRUE(at::equal(r->position_ids,
                                at::tensor(meta.position_ids, at::kLong)));
          EXPECT_EQ(r->total_active, meta.total_active);
          EXPECT_EQ(r->max_seqlen, meta.max_seqlen);
        } else if (op == 1) {
          const at::Tensor packed = testing::ReferencePack(c.x, c.mask);
          absl::StatusOr<std::vector<at::Tensor>> dense =
              client->Scatter({packed}, c.mask);
          ASSERT_TRUE(dense.ok()) << dense.status();
          EXPECT_TRUE(SameBytes(
              testing::ReferenceScatter(packed, c.mask, c.x.sizes().vec()),
              (*dense)[0]));
        } else if (op == 5) {
          // A streamed step: each micro-batch is torch's pack of its rows,
          // and every row comes once.
          StepCallOptions o;
          o.plan.num_ranks = 1 + rng.Next() % 3;
          std::vector<int> seen(c.x.size(0), 0);
          const absl::Status step = client->PackMicroBatches(
              {c.x}, c.mask, 8 + rng.Next() % 56, o,
              [](const v1::PlanResponse&) { return absl::OkStatus(); },
              [&](StepMicroBatch mb) {
                const at::Tensor rows = at::tensor(mb.samples, at::kLong);
                EXPECT_TRUE(SameBytes(
                    testing::ReferencePack(c.x.index_select(0, rows),
                                           c.mask.index_select(0, rows)),
                    mb.batch.packed[0]));
                for (int64_t b : mb.samples) ++seen[b];
                return absl::OkStatus();
              });
          ASSERT_TRUE(step.ok()) << step;
          EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), c.x.size(0));
        } else if (op == 4) {
          // A plan by cost with groups and padding: the library's plan of
          // the same request, micro-batch for micro-batch.
          std::vector<int64_t> lengths, groups;
          for (int j = 0; j < 200; ++j) {
            lengths.push_back(1 + rng.Next() % 5000);
            groups.push_back(j / 2);
          }
          PlanCallOptions o;
          o.num_ranks = 1 + rng.Next() % 8;
          o.cost_per_token = 24576;
          o.cost_per_token_squared = 1;
          o.groups = groups;
          o.pad_multiple = 16;
          o.pipeline_order = true;
          absl::StatusOr<v1::PlanResponse> plan =
              client->PlanMicroBatches(lengths, 16384, o);
          ASSERT_TRUE(plan.ok()) << plan.status();
          PlanOptions library;
          library.max_tokens_per_micro_batch = 16384;
          library.num_ranks = o.num_ranks;
          library.cost_per_token = 24576;
          library.cost_per_token_squared = 1;
          library.groups = groups;
          library.pad_multiple = 16;
          library.pipeline_order = true;
          absl::StatusOr<Plan> want = PlanMicroBatches(lengths, {}, library);
          ASSERT_TRUE(want.ok()) << want.status();
          ASSERT_EQ(plan->micro_batches_size(),
                    static_cast<int>(want->micro_batches.size()));
          for (size_t j = 0; j < want->micro_batches.size(); ++j) {
            const v1::MicroBatch& mb = plan->micro_batches(j);
            EXPECT_EQ(
                std::vector<int64_t>(mb.samples().begin(), mb.samples().end()),
                want->micro_batches[j].samples);
            EXPECT_EQ(mb.cost(), want->micro_batches[j].cost);
          }
          EXPECT_EQ(plan->cost_imbalance(), want->cost_imbalance);
        } else if (op == 6) {
          // A shared prefix (GRPO groups): the stream and its targets, then
          // the targets back to the batch; the op library's calls of the same
          // batch are the reference.
          const int64_t B = c.x.size(0);
          const at::Tensor counts = (c.mask != 0).sum(1);
          SharedPrefix shared;
          std::vector<int64_t> shortest(B, c.x.size(1));
          for (int64_t b = 0; b < B; ++b) {
            shared.groups.push_back(
                static_cast<int64_t>(rng.Next() % (1 + B / 2)));
            int64_t& s = shortest[shared.groups[b]];
            s = std::min(s, counts[b].item<int64_t>());
          }
          std::vector<int64_t> prompt(B);
          for (int64_t g = 0; g < B; ++g) {
            prompt[g] = static_cast<int64_t>(rng.Next() % (shortest[g] + 1));
          }
          for (int64_t b = 0; b < B; ++b) {
            shared.prefix_lengths.push_back(prompt[shared.groups[b]]);
          }
          LayoutOptions layout;
          layout.shared_prefix = shared;
          layout.shifts = {{0, 0}};
          absl::StatusOr<PackedBatch> r;
          absl::StatusOr<PackResult> want;
          ASSERT_NO_FATAL_FAILURE(
              PackLikeTheLibrary(c, layout, *client, &r, &want));
          ASSERT_TRUE(r->shared.has_value());
          EXPECT_TRUE(at::equal(r->shared->kv_index,
                                at::tensor(want->shared->kv_index, at::kLong)));
          EXPECT_TRUE(
              at::equal(r->shared->pred_index,
                        at::tensor(want->shared->pred_index, at::kLong)));
          ScatterCallOptions back;
          back.layout.shared_prefix = shared;
          back.layout.shared_prefix->targets = true;
          absl::StatusOr<std::vector<at::Tensor>> dense =
              client->Scatter({r->shifted[0]}, c.mask, back);
          ASSERT_TRUE(dense.ok()) << dense.status();
          ScatterOptions scatter;
          scatter.layout = back.layout;
          absl::StatusOr<ScatterResult> dense_want =
              packd::Scatter({want->shifted[0].view}, AsView(c.mask), scatter);
          ASSERT_TRUE(dense_want.ok()) << dense_want.status();
          EXPECT_TRUE(SameBytes((*dense)[0], dense_want->dense[0].view));
        } else if (op == 3) {
          // A layout: the call goes whole, its results inline; the op
          // library's Pack of the same batch is the reference.
          LayoutOptions layout;
          layout.pad_multiple = 4;
          layout.cp_size = 2;
          layout.cp_rank = static_cast<int32_t>(rng.Next() % 2);
          layout.shifts = {{0, 0}};
          absl::StatusOr<PackedBatch> r;
          absl::StatusOr<PackResult> want;
          ASSERT_NO_FATAL_FAILURE(
              PackLikeTheLibrary(c, layout, *client, &r, &want));
        } else {
          at::Tensor x = c.x.clone().set_requires_grad(true);
          absl::StatusOr<at::Tensor> packed = PackWithGrad(*client, x, c.mask);
          ASSERT_TRUE(packed.ok()) << packed.status();
          EXPECT_TRUE(
              SameBytes(testing::ReferencePack(c.x, c.mask), packed->detach()));
          const at::Tensor g =
              testing::RandomTensor(rng, c.dtype, packed->sizes().vec());
          packed->backward(g);
          EXPECT_TRUE(
              SameBytes(testing::ReferenceScatter(g, c.mask, c.x.sizes().vec()),
                        x.grad()));
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < 3; ++p) EXPECT_GT(paths[p].load(), 0) << "path " << p;
  // Idle scratch segments stay registered, at most idle_scratch_segments.
  EXPECT_LE(Regions(), 2);
  client.reset();
  EXPECT_EQ(Regions(), 0);
  EXPECT_EQ(LinkedSegments(), 0);
}

// Turns the first `*left` OK replies of `method` into UNAVAILABLE: the server
// acted, the client never heard.
class DropReplies : public grpc::experimental::Interceptor {
 public:
  DropReplies(grpc::experimental::ClientRpcInfo* info, const char* method,
              std::atomic<int>* left)
      : matches_(absl::EndsWith(info->method(), method)), left_(left) {}
  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (matches_ && methods->QueryInterceptionHookPoint(
                        InterceptionHookPoints::POST_RECV_STATUS)) {
      grpc::Status* status = methods->GetRecvStatus();
      if (status->ok() && left_->fetch_sub(1) > 0) {
        *status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               "the test dropped this reply");
      }
    }
    methods->Proceed();
  }

 private:
  const bool matches_;
  std::atomic<int>* const left_;
};

class DropRepliesFactory
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  DropRepliesFactory(const char* method, std::atomic<int>* left)
      : method_(method), left_(left) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* info) override {
    return new DropReplies(info, method_, left_);
  }

 private:
  const char* const method_;
  std::atomic<int>* const left_;
};

// A register call whose reply is lost is sent again: the server finds the
// region it registered and says OK (it said ALREADY_EXISTS, the segment was
// refused and its name left in /dev/shm), and the segment works.
TEST_F(SharedClientTest, ARegisterCallRepeatedAfterALostReplySucceeds) {
  std::atomic<int> left{1};
  ClientOptions options;
  options.address = server_->address();
  options.interceptors = [&left] {
    std::vector<
        std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
        factories;
    factories.push_back(
        std::make_unique<DropRepliesFactory>("/RegisterSystemRegion", &left));
    return factories;
  };
  std::unique_ptr<Client> client = std::move(*Client::Connect(options));
  absl::StatusOr<std::unique_ptr<SharedMemory>> shm =
      client->CreateSharedMemory(1 << 20);
  ASSERT_TRUE(shm.ok()) << shm.status();
  EXPECT_LE(left.load(), 0) << "no reply was dropped";
  EXPECT_EQ(LinkedSegments(), 0);
  EXPECT_EQ(Regions(), 1);

  Rng rng = Rng::Fresh();
  at::Tensor x = (*shm)->Empty({4, 32, 16}, at::kFloat);
  x.copy_(testing::RandomTensor(rng, DType::kFloat32, {4, 32, 16}));
  const at::Tensor mask =
      testing::RandomMask(rng, DType::kBool, 4, 32, 0.5, MaskPattern::kHoles);
  absl::StatusOr<PackedBatch> r = client->Pack({x}, mask);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(SameBytes(testing::ReferencePack(x, mask), r->packed[0]));
  shm->reset();
  EXPECT_EQ(Regions(), 0);
}

// Every attempt of a call ends within its one deadline: against an address
// where nothing listens, 1000 attempts with backoff would take minutes.
TEST_F(SharedClientTest, AllAttemptsOfACallEndWithinItsDeadline) {
  ClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", testing::UnusedPort());
  options.deadline = absl::Seconds(1);
  options.max_attempts = 1000;
  options.initial_backoff = absl::Milliseconds(50);
  options.max_backoff = absl::Milliseconds(200);
  std::unique_ptr<Client> client = std::move(*Client::Connect(options));
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ServerInfo> info = client->Info();
  const absl::Duration took = absl::Now() - start;
  EXPECT_FALSE(info.ok());
  EXPECT_TRUE(info.status().code() == absl::StatusCode::kUnavailable ||
              info.status().code() == absl::StatusCode::kDeadlineExceeded)
      << info.status();
  // Generous for a loaded machine; without the bound it is 1000 x 200 ms.
  EXPECT_LT(took, absl::Seconds(20)) << took;
}

}  // namespace
}  // namespace packd
