// bench_service: the Pack RPC, inline and through shared-memory tensor handles,
// against the in-process kernel on the same data, in one run.
//
// clang-format off
//   bench_service           # [16, 1024, 4096] bf16 (128 MiB), density 0.3
//   bench_service --smoke   # tiny, for ctest
// clang-format on
//
// The server runs in this process on a loopback port, so the RPCs take the real
// gRPC path.
#include <ATen/ATen.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/shm_segment.h"
#include "kernels/mask_patterns.h"
#include "kernels/pack.h"
#include "kernels/status_macros.h"
#include "kernels/torch/torch_interop.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "proto/tensor_codec.h"
#include "server/server.h"

ABSL_FLAG(bool, smoke, false, "Tiny batch and few repeats");
ABSL_FLAG(int64_t, batch, 16, "B");
ABSL_FLAG(int64_t, seq, 1024, "S");
ABSL_FLAG(int64_t, hidden, 4096, "Hidden size (bf16)");
ABSL_FLAG(double, density, 0.3, "Fraction of active positions (prefix masks)");
ABSL_FLAG(int, repeats, 10, "Timed calls per row (median reported)");
ABSL_FLAG(std::string, json, "", "Also write the rows as JSON to this file");
ABSL_FLAG(std::string, concurrencies, "1,4,16",
          "Small calls: calls in flight to measure at");
ABSL_FLAG(int, small_calls, 400, "Small calls: calls per concurrency level");

namespace packd {
namespace {

double MedianMs(int repeats, const std::function<void()>& fn) {
  fn();
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(
                     std::chrono::steady_clock::now() - t0)
                     .count());
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

void Check(const grpc::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "bench_service: %s: %s\n", what,
                 status.error_message().c_str());
    std::exit(1);
  }
}

// A do-nothing RPC on the same gRPC stack: the limit for inline calls. It reads
// the request and answers with as many bytes as the client names in
// "x-response-bytes", from a static buffer.
class NullService : public grpc::CallbackGenericService {
 public:
  explicit NullService(size_t max_response) : payload_(max_response, 'x') {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    size_t bytes = 0;
    const auto& metadata = context->client_metadata();
    if (auto it = metadata.find("x-response-bytes"); it != metadata.end()) {
      absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()),
                       &bytes);
    }
    return new Reactor(payload_.data(), std::min(bytes, payload_.size()));
  }

 private:
  class Reactor : public grpc::ServerGenericBidiReactor {
   public:
    Reactor(const char* data, size_t bytes) : data_(data), bytes_(bytes) {
      StartRead(&request_);
    }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      grpc::Slice slice(data_, bytes_, grpc::Slice::STATIC_SLICE);
      response_ = grpc::ByteBuffer(&slice, 1);
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    const char* data_;
    size_t bytes_;
    grpc::ByteBuffer request_, response_;
  };
  std::string payload_;
};

