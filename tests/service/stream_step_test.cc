// The streaming step without gRPC (service/stream_step.h), driven as its
// streams drive it: a step belongs to its tenant (another's calls get what an
// unknown id gets), packd's ids are random, a group key is taken once, an
// empty group is refused, a step's bytes stay in --max_inflight_bytes until
// its ranks' streams have taken them, and rows the planner holds back never
// pin the budget. Every micro-batch is checked against the rows submitted.
#include "service/stream_step.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tensor_codec.h"
#include "service/memory_budget.h"
#include "service/service_core.h"
#include "service/step_registry.h"

namespace packd {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kS = 64;  // positions per row

// A group of rows with `lengths` active tokens each: token ids [g, S] int64,
// the value of every active token `seed * 1000 + row * 100 + position`.
v1::SubmitGroupRequest Group(const std::string& step,
                             const std::vector<int64_t>& lengths, int64_t seed,
                             const std::string& key = "") {
  const int64_t g = static_cast<int64_t>(lengths.size());
  std::vector<uint8_t> mask(g * kS, 0);
  std::vector<int64_t> tokens(g * kS, 0);
  for (int64_t r = 0; r < g; ++r) {
    for (int64_t s = 0; s < lengths[r]; ++s) {
      mask[r * kS + s] = 1;
      tokens[r * kS + s] = seed * 1000 + r * 100 + s;
    }
  }
  v1::SubmitGroupRequest request;
  request.set_step_id(step);
  request.set_group_key(key);
  EncodeInlineTensor(DType::kBool, {g, kS}, mask.data(), g * kS,
                     request.mutable_mask());
  EncodeInlineTensor(DType::kInt64, {g, kS}, tokens.data(), g * kS * 8,
                     request.add_inputs());
  return request;
}

// What one row of Group holds of the budget: its mask and its token ids.
constexpr int64_t kRowBytes = kS * (1 + 8);

v1::StepOptions Options(int ranks, int64_t max_tokens,
                        const std::string& id = "") {
  v1::StepOptions options;
  options.set_step_id(id);
  options.mutable_plan()->set_num_ranks(ranks);
  options.mutable_plan()->set_max_tokens_per_micro_batch(max_tokens);
  options.mutable_layout()->set_device("cpu");
  return options;
}

Tenant Named(const std::string& name) { return Tenant::Named(name, name); }

// A packd's step registry over a CPU core and a budget of `limit` bytes.
struct Replica {
  explicit Replica(int64_t limit = 0)
      : budget(limit),
        core(
            ServiceOptions{.default_device = Device::Cpu(),
                           .max_inflight_bytes = limit},
            [] { return 0; }, &budget),
        steps(&core, &budget) {}
  ~Replica() { steps.EndAll(); }
  MemoryBudget budget;
  ServiceCore core;
  StepRegistry steps;
};

// A rank's receiving stream: attached, and read when asked.
struct Receiver {
  Receiver(StreamingStep* step, int rank) : step(step) {
    absl::StatusOr<int> attached =
        step->Attach(rank, 0, std::make_shared<StepListener>([] {}));
    EXPECT_TRUE(attached.ok()) << attached.status();
    slot = attached.value_or(-1);
  }
  // Every message there is now, each taken (dropped) before the next, as the
  // stream takes them; their token ids by step row into `rows`.
  void ReadAll() {
    while (true) {
      std::optional<absl::Status> end;
      StreamingStep::Message m = step->Next(slot, &end);
      if (m == nullptr) {
        if (end.has_value()) ended = end;
        return;
      }
      if (m->response.has_plan()) {
        global_loss_tokens = m->response.plan().global_loss_tokens();
        continue;
      }
      ++micro_batches;
      Record(m->response);
    }
  }
  // The packed token ids, split by row: each row's active tokens.
  void Record(const v1::PackMicroBatchesResponse& r) {
    const v1::PackResponse& packed = r.packed();
    ASSERT_EQ(packed.packed_size(), 1);
    const std::string& data = packed.packed(0).data();
    std::vector<int64_t> ids(data.size() / 8);
    std::memcpy(ids.data(), data.data(), data.size());
    ASSERT_EQ(packed.cu_seqlens_size(), r.samples_size() + 1);
    for (int j = 0; j < r.samples_size(); ++j) {
      std::vector<int64_t>& row = rows[r.samples(j)];
      EXPECT_TRUE(row.empty()) << "step row " << r.samples(j) << " twice";
      row.assign(ids.begin() + packed.cu_seqlens(j),
                 ids.begin() + packed.cu_seqlens(j + 1));
    }
  }
  StreamingStep* step;
  int slot = -1;
  int micro_batches = 0;
  std::optional<absl::Status> ended;
  int64_t global_loss_tokens = -1;
  std::map<int64_t, std::vector<int64_t>> rows;
};

// The token ids Group gives row `r` of a group of `lengths` and `seed`.
std::vector<int64_t> Expected(int64_t seed, int64_t r, int64_t length) {
  std::vector<int64_t> ids;
  for (int64_t s = 0; s < length; ++s) ids.push_back(seed * 1000 + r * 100 + s);
  return ids;
}

TEST(StreamStep, AnotherTenantsStepIsUnknownToIt) {
  Replica replica;
  const Tenant a = Named("job-a"), b = Named("job-b");
  absl::StatusOr<std::shared_ptr<StreamingStep>> step =
      replica.steps.Open(a, Options(1, 1000, "x"));
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_TRUE(replica.steps.Find(a, "x", StepAccess::kSubmit).ok());
  EXPECT_TRUE(replica.steps.Find(a, "x", StepAccess::kOwner).ok());
  const absl::Status as_submitter =
      replica.steps.Find(b, "x", StepAccess::kSubmit).status();
  const absl::Status as_rank =
      replica.steps.Find(b, "x", StepAccess::kOwner).status();
  // Another tenant opens the same id: a step of its own, no ALREADY_EXISTS.
  absl::StatusOr<std::shared_ptr<StreamingStep>> theirs =
      replica.steps.Open(b, Options(3, 1000, "x"));
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_NE(theirs->get(), step->get());
  EXPECT_EQ(replica.steps.Find(b, "x", StepAccess::kOwner).value().get(),
            theirs->get());
  EXPECT_EQ(replica.steps.Open(a, Options(1, 1000, "x")).status().code(),
            absl::StatusCode::kAlreadyExists)
      << "its own id, open already";
  replica.steps.Remove(**theirs);
  replica.steps.Remove(**step);
  const absl::Status unknown =
      replica.steps.Find(b, "x", StepAccess::kSubmit).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(as_submitter, unknown) << "the same answer as for no step";
  EXPECT_EQ(as_rank, unknown);
}

TEST(StreamStep, NamedSubmittersSubmitAndNothingElse) {
  Replica replica;
  const Tenant a = Named("job-a"), workers = Named("workers");
  v1::StepOptions options = Options(1, 1000, "x");
  options.add_submitters("workers");
  absl::StatusOr<std::shared_ptr<StreamingStep>> step =
      replica.steps.Open(a, options);
  ASSERT_TRUE(step.ok()) << step.status();
  absl::StatusOr<std::shared_ptr<StreamingStep>> found =
      replica.steps.Find(workers, "x", StepAccess::kSubmit);
  ASSERT_TRUE(found.ok()) << found.status();
  v1::SubmitGroupResponse reply;
  EXPECT_TRUE((*found)->Submit(workers, Group("x", {5, 7}, 1), &reply).ok());
  EXPECT_EQ(
      replica.steps.Find(workers, "x", StepAccess::kOwner).status().code(),
      absl::StatusCode::kNotFound)
      << "a submitter does not receive";
  EXPECT_EQ(replica.steps.Find(Named("other"), "x", StepAccess::kSubmit)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST(StreamStep, IdsPackdChoosesCarry128RandomBits) {
  Replica replica;
  absl::flat_hash_set<std::string> ids;
  const std::regex form("step-[0-9a-f]{32}");
  for (int i = 0; i < 200; ++i) {
    absl::StatusOr<std::shared_ptr<StreamingStep>> step =
        replica.steps.Open(Tenant(), Options(1, 1000));
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_TRUE(std::regex_match((*step)->id(), form)) << (*step)->id();
    EXPECT_TRUE(ids.insert((*step)->id()).second);
    replica.steps.Remove(**step);
  }
  // Every bit varies somewhere: not a clock and a counter.
  std::string any_or(16, '\0'), all_and(16, '\xff');
  for (const std::string& id : ids) {
    std::string bits = absl::HexStringToBytes(id.substr(5));
    for (int i = 0; i < 16; ++i) {
      any_or[i] |= bits[i];
      all_and[i] &= bits[i];
    }
  }
  EXPECT_EQ(any_or, std::string(16, '\xff'));
  EXPECT_EQ(all_and, std::string(16, '\0'));
}

TEST(StreamStep, AGroupKeyIsTakenOnce) {
  Replica replica;
  absl::StatusOr<std::shared_ptr<StreamingStep>> opened =
      replica.steps.Open(Tenant(), Options(1, 1 << 20));
  ASSERT_TRUE(opened.ok());
  StreamingStep& step = **opened;
  Receiver rank(&step, 0);
  v1::SubmitGroupResponse first, again, other;
  ASSERT_TRUE(
      step.Submit(Tenant(), Group(step.id(), {5, 9}, 1, "k"), &first).ok());
  ASSERT_TRUE(
      step.Submit(Tenant(), Group(step.id(), {5, 9}, 1, "k"), &again).ok());
  EXPECT_EQ(again.SerializeAsString(), first.SerializeAsString());
  const absl::Status differs =
      step.Submit(Tenant(), Group(step.id(), {5, 8}, 1, "k"), &other);
  EXPECT_EQ(differs.code(), absl::StatusCode::kAlreadyExists) << differs;
  EXPECT_THAT(differs.message(), HasSubstr("group_key \"k\""));
  // Without a key, every submit is a group of its own.
  ASSERT_TRUE(step.Submit(Tenant(), Group(step.id(), {3}, 2), &other).ok());
  ASSERT_TRUE(step.Submit(Tenant(), Group(step.id(), {3}, 2), &other).ok());
  EXPECT_EQ(other.group(), 2);
  ASSERT_TRUE(step.Close().ok());
  rank.ReadAll();
  ASSERT_TRUE(rank.ended.has_value());
  EXPECT_TRUE(rank.ended->ok()) << *rank.ended;
  EXPECT_EQ(rank.global_loss_tokens, 5 + 9 + 3 + 3);
  EXPECT_EQ(rank.rows.size(), 4u);
  // A retry after the close (its reply was lost) still gets its reply.
  EXPECT_TRUE(
      step.Submit(Tenant(), Group(step.id(), {5, 9}, 1, "k"), &again).ok());
  EXPECT_EQ(again.group(), 0);
}

TEST(StreamStep, AGroupWithoutRowsIsRefusedAndChangesNothing) {
  Replica replica;
  absl::StatusOr<std::shared_ptr<StreamingStep>> opened =
      replica.steps.Open(Tenant(), Options(1, 1 << 20));
  ASSERT_TRUE(opened.ok());
  StreamingStep& step = **opened;
  v1::SubmitGroupResponse reply;
  const absl::Status empty =
      step.Submit(Tenant(), Group(step.id(), {}, 1, "k"), &reply);
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
  EXPECT_THAT(empty.message(), HasSubstr("no rows"));
  ASSERT_TRUE(step.Submit(Tenant(), Group(step.id(), {4}, 1, "k"), &reply).ok())
      << "its key was not taken";
  EXPECT_EQ(reply.group(), 0);
}

TEST(StreamStep, BytesStayInTheBudgetUntilTheirStreamHasTakenThem) {
  // Groups of 4 rows of 60 tokens; a micro-batch of 256 tokens holds 4.
  const int64_t group_bytes = 4 * kRowBytes;
  Replica replica(/*limit=*/10 * group_bytes);
  absl::StatusOr<std::shared_ptr<StreamingStep>> opened =
      replica.steps.Open(Tenant(), Options(1, 256));
  ASSERT_TRUE(opened.ok());
  StreamingStep& step = **opened;
  Receiver rank(&step, 0);  // attached, reading nothing yet
  v1::SubmitGroupResponse reply;
  int taken = 0;
  absl::Status refused;
  for (int i = 0; i < 40 && refused.ok(); ++i) {
    refused =
        step.Submit(Tenant(), Group(step.id(), {60, 60, 60, 60}, i), &reply);
    taken += refused.ok();
    EXPECT_LE(replica.budget.in_use(), replica.budget.limit());
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_EQ(taken, 10) << "the budget holds ten groups, read or not";
  EXPECT_GT(reply.waves(), 0) << "waves committed, packed only when read";
  // The stream takes one micro-batch: while it holds it, its bytes count
  // (its rows' went); once dropped, a group fits again.
  std::optional<absl::Status> end;
  StreamingStep::Message m = step.Next(rank.slot, &end);
  ASSERT_NE(m, nullptr);
  EXPECT_GE(replica.budget.in_use(), 9 * group_bytes);
  EXPECT_FALSE(
      step.Submit(Tenant(), Group(step.id(), {60, 60, 60, 60}, 50), &reply)
          .ok());
  // The metrics show what the step holds, by kind.
  const std::string shown = replica.core.metrics().Render();
  const std::string series = absl::StrCat(
      "packd_stream_step_held_bytes{kind=\"micro_batches\",step=\"", step.id(),
      "\",tenant=\"anonymous\"} ", m->bytes);
  EXPECT_THAT(shown, HasSubstr(series));
  EXPECT_THAT(shown,
              HasSubstr(absl::StrCat(
                  "packd_stream_step_held_bytes{kind=\"groups\",step=\"",
                  step.id(), "\",tenant=\"anonymous\"} ", 9 * group_bytes)));
  m.reset();
  EXPECT_LE(replica.budget.in_use(), 9 * group_bytes);
  EXPECT_TRUE(
      step.Submit(Tenant(), Group(step.id(), {60, 60, 60, 60}, 50), &reply)
          .ok());
  ASSERT_TRUE(step.Close().ok());
  rank.ReadAll();
  ASSERT_TRUE(rank.ended.has_value() && rank.ended->ok());
  EXPECT_EQ(rank.rows.size(), 4u * 10) << "the micro-batch read by hand aside";
  EXPECT_EQ(replica.budget.in_use(), 0);
}

TEST(StreamStep, AFaultEndsTheStepForEveryPartyAndHoldsNothing) {
  Replica replica(/*limit=*/1 << 20);
  absl::StatusOr<std::shared_ptr<StreamingStep>> opened =
      replica.steps.Open(Tenant(), Options(2, 256));
  ASSERT_TRUE(opened.ok());
  StreamingStep& step = **opened;
  Receiver rank0(&step, 0), rank1(&step, 1);
  v1::SubmitGroupResponse reply;
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(
        step.Submit(Tenant(), Group(step.id(), {60, 60, 60, 60}, i), &reply)
            .ok());
  }
  std::optional<absl::Status> end;
  StreamingStep::Message taken = step.Next(rank0.slot, &end);  // being written
  ASSERT_NE(taken, nullptr);
  EXPECT_GT(replica.budget.in_use(), 0);
  step.Fail(absl::UnavailableError("rank 1's stream ended"));
  rank0.ReadAll();
  rank1.ReadAll();
  for (const Receiver* r : {&rank0, &rank1}) {
    ASSERT_TRUE(r->ended.has_value());
    EXPECT_EQ(r->ended->code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(step.Submit(Tenant(), Group(step.id(), {4}, 9), &reply).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(replica.budget.in_use(), taken->bytes)
      << "only the message its stream is writing";
  taken.reset();
  EXPECT_EQ(replica.budget.in_use(), 0);
  EXPECT_THAT(replica.core.metrics().Render(),
              HasSubstr(absl::StrCat(
                  "packd_stream_step_held_bytes{kind=\"groups\",step=\"",
                  step.id(), "\",tenant=\"anonymous\"} 0")));
}

TEST(StreamStep, RowsThePlannerHoldsBackNeverPinTheBudget) {
  // Two ranks, micro-batches of 100 tokens filled to 90 for a wave: rows of
  // 60 and 44 tokens never make one (60 + 44 > 100, 44 + 44 < 90), so
  // every row stays in the planner's pool until the close.
  Replica replica(/*limit=*/24 * kRowBytes);
  absl::StatusOr<std::shared_ptr<StreamingStep>> opened =
      replica.steps.Open(Tenant(), Options(2, 100));
  ASSERT_TRUE(opened.ok());
  StreamingStep& step = **opened;
  Receiver rank0(&step, 0), rank1(&step, 1);
  const int kGroups = 60;
  int taken = 0, refusals = 0;
  for (int attempt = 0; taken < kGroups && attempt < 20 * kGroups; ++attempt) {
    v1::SubmitGroupResponse reply;
    const absl::Status s = step.Submit(
        Tenant(), Group(step.id(), {60, 44}, taken, absl::StrCat(taken)),
        &reply);
    if (s.ok()) {
      ++taken;
    } else {
      ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      EXPECT_THAT(s.message(), HasSubstr("under-filled wave"));
      ++refusals;
    }
    rank0.ReadAll();  // ranks reading at full speed
    rank1.ReadAll();
    EXPECT_LE(replica.budget.in_use(),
              replica.budget.limit() + 2 * 2 * kRowBytes)
        << "the budget, and at most what one micro-batch per rank holds";
  }
  EXPECT_EQ(taken, kGroups) << "every group taken before the close";
  EXPECT_GT(refusals, 0);
  ASSERT_TRUE(step.Close().ok());
  rank0.ReadAll();
  rank1.ReadAll();
  ASSERT_TRUE(rank0.ended.has_value() && rank0.ended->ok());
  ASSERT_TRUE(rank1.ended.has_value() && rank1.ended->ok());
  EXPECT_EQ(rank0.micro_batches, rank1.micro_batches);
  std::map<int64_t, std::vector<int64_t>> rows = rank0.rows;
  rows.insert(rank1.rows.begin(), rank1.rows.end());
  ASSERT_EQ(rows.size(), 2u * kGroups) << "every row exactly once";
  for (int g = 0; g < kGroups; ++g) {
    EXPECT_EQ(rows[2 * g], Expected(g, 0, 60));
    EXPECT_EQ(rows[2 * g + 1], Expected(g, 1, 44));
  }
  EXPECT_EQ(rank0.global_loss_tokens, kGroups * (60 + 44));
  EXPECT_EQ(replica.budget.in_use(), 0);
}

}  // namespace
}  // namespace packd
