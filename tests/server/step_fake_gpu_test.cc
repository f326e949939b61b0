// PackMicroBatches with the batch on the GPU (docs/design.md §12), on the fake
// GPU of tests/fake_gpu/: the batch's tensors in a device region, the mask and
// ids copied to the host and planned there, each micro-batch's rows gathered
// on the device (DeviceRuntime::CopyRows) and packed with the layout there,
// its results written into an outputs arena on the device. Every step is
// compared, message by message and byte for byte, with the same step on the
// host (which the oracle tests hold to torch).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/proto_util.h"
#include "tests/e2e/server_process.h"
#include "tests/fake_gpu/fake_gpu_runtime.h"
#include "tests/kernels/test_util.h"
#include "tests/server/fake_gpu_fixture.h"

namespace packd {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using testing::InRegion;
using testing::Slice;
using testing::ToProto;

using Messages = std::vector<v1::PackMicroBatchesResponse>;

// A batch with a prompt-and-completion shape: rows of random lengths (at least
// 8 active tokens, as a prefix), hidden states, token ids whose first 8 are
// equal within each pair of rows (a GRPO group), and segment ids.
struct Batch {
  at::Tensor mask, hidden, tokens, segment_ids;

  static Batch Random(testing::Rng& rng, int64_t B, int64_t S, int64_t H) {
    Batch b;
    b.mask = at::zeros({B, S}, at::kBool);
    for (int64_t r = 0; r < B; ++r) {
      const int64_t length = 8 + static_cast<int64_t>(rng.Next() % (S - 7));
      b.mask[r].slice(0, 0, length).fill_(true);
    }
    b.hidden = testing::RandomTensor(rng, DType::kBFloat16, {B, S, H});
    b.tokens = testing::RandomTensor(rng, DType::kInt64, {B, S});
    for (int64_t r = 1; r < B; r += 2) {
      b.tokens[r].slice(0, 0, 8).copy_(b.tokens[r - 1].slice(0, 0, 8));
    }
    // Documents of 1 to 40 tokens.
    b.segment_ids = at::zeros({B, S}, at::kInt);
    int* ids = b.segment_ids.data_ptr<int>();
    for (int64_t at = 0, id = 0; at < B * S;) {
      const int64_t n = 1 + static_cast<int64_t>(rng.Next() % 40);
      for (int64_t k = at; k < std::min(at + n, B * S); ++k) ids[k] = id;
      at += n;
      ++id;
    }
    return b;
  }
  std::vector<at::Tensor> Tensors() const {
    return {mask, hidden, tokens, segment_ids};
  }
};

// Where each of a batch's tensors is in a device buffer: from multiples of
// 256.
std::vector<uint64_t> Offsets(const std::vector<at::Tensor>& tensors) {
  std::vector<uint64_t> at;
  uint64_t next = 0;
  for (const at::Tensor& t : tensors) {
    at.push_back(next);
    next = (next + t.nbytes() + 255) / 256 * 256;
  }
  at.push_back(next);
  return at;
}

// The layouts of this round, each a way to fill a step's request.
struct LayoutCase {
  const char* name;
  std::function<void(v1::PackMicroBatchesRequest*)> apply;
};

std::vector<LayoutCase> Layouts() {
  return {
      {"documents",
       [](v1::PackMicroBatchesRequest*) {}},  // segment ids are always given
      {"padding",
       [](v1::PackMicroBatchesRequest* r) {
         r->mutable_batch()->set_pad_multiple(8);
         r->mutable_batch()->add_pad_values(-1);
         r->mutable_batch()->add_pad_values(7);
         r->mutable_batch()->set_with_seq_idx(true);
       }},
      {"cp",
       [](v1::PackMicroBatchesRequest* r) {
         r->mutable_batch()->set_pad_multiple(4);
         r->mutable_batch()->set_cp_size(2);
         r->mutable_batch()->set_cp_rank(1);
       }},
      {"ulysses",
       [](v1::PackMicroBatchesRequest* r) {
         r->mutable_batch()->set_sp_size(2);
         r->mutable_batch()->set_sp_rank(1);
       }},
      {"fixed",
       [](v1::PackMicroBatchesRequest* r) {
         v1::FixedLayout* fixed = r->mutable_batch()->mutable_fixed();
         fixed->set_tokens(400);
         fixed->set_sequences(80);
         fixed->set_max_seqlen(400);  // its trailing ghost's
       }},
      {"shared_prompts",
       [](v1::PackMicroBatchesRequest* r) {
         v1::PackRequest* batch = r->mutable_batch();
         batch->clear_segment_ids();
         const int64_t B = batch->mask().shape(0);
         v1::SharedPrefix* shared = batch->mutable_shared_prefix();
         for (int64_t b = 0; b < B; ++b) {
           shared->add_groups(b / 2);
           shared->add_prefix_lengths(8);
         }
         shared->add_same_inputs(1);
       }},
  };
}

class StepOnFakeGpuTest : public FakeGpuTest {
 protected:
  // A batch copied into memory on fake device `device`, its tensors at `at`
  // (Offsets), registered as region `name` on cuda:`device`.
  struct OnDevice {
    std::vector<uint64_t> at;
    std::unique_ptr<DeviceBuffer> memory;
  };
  OnDevice Put(const Batch& batch, int device, const std::string& name) {
    OnDevice out{Offsets(batch.Tensors()), nullptr};
    out.memory = std::make_unique<DeviceBuffer>(device, out.at.back());
    for (size_t i = 0; i + 1 < out.at.size(); ++i) {
      out.memory->Put(batch.Tensors()[i], out.at[i]);
    }
    EXPECT_TRUE(RegisterDevice(name, *out.memory,
                               absl::StrCat("cuda:", device).c_str(),
                               out.at.back())
                    .ok());
    return out;
  }

