// The C++ client's streaming-step calls (Client::SubmitGroup, ReceiveStep)
// against a real packd: a controller opens a step over gRPC, rollout workers
// submit groups of every dtype from several threads, each rank receives its
// micro-batches on a thread of its own; every micro-batch is torch's boolean
// pack of its rows, every row is in exactly one, and a group's key is taken
// once.
#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "base/dtype.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "tests/e2e/server_process.h"
#include "tests/kernels/test_util.h"

namespace packd {
namespace {

using testing::Rng;
using testing::SameBytes;

at::Tensor Rows(const at::Tensor& t, const std::vector<int64_t>& rows) {
  return t.index_select(0, at::tensor(rows, at::kLong));
}

// A controller's stream: open, then close (its summary).
class Controller {
 public:
  Controller(const std::string& address, const v1::StepOptions& options)
      : stub_(v1::PackService::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))),
        stream_(stub_->OpenStep(&context_)) {
    v1::StepControl open;
    *open.mutable_open() = options;
    EXPECT_TRUE(stream_->Write(open));
    EXPECT_TRUE(stream_->Read(&opened_));
  }
  const std::string& id() const { return opened_.step_id(); }
  v1::StepEvent Close() {
    v1::StepControl close;
    close.mutable_close();
    EXPECT_TRUE(stream_->Write(close));
    v1::StepEvent summary;
    EXPECT_TRUE(stream_->Read(&summary));
    stream_->WritesDone();
    const grpc::Status status = stream_->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return summary;
  }

 private:
  std::unique_ptr<v1::PackService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepControl, v1::StepEvent>>
      stream_;
  v1::StepEvent opened_;
};

TEST(ClientStep, GroupsFromManyThreadsReachEveryRankAsTheirRowsPacked) {
  auto server = testing::ServerProcess::Start();
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.address = server->address();
  options.shared_memory_threshold_bytes = 0;
  std::unique_ptr<Client> client = std::move(*Client::Connect(options));
  Rng rng = Rng::Fresh();
  const int kRanks = 2, kGroups = 12, kRows = 3, S = 40;
  // The batch: kGroups groups of kRows rows, every dtype as an input.
  const at::Tensor mask = testing::RandomMask(
      rng, DType::kUInt8, kGroups * kRows, S, 0.6, MaskPattern::kHoles);
  const at::Tensor loss_mask = testing::RandomMask(
      rng, DType::kBool, kGroups * kRows, S, 0.5, MaskPattern::kHoles);
  std::vector<at::Tensor> xs;
  for (DType d : kAllDTypes) {
    xs.push_back(testing::RandomTensor(rng, d, {kGroups * kRows, S, 2}));
  }
  v1::StepOptions step;
  step.mutable_plan()->set_num_ranks(kRanks);
  step.mutable_plan()->set_max_tokens_per_micro_batch(60);
  step.mutable_layout()->set_with_position_ids(true);
  Controller controller(server->address(), step);
  // Each rank on a thread of its own.
  absl::Mutex mu;
  std::vector<StepMicroBatch> received;
  std::vector<v1::PlanResponse> lasts(kRanks);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      absl::StatusOr<v1::PlanResponse> last =
          client->ReceiveStep(controller.id(), r, 0, /*cu_seqlens_int32=*/false,
                              [&](StepMicroBatch mb) {
                                absl::MutexLock lock(&mu);
                                received.push_back(std::move(mb));
                                return absl::OkStatus();
                              });
      ASSERT_TRUE(last.ok()) << last.status();
      lasts[r] = *last;
    });
  }
  // Rollout workers: three threads, every group once; step row -> batch row.
  std::map<int64_t, int64_t> batch_row;
  std::vector<std::thread> workers;
  for (int w = 0; w < 3; ++w) {
    workers.emplace_back([&, w] {
      for (int g = w; g < kGroups; g += 3) {
        std::vector<int64_t> rows;
        for (int k = 0; k < kRows; ++k) rows.push_back(g * kRows + k);
        std::vector<at::Tensor> group;
        for (const at::Tensor& x : xs) group.push_back(Rows(x, rows));
        GroupOptions o;
        o.loss_mask = Rows(loss_mask, rows);
        o.group_key = "group-" + std::to_string(g);
        absl::StatusOr<v1::SubmitGroupResponse> taken =
            client->SubmitGroup(controller.id(), group, Rows(mask, rows), o);
        ASSERT_TRUE(taken.ok()) << taken.status();
        // Its key again: the first reply, nothing taken twice.
        absl::StatusOr<v1::SubmitGroupResponse> again =
            client->SubmitGroup(controller.id(), group, Rows(mask, rows), o);
        ASSERT_TRUE(again.ok()) << again.status();
        EXPECT_EQ(again->first_row(), taken->first_row());
        absl::MutexLock lock(&mu);
        for (int k = 0; k < kRows; ++k) {
          batch_row[taken->first_row() + k] = rows[k];
        }
      }
    });
  }
  for (std::thread& t : workers) t.join();
  const v1::StepEvent summary = controller.Close();
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(summary.rows(), kGroups * kRows);
  EXPECT_EQ(summary.groups(), kGroups);
  const int64_t loss_tokens =
      (mask.ne(0) & loss_mask.ne(0)).sum().item<int64_t>();
  EXPECT_EQ(summary.global_loss_tokens(), loss_tokens);
  std::vector<int> seen(kGroups * kRows, 0);
  ASSERT_EQ(received.size(),
            static_cast<size_t>(kRanks * summary.micro_batches_per_rank()));
  for (const StepMicroBatch& mb : received) {
    std::vector<int64_t> rows;
    for (int64_t s : mb.samples) rows.push_back(batch_row.at(s));
    for (int64_t b : rows) ++seen[b];
    const at::Tensor rows_mask = Rows(mask, rows);
    ASSERT_EQ(mb.batch.packed.size(), xs.size());
    for (size_t i = 0; i < xs.size(); ++i) {
      EXPECT_TRUE(
          SameBytes(testing::ReferencePack(Rows(xs[i], rows), rows_mask),
                    mb.batch.packed[i]))
          << "rank " << mb.rank << " micro-batch " << mb.index << " input "
          << i;
    }
    const testing::ReferenceMeta meta = testing::ReferenceMetadata(rows_mask);
    EXPECT_TRUE(at::equal(mb.batch.cu_seqlens, at::tensor(meta.cu_seqlens)));
    EXPECT_TRUE(at::equal(mb.batch.position_ids, at::tensor(meta.position_ids)))
        << "read with the step's layout: position ids";
  }
  for (int v : seen) EXPECT_EQ(v, 1);
  for (const v1::PlanResponse& last : lasts) {
    EXPECT_EQ(last.global_loss_tokens(), loss_tokens);
  }
}

TEST(ClientStep, AnUnknownStepIsNotFound) {
  auto server = testing::ServerProcess::Start();
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.address = server->address();
  std::unique_ptr<Client> client = std::move(*Client::Connect(options));
  const at::Tensor mask = at::ones({1, 4}, at::kBool);
  absl::StatusOr<v1::SubmitGroupResponse> taken =
      client->SubmitGroup("no-such-step", {at::zeros({1, 4}, at::kLong)}, mask);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<v1::PlanResponse> received =
      client->ReceiveStep("no-such-step", 0, 0, false,
                          [](StepMicroBatch) { return absl::OkStatus(); });
  EXPECT_EQ(received.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace packd