grpc::ByteBuffer Serialized(const google::protobuf::Message& message) {
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// One do-nothing call carrying `request` and asking for `response_bytes` back.
// Like a real call, it serialises the request and copies the response out of
// gRPC's buffers (what parsing a bytes field costs); the server side does
// nothing at all.
void NullCall(grpc::GenericStub& stub, const google::protobuf::Message& request,
              size_t response_bytes) {
  grpc::ClientContext context;
  context.AddMetadata("x-response-bytes", std::to_string(response_bytes));
  const grpc::ByteBuffer request_bytes = Serialized(request);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/packd.bench.Null/Call", grpc::StubOptions(),
                 &request_bytes, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  Check(done.get_future().get(), "do-nothing call");
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string copy;
  copy.reserve(response_bytes);
  for (const grpc::Slice& slice : slices) {
    copy.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
}

// p50 and p99 in ms of `total` calls of `call`, `concurrency` at a time.
std::pair<double, double> Latencies(int concurrency, int total,
                                    const std::function<void()>& call) {
  std::vector<double> ms;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < concurrency; ++t) {
    threads.emplace_back([&] {
      std::vector<double> mine;
      for (int i = 0; i < total / concurrency; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        call();
        mine.push_back(std::chrono::duration<double, std::milli>(
                           std::chrono::steady_clock::now() - t0)
                           .count());
      }
      std::lock_guard<std::mutex> lock(mu);
      ms.insert(ms.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : threads) t.join();
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms[std::min(ms.size() - 1, ms.size() * 99 / 100)]};
}

struct Row {
  std::string name, memory;
  double ms;
};

// The large batch: x [B, S, H] bf16 and a prefix mask, with x copied into a
// shared-memory segment (registered as region "bench") whose second half takes
// the results of the handle path.
struct LargeBatch {
  at::Tensor x, mask;
  std::unique_ptr<ShmSegment> segment;
  int64_t active = 0, packed_bytes = 0;
  v1::PackRequest inline_request, shm_request;
};

absl::StatusOr<LargeBatch> MakeLargeBatch(int64_t B, int64_t S, int64_t H,
                                          double density) {
  LargeBatch batch;
  batch.x = at::randint(-1000, 1000, {B, S, H}, at::kFloat).to(at::kBFloat16);
  std::mt19937_64 rng(7);
  std::vector<uint8_t> active =
      MaskActivity(MaskPattern::kPrefix, B, S, density, rng);
  batch.mask = at::from_blob(active.data(), {B, S}, at::kByte).to(at::kBool);
  batch.active = batch.mask.sum().item<int64_t>();
  batch.packed_bytes = batch.active * H * 2;
  const int64_t x_bytes = batch.x.nbytes();
  PACKD_ASSIGN_OR_RETURN(
      batch.segment,
      ShmSegment::Create(ShmSegment::UniqueKey("/packd_bench"), 2 * x_bytes));
  std::memcpy(batch.segment->data(), batch.x.data_ptr(), x_bytes);
  std::memset(batch.segment->data() + x_bytes, 0, x_bytes);

  v1::Tensor mask_proto;
  EncodeInlineTensor(DType::kBool, batch.mask.sizes().vec(),
                     batch.mask.data_ptr(), batch.mask.nbytes(), &mask_proto);
  *batch.inline_request.mutable_mask() = mask_proto;
  EncodeInlineTensor(DType::kBFloat16, batch.x.sizes().vec(),
                     batch.x.data_ptr(), x_bytes,
                     batch.inline_request.add_inputs());
  *batch.shm_request.mutable_mask() = mask_proto;
  v1::Tensor* handle = batch.shm_request.add_inputs();
  EncodeTensorHeader(DType::kBFloat16, batch.x.sizes().vec(), handle);
  handle->mutable_region()->set_region("bench");
  handle->mutable_region()->set_byte_size(x_bytes);
  v1::RegionSlice* out = batch.shm_request.add_outputs();
  out->set_region("bench");
  out->set_offset(x_bytes);
  out->set_byte_size(x_bytes);
  return batch;
}

// The do-nothing RPC's server, on a loopback port; the stub that calls it.
struct NullServer {
  std::unique_ptr<NullService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::GenericStub> stub;
};

NullServer StartNullServer(size_t max_response,
                           const grpc::ChannelArguments& args) {
  NullServer null;
  null.service = std::make_unique<NullService>(max_response);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.SetMaxSendMessageSize(1 << 30);
  builder.RegisterCallbackGenericService(null.service.get());
  null.server = builder.BuildAndStart();
  null.stub = std::make_unique<grpc::GenericStub>(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                grpc::InsecureChannelCredentials(), args));
  return null;
}

// The in-process kernel (into a touched buffer, and on the segment's pages),
// then the Pack RPC through handles and inline, then the do-nothing RPC with
// the inline call's bytes.
std::vector<Row> MeasureLargeCalls(LargeBatch& batch,
                                   v1::PackService::Stub& stub,
                                   grpc::GenericStub& null_stub,
                                   size_t response_bytes, int repeats) {
  const int64_t x_bytes = batch.x.nbytes();
  char* seg = batch.segment->data();
  at::Tensor touched =
      at::zeros({batch.active, batch.x.size(2)}, at::kBFloat16);
  const std::vector<TensorView> inputs = {AsView(batch.x)};
  const std::vector<TensorView> outputs = {AsView(touched)};
  PackOptions into;
  into.outputs = outputs;
  // The same kernel on the segment's pages (4 KiB shmem pages unless the
  // system enables shmem huge pages), which is what the server works on.
  TensorView x_in_shm = AsView(batch.x);
  x_in_shm.data = seg;
  TensorView out_in_shm = AsView(touched);
  out_in_shm.data = seg + x_bytes;
  const std::vector<TensorView> shm_inputs = {x_in_shm};
  const std::vector<TensorView> shm_outputs = {out_in_shm};
  PackOptions into_shm;
  into_shm.outputs = shm_outputs;
  const TensorView mask = AsView(batch.mask);

  std::vector<Row> rows;
  rows.push_back({"in-process kernel (packd::Pack)", "caller buffer, touched",
                  MedianMs(repeats, [&] {
                    if (!Pack(inputs, mask, into).ok()) std::exit(1);
                  })});
  rows.push_back({"in-process kernel on the segment", "output in the segment",
                  MedianMs(repeats, [&] {
                    if (!Pack(shm_inputs, mask, into_shm).ok()) std::exit(1);
                  })});
  rows.push_back({"Pack RPC, shared-memory handles", "output region slice",
                  MedianMs(repeats, [&] {
                    grpc::ClientContext c;
                    v1::PackResponse r;
                    Check(stub.Pack(&c, batch.shm_request, &r),
                          "Pack (handles)");
                  })});
  rows.push_back({"Pack RPC, inline bytes", "response message",
                  MedianMs(std::max(2, repeats / 3), [&] {
                    grpc::ClientContext c;
                    v1::PackResponse r;
                    Check(stub.Pack(&c, batch.inline_request, &r),
                          "Pack (inline)");
                  })});
  rows.push_back({"do-nothing RPC, same bytes (limit)", "static buffer",
                  MedianMs(std::max(2, repeats / 3), [&] {
                    NullCall(null_stub, batch.inline_request, response_bytes);
                  })});
  // The handle path must have produced the same bytes as the kernel.
  if (std::memcmp(seg + x_bytes, touched.data_ptr(), batch.packed_bytes) != 0) {
    std::fprintf(stderr,
                 "bench_service: the handle path's result differs from the "
                 "kernel's\n");
    std::exit(1);
  }
  return rows;
}

void PrintLargeCalls(const LargeBatch& batch, double density, int repeats,
                     size_t response_bytes, const std::vector<Row>& rows) {
  const int64_t B = batch.x.size(0), S = batch.x.size(1), H = batch.x.size(2);
  std::printf(
      "bench_service: x [%lld, %lld, %lld] bf16 (%.1f MiB), prefix mask "
      "density %.2f, %lld active rows (%.1f MiB packed), median of %d\n\n",
      (long long)B, (long long)S, (long long)H, batch.x.nbytes() / 1048576.0,
      density, (long long)batch.active, batch.packed_bytes / 1048576.0,
      repeats);
  std::printf("%-34s %10s %10s %14s  %s\n", "path", "ms", "GB/s",
              "x in-process", "result memory");
  for (const Row& r : rows) {
    std::printf("%-34s %10.3f %10.2f %14.3f  %s\n", r.name.c_str(), r.ms,
                batch.packed_bytes / (r.ms * 1e6), rows[0].ms / r.ms,
                r.memory.c_str());
  }
  std::printf("\nshared memory / in-process throughput: %.2f (target >= 0.8)\n",
              rows[0].ms / rows[2].ms);
  std::printf("shared memory / in-process on the same pages: %.2f\n",
              rows[1].ms / rows[2].ms);
  std::printf("shared memory / inline speed-up:        %.1fx (target >= 20)\n",
              rows[3].ms / rows[2].ms);
  std::printf(
      "do-nothing RPC / inline Pack RPC time, same %.1f MiB: %.2f (1.0 = at "
      "the limit)\n",
      (batch.inline_request.ByteSizeLong() + response_bytes) / 1048576.0,
      rows[4].ms / rows[3].ms);
}

// Latency of a small inline Pack at several concurrencies, against the
// do-nothing RPC carrying the same bytes at the same concurrency.
void MeasureSmallCalls(v1::PackService::Stub& stub,
                       grpc::GenericStub& null_stub, bool smoke) {
  const at::Tensor small_x =
      at::randint(-1000, 1000, {4, 128, 64}, at::kFloat).to(at::kBFloat16);
  const at::Tensor small_mask = at::rand({4, 128}) < 0.5;
  v1::PackRequest request;
  EncodeInlineTensor(DType::kBool, small_mask.sizes().vec(),
                     small_mask.data_ptr(), small_mask.nbytes(),
                     request.mutable_mask());
  EncodeInlineTensor(DType::kBFloat16, small_x.sizes().vec(),
                     small_x.data_ptr(), small_x.nbytes(),
                     request.add_inputs());
  v1::PackResponse response;
  {
    grpc::ClientContext c;
    Check(stub.Pack(&c, request, &response), "Pack (small)");
  }
  const int calls = absl::GetFlag(FLAGS_small_calls);
  std::printf(
      "\nsmall calls: x [4, 128, 64] bf16, random mask 0.5 (%zu request "
      "bytes, %zu response bytes), %d calls per level\n",
      request.ByteSizeLong(), response.ByteSizeLong(), calls);
  std::printf("%12s %12s %12s %14s %14s %10s %10s\n", "concurrency", "Pack p50",
              "Pack p99", "nothing p50", "nothing p99", "p50 x", "p99 x");
  for (absl::string_view level : absl::StrSplit(
           absl::GetFlag(FLAGS_concurrencies), ',', absl::SkipEmpty())) {
    int c = 1;
    if (!absl::SimpleAtoi(level, &c) || c < 1) continue;
    const int total = smoke ? 2 * c : calls;
    const auto pack = Latencies(c, total, [&] {
      grpc::ClientContext ctx;
      v1::PackResponse r;
      Check(stub.Pack(&ctx, request, &r), "Pack (small)");
    });
    const auto nothing = Latencies(c, total, [&] {
      NullCall(null_stub, request, response.ByteSizeLong());
    });
    std::printf("%12d %10.3fms %10.3fms %12.3fms %12.3fms %10.2f %10.2f\n", c,
                pack.first, pack.second, nothing.first, nothing.second,
                pack.first / nothing.first, pack.second / nothing.second);
  }
}

void WriteJson(const std::string& path, const LargeBatch& batch, double density,
               const std::vector<Row>& rows) {
  std::ofstream f(path);
  f << "[\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    f << absl::StrFormat(
        "  {\"path\": \"%s\", \"B\": %d, \"S\": %d, \"hidden\": %d, "
        "\"density\": %g, \"active_rows\": %d, \"bytes_moved\": %d, "
        "\"median_ms\": %.4f}%s\n",
        rows[i].name, batch.x.size(0), batch.x.size(1), batch.x.size(2),
        density, batch.active, batch.packed_bytes, rows[i].ms,
        i + 1 < rows.size() ? "," : "");
  }
  f << "]\n";
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const bool smoke = absl::GetFlag(FLAGS_smoke);
  const int64_t B = smoke ? 2 : absl::GetFlag(FLAGS_batch);
  const int64_t S = smoke ? 64 : absl::GetFlag(FLAGS_seq);
  const int64_t H = smoke ? 64 : absl::GetFlag(FLAGS_hidden);
  const int repeats = smoke ? 2 : absl::GetFlag(FLAGS_repeats);
  const double density = absl::GetFlag(FLAGS_density);

  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.service.regions.enabled = true;
  options.service.regions.key_prefix = "/packd_bench";
  auto server = PackdServer::Start(options);
  absl::StatusOr<LargeBatch> batch = MakeLargeBatch(B, S, H, density);
  if (!server.ok() || !batch.ok()) {
    std::fprintf(
        stderr, "bench_service: %s\n",
        (server.ok() ? batch.status() : server.status()).ToString().c_str());
    return 1;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  auto stub = v1::PackService::NewStub(grpc::CreateCustomChannel(
      (*server)->address(), grpc::InsecureChannelCredentials(), args));
  {
    v1::RegisterSystemRegionRequest reg;
    reg.set_name("bench");
    reg.set_key(batch->segment->key());
    reg.set_byte_size(batch->segment->size());
    grpc::ClientContext c;
    v1::RegisterRegionResponse r;
    Check(stub->RegisterSystemRegion(&c, reg, &r), "RegisterSystemRegion");
  }
  // The inline call's response size, for the do-nothing RPC.
  v1::PackResponse inline_response;
  {
    grpc::ClientContext c;
    Check(stub->Pack(&c, batch->inline_request, &inline_response),
          "Pack (inline)");
  }
  const size_t response_bytes = inline_response.ByteSizeLong();
  NullServer null =
      StartNullServer(std::max<size_t>(response_bytes, 1 << 20), args);

  const std::vector<Row> rows =
      MeasureLargeCalls(*batch, *stub, *null.stub, response_bytes, repeats);
  PrintLargeCalls(*batch, density, repeats, response_bytes, rows);
  MeasureSmallCalls(*stub, *null.stub, smoke);
  null.server->Shutdown();
  if (!absl::GetFlag(FLAGS_json).empty()) {
    WriteJson(absl::GetFlag(FLAGS_json), *batch, density, rows);
  }
  (*server)->Drain();
  (*server)->Wait();
  return 0;
}

}  // namespace
}  // namespace packd

int main(int argc, char** argv) { return packd::Main(argc, argv); }