  // A step's request over `batch`: its tensors inline, or in region `region`
  // at `offsets`; with position ids, a shift of the token ids, a loss mask
  // (the mask, inline) and two ranks' plan.
  static v1::PackMicroBatchesRequest Request(
      const Batch& batch, const char* region,
      const std::vector<uint64_t>& offsets) {
    const std::vector<at::Tensor> t = batch.Tensors();
    auto tensor = [&](size_t i) {
      return region == nullptr ? ToProto(t[i])
                               : InRegion(t[i], region, offsets[i]);
    };
    v1::PackMicroBatchesRequest request;
    v1::PackRequest* b = request.mutable_batch();
    *b->mutable_mask() = tensor(0);
    *b->add_inputs() = tensor(1);
    *b->add_inputs() = tensor(2);
    *b->mutable_segment_ids() = tensor(3);
    b->set_with_position_ids(true);
    v1::Shift* shift = b->add_shifts();
    shift->set_input(1);
    shift->set_fill(-100);
    *request.mutable_loss_mask() = ToProto(batch.mask);
    request.mutable_plan()->set_max_tokens_per_micro_batch(300);
    request.mutable_plan()->set_num_ranks(2);
    return request;
  }

  struct Ran {
    grpc::Status status;
    Messages messages;
  };
  Ran Run(const v1::PackMicroBatchesRequest& request) {
    grpc::ClientContext context;
    auto reader = stub_->PackMicroBatches(&context, request);
    Ran ran;
    v1::PackMicroBatchesResponse message;
    while (reader->Read(&message)) ran.messages.push_back(message);
    ran.status = reader->Finish();
    return ran;
  }

  // `messages` with every result written into region `name` (at `arena`)
  // read back and put inline, as the same step without outputs sends it.
  static Messages Inlined(Messages messages, const DeviceBuffer& arena,
                          const std::string& name = "arena") {
    for (size_t k = 1; k < messages.size(); ++k) {
      v1::PackResponse* packed = messages[k].mutable_packed();
      for (auto* tensors :
           {packed->mutable_packed(), packed->mutable_shifted()}) {
        for (v1::Tensor& t : *tensors) {
          if (!t.has_region()) continue;
          EXPECT_EQ(t.region().region(), name);
          t.set_data(std::string(arena.data() + t.region().offset(),
                                 t.region().byte_size()));
          t.clear_region();
        }
      }
    }
    return messages;
  }

  static void ExpectSameSteps(const Messages& host, const Messages& device) {
    ASSERT_EQ(host.size(), device.size());
    for (size_t k = 0; k < host.size(); ++k) {
      EXPECT_TRUE(host[k].SerializeAsString() == device[k].SerializeAsString())
          << "message " << k
          << " differs:\nhost:   " << host[k].ShortDebugString().substr(0, 400)
          << "\ndevice: " << device[k].ShortDebugString().substr(0, 400);
    }
  }
};

// Every layout of the round: the step with its batch on the device, results
// into a device arena (and inline), equals the step on the host.
TEST_F(StepOnFakeGpuTest, EveryLayoutOnTheDeviceEqualsTheHostStep) {
  StartServer();
  testing::Rng rng = testing::Rng::Fresh();
  for (const LayoutCase& layout : Layouts()) {
    SCOPED_TRACE(layout.name);
    const Batch batch = Batch::Random(rng, 24, 96, 12);
    const OnDevice on_device = Put(batch, 0, "batch");
    const std::vector<uint64_t>& at = on_device.at;

    v1::PackMicroBatchesRequest host = Request(batch, nullptr, at);
    layout.apply(&host);
    const Ran on_host = Run(host);
    ASSERT_TRUE(on_host.status.ok()) << on_host.status.error_message();
    ASSERT_GE(on_host.messages.size(), 3u);  // the plan, two micro-batches

    v1::PackMicroBatchesRequest device = Request(batch, "batch", at);
    layout.apply(&device);
    device.mutable_batch()->set_device("cuda:0");
    const Ran inline_results = Run(device);
    ASSERT_TRUE(inline_results.status.ok())
        << inline_results.status.error_message();
    ExpectSameSteps(on_host.messages, inline_results.messages);

    // Into an arena on the device: the first message says how large.
    const int64_t output_bytes = on_host.messages[0].output_bytes();
    DeviceBuffer arena(0, output_bytes + 64);
    ASSERT_TRUE(RegisterDevice("arena", arena, "cuda:0", output_bytes).ok());
    *device.mutable_outputs() = Slice("arena", 0, output_bytes);
    fakegpu::testing::SetStreamDelay(absl::Milliseconds(2));
    const Ran into = Run(device);
    fakegpu::testing::SetStreamDelay(absl::ZeroDuration());
    ASSERT_TRUE(into.status.ok()) << into.status.error_message();
    ASSERT_GT(into.messages.size(), 1u);
    EXPECT_TRUE(into.messages[1].packed().packed(0).has_region());
    ExpectSameSteps(on_host.messages, Inlined(into.messages, arena));
    // Nothing past the results was written.
    EXPECT_EQ(static_cast<uint8_t>(arena.data()[output_bytes]),
              testing::kCanary);

    // Too small: inline, as without one.
    device.mutable_outputs()->set_byte_size(output_bytes - 1);
    const Ran small = Run(device);
    ASSERT_TRUE(small.status.ok()) << small.status.error_message();
    ExpectSameSteps(on_host.messages, small.messages);
    ASSERT_TRUE(Unregister("batch").ok());
    ASSERT_TRUE(Unregister("arena").ok());
  }
  StopServer();
}

// The step's device checks come before its plan: tensors or outputs on another
// device than the step's are refused by name, and a device this machine lacks
// is FAILED_PRECONDITION, as for Pack.
// The server's phase timers: every phase of a step on the device is counted,
// and the phases that follow one another (measure, plan, the device pass)
// fit in the calls' own time.
TEST_F(StepOnFakeGpuTest, PhaseTimersCountEveryPhaseWithinTheCallsTime) {
  metrics_listen_ = "127.0.0.1:0";
  StartServer();
  testing::Rng rng = testing::Rng::Fresh();
  const Batch batch = Batch::Random(rng, 24, 96, 12);
  const OnDevice on_device = Put(batch, 0, "batch");
  v1::PackMicroBatchesRequest device = Request(batch, "batch", on_device.at);
  device.mutable_batch()->set_device("cuda:0");
  fakegpu::testing::SetStreamDelay(absl::Milliseconds(20));
  for (int i = 0; i < 2; ++i) {
    const Ran ran = Run(device);
    ASSERT_TRUE(ran.status.ok()) << ran.status.error_message();
  }
  fakegpu::testing::SetStreamDelay(absl::ZeroDuration());
  const std::string text =
      testing::HttpGet(server_->metrics_address(), "/metrics");
  auto value = [&](const std::string& series) {
    const size_t at = text.find("\n" + series + " ");
    EXPECT_NE(at, std::string::npos) << series;
    return at == std::string::npos
               ? 0.0
               : std::stod(text.substr(at + series.size() + 2));
  };
  double sequential = 0;
  for (const char* phase : {"measure", "plan", "device", "pack", "send"}) {
    const double seconds = value(
        absl::StrCat("packd_step_phase_seconds_total{phase=\"", phase, "\"}"));
    EXPECT_GT(seconds, 0) << phase;
    if (std::string(phase) != "pack" && std::string(phase) != "send") {
      sequential += seconds;
    }
  }
  // The device pass waited for its queued work: 20 ms an operation.
  EXPECT_GE(value("packd_step_phase_seconds_total{phase=\"device\"}"), 0.04);
  EXPECT_LE(sequential, value("packd_request_duration_seconds_sum{method=\""
                              "PackMicroBatches\"}"));
  StopServer();
}

TEST_F(StepOnFakeGpuTest, TensorsOnAnotherDeviceAreRefusedBeforeThePlan) {
  StartServer();
  testing::Rng rng = testing::Rng::Fresh();
  const Batch batch = Batch::Random(rng, 6, 40, 4);
  const OnDevice on_device = Put(batch, 0, "batch");
  const std::vector<uint64_t>& at = on_device.at;
  DeviceBuffer other(1, 1 << 20);
  ASSERT_TRUE(RegisterDevice("other", other, "cuda:1", 1 << 20).ok());
  v1::PackMicroBatchesRequest request = Request(batch, "batch", at);
  request.mutable_batch()->set_device("cuda:1");
  Ran ran = Run(request);
  EXPECT_EQ(ran.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(ran.status.error_message(),
              HasSubstr("batch.mask is in a region on cuda:0 but the step "
                        "runs on cuda:1"));
  EXPECT_TRUE(ran.messages.empty());

  request.mutable_batch()->set_device("cuda:0");
  *request.mutable_outputs() = Slice("other", 0, 1 << 20);
  ran = Run(request);
  EXPECT_EQ(ran.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(ran.status.error_message(),
              HasSubstr("outputs is a region on cuda:1 but the step runs on "
                        "cuda:0"));
  EXPECT_TRUE(ran.messages.empty());

  request.clear_outputs();
  request.mutable_batch()->set_device("cuda:7");
  ran = Run(request);
  EXPECT_EQ(ran.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(ran.messages.empty());
  StopServer();
}

// Backpressure holds on the device path too: a slow reader keeps the server
// at most two packed micro-batches ahead, and each comes only once its device
// work is done.
TEST_F(StepOnFakeGpuTest, ASlowReaderHoldsTheServerToTwoMicroBatches) {
  metrics_listen_ = "127.0.0.1:0";
  StartServer();
  const std::string metrics = server_->metrics_address();
  auto held = [&] {
    const std::string text = testing::HttpGet(metrics, "/metrics");
    const std::string name = "\npackd_step_micro_batches_held ";
    const size_t at = text.find(name);
    return at == std::string::npos ? -1
                                   : std::stoll(text.substr(at + name.size()));
  };
  testing::Rng rng = testing::Rng::Fresh();
  // Micro-batches of about 2.4 MB, 75 MB in all: more than a socket's and
  // gRPC's buffers take however soon the server makes them (a step on the
  // device makes its messages in two passes, then only assembles them).
  const Batch batch = Batch::Random(rng, 96, 96, 4096);
  const OnDevice on_device = Put(batch, 0, "batch");
  const std::vector<uint64_t>& at = on_device.at;
  v1::PackMicroBatchesRequest host = Request(batch, nullptr, at);
  const Ran on_host = Run(host);
  ASSERT_TRUE(on_host.status.ok()) << on_host.status.error_message();
  ASSERT_GE(on_host.messages.size(), 8u);

  v1::PackMicroBatchesRequest device = Request(batch, "batch", at);
  device.mutable_batch()->set_device("cuda:0");
  grpc::ClientContext context;
  auto reader = stub_->PackMicroBatches(&context, device);
  Messages messages;
  v1::PackMicroBatchesResponse message;
  std::vector<int64_t> seen;
  while (reader->Read(&message)) {
    messages.push_back(message);
    if (messages.size() >= 2 && messages.size() <= 5) {
      // While this reader waits, the server packs ahead (however slowly a
      // loaded machine lets it: up to 10 s), then stops: given another 100
      // ms, it still holds no more than two.
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      while (held() < 1 && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(20));
      }
      absl::SleepFor(absl::Milliseconds(100));
      seen.push_back(held());
    }
  }
  const grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectSameSteps(on_host.messages, messages);
  ASSERT_EQ(seen.size(), 4u);
  for (int64_t n : seen) {
    EXPECT_GE(n, 1);  // it packs ahead
    EXPECT_LE(n, 2);  // and no further
  }
  StopServer();
}

// A device error in the step's device pass (after the plan is sent) ends it
// with the runtime's error, after the messages already sent (which are
// right); the server serves the next step. A lost device: UNAVAILABLE from then
// on, and readiness NOT_SERVING.
TEST_F(StepOnFakeGpuTest, ADeviceErrorMidStepEndsItCleanly) {
  StartServer(Device{DeviceKind::kCuda, 2});
  testing::Rng rng = testing::Rng::Fresh();
  const Batch batch = Batch::Random(rng, 24, 96, 12);
  const OnDevice on_device = Put(batch, 2, "batch");
  const std::vector<uint64_t>& at = on_device.at;
  v1::PackMicroBatchesRequest host = Request(batch, nullptr, at);
  host.mutable_batch()->set_device("cpu");
  const Ran on_host = Run(host);
  ASSERT_TRUE(on_host.status.ok()) << on_host.status.error_message();
  v1::PackMicroBatchesRequest device = Request(batch, "batch", at);
  device.mutable_batch()->set_device("cuda:2");

  // The third copy fails: the mask and the segment ids came to the host for
  // the plan, then the device pass copies its table up (and the results
  // back).
  fakegpu::testing::FailNext("MemcpyAsync", fakegpu::kErrorIllegalAddress,
                             /*skip=*/2);
  Ran ran = Run(device);
  EXPECT_EQ(ran.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(ran.status.error_message(), HasSubstr("illegal memory access"));
  ASSERT_GE(ran.messages.size(), 1u);
  ASSERT_LT(ran.messages.size(), on_host.messages.size());
  ExpectSameSteps(Messages(on_host.messages.begin(),
                           on_host.messages.begin() + ran.messages.size()),
                  ran.messages);
  ran = Run(device);
  ASSERT_TRUE(ran.status.ok()) << ran.status.error_message();
  ExpectSameSteps(on_host.messages, ran.messages);

  // Lost after the plan, while the device pass's work is queued: each
  // operation takes 100 ms, so that a busy machine cannot finish the step
  // before the loss.
  fakegpu::testing::SetStreamDelay(absl::Milliseconds(100));
  grpc::ClientContext context;
  auto reader = stub_->PackMicroBatches(&context, device);
  v1::PackMicroBatchesResponse message;
  ASSERT_TRUE(reader->Read(&message));
  fakegpu::testing::LoseDevice(2, fakegpu::kErrorIllegalAddress);
  fakegpu::testing::SetStreamDelay(absl::ZeroDuration());
  while (reader->Read(&message)) {
  }
  const grpc::Status lost = reader->Finish();
  EXPECT_THAT(lost.error_code(),
              AnyOf(grpc::StatusCode::INTERNAL, grpc::StatusCode::UNAVAILABLE));
  EXPECT_EQ(Readiness(), "NOT_SERVING");
  ran = Run(device);
  EXPECT_EQ(ran.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(ran.status.error_message(), HasSubstr("device cuda:2 is lost"));
  EXPECT_TRUE(ran.messages.empty());
  StopServer();
  fakegpu::testing::RestoreDevice(2);
}

// Steps from several threads on one channel, each with its own batch on the
// device and its own arena, each equal to its host step.
TEST_F(StepOnFakeGpuTest, StepsFromThreadsSharingOneChannel) {
  StartServer();
  constexpr int kThreads = 4;
  testing::Rng rng = testing::Rng::Fresh();
  std::vector<Batch> batches;
  std::vector<OnDevice> memory;
  std::vector<std::unique_ptr<DeviceBuffer>> arenas;
  std::vector<Messages> expected;
  std::vector<v1::PackMicroBatchesRequest> requests;
  for (int i = 0; i < kThreads; ++i) {
    batches.push_back(Batch::Random(rng, 16, 96, 8));
    const std::string name = absl::StrCat("batch", i);
    memory.push_back(Put(batches[i], 0, name));
    const std::vector<uint64_t>& at = memory[i].at;
    const Ran on_host = Run(Request(batches[i], nullptr, at));
    ASSERT_TRUE(on_host.status.ok()) << on_host.status.error_message();
    expected.push_back(on_host.messages);
    const int64_t bytes = on_host.messages[0].output_bytes();
    arenas.push_back(std::make_unique<DeviceBuffer>(0, bytes));
    const std::string arena = absl::StrCat("arena", i);
    ASSERT_TRUE(RegisterDevice(arena, *arenas[i], "cuda:0", bytes).ok());
    requests.push_back(Request(batches[i], name.c_str(), at));
    requests[i].mutable_batch()->set_device("cuda:0");
    *requests[i].mutable_outputs() = Slice(arena, 0, bytes);
  }
  fakegpu::testing::SetStreamDelay(absl::Milliseconds(1));
  std::vector<std::future<Ran>> runs;
  for (int i = 0; i < kThreads; ++i) {
    runs.push_back(std::async(std::launch::async, [&, i] {
      Ran last;
      for (int round = 0; round < 3; ++round) last = Run(requests[i]);
      return last;
    }));
  }
  for (int i = 0; i < kThreads; ++i) {
    const Ran ran = runs[i].get();
    ASSERT_TRUE(ran.status.ok()) << ran.status.error_message();
    ExpectSameSteps(expected[i], Inlined(ran.messages, *arenas[i],
                                         absl::StrCat("arena", i)));
  }
  StopServer();
}

}  // namespace
}  // namespace packd
