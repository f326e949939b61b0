// bench_service: the Pack RPC inline (C++ and Python clients, unix socket and
// TCP loopback) and through shared-memory tensor handles, against its limits
// measured in the same run: the same bytes through a plain socket, a
// zero-copy do-nothing RPC, and the in-process kernel.
//
// clang-format off
//   bench_service           # [16, 1024, 4096] bf16 (128 MiB), density 0.3
//   bench_service --smoke   # tiny, for ctest
// clang-format on
//
// The servers run in this process (one on a loopback port, one on a unix
// socket), so the RPCs take the real gRPC path; the Python client runs in a
// child process.
#include <ATen/ATen.h>
#include <grpcpp/generic/generic_stub.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

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
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "base/status_macros.h"
#include "base/torch_interop.h"
#include "client/client.h"
#include "client/shm_mapping.h"
#include "kernels/pack.h"
#include "packd/v1/pack_service.grpc.pb.h"
#include "proto/grpc_wire.h"
#include "proto/tensor_codec.h"
#include "proto/wire.h"
#include "server/server.h"
#include "workloads/mask_patterns.h"

#ifndef PACKD_BINARY
#define PACKD_BINARY "packd"
#endif

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
ABSL_FLAG(int, rss_calls, 16,
          "Peak memory: inline calls at once against a packd process (0 "
          "skips)");
ABSL_FLAG(bool, rss_only, false, "Only the peak-memory rows");
ABSL_FLAG(bool, small_only, false,
          "Only the small-call rows (to profile them: perf record)");
ABSL_FLAG(std::string, packd, PACKD_BINARY,
          "Peak memory: the packd binary to measure");
ABSL_FLAG(std::string, packd_flags,
          "--keep_freed_memory=true --keep_freed_memory=false",
          "--rss_only: the packd flags of each measurement, comma-separated "
          "(or '' for none); measurements space-separated");
ABSL_FLAG(std::string, python, "/usr/bin/python3",
          "Python with torch and grpcio for the Python client's rows; empty "
          "skips them");

#ifndef PACKD_PYTHON_DIR
#define PACKD_PYTHON_DIR ""
#endif
#ifndef PACKD_BENCH_PYTHON_SCRIPT
#define PACKD_BENCH_PYTHON_SCRIPT ""
#endif

namespace packd {
namespace {

// The median of `repeats` timed calls, after three untimed ones (a new
// connection's flow-control windows grow over its first calls).
double MedianMs(int repeats, const std::function<void()>& fn) {
  for (int i = 0; i < 3; ++i) fn();
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

// The median ms of each of `fns`, called in turn `repeats` times (after three
// untimed rounds).
std::vector<double> InterleavedMedianMs(
    int repeats, const std::vector<std::function<void()>>& fns) {
  for (int i = 0; i < 3; ++i) {
    for (const auto& fn : fns) fn();
  }
  std::vector<std::vector<double>> ms(fns.size());
  for (int i = 0; i < repeats; ++i) {
    for (size_t k = 0; k < fns.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      fns[k]();
      ms[k].push_back(std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - t0)
                          .count());
    }
  }
  std::vector<double> medians;
  for (std::vector<double>& m : ms) {
    std::nth_element(m.begin(), m.begin() + m.size() / 2, m.end());
    medians.push_back(m[m.size() / 2]);
  }
  return medians;
}

void Die(const std::string& what) {
  std::fprintf(stderr, "bench_service: %s\n", what.c_str());
  std::exit(1);
}

void Check(const grpc::Status& status, const char* what) {
  if (!status.ok()) Die(absl::StrCat(what, ": ", status.error_message()));
}

void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) Die(absl::StrCat(what, ": ", status.ToString()));
}

// ---- The limits ----------------------------------------------------------

// The same bytes through a plain socket: the client sends `up` bytes, a
// thread reads them all and answers with `down` bytes; both reuse their
// buffers. Median ms of a round trip.
class RawSocketLimit {
 public:
  RawSocketLimit(bool unix_socket, size_t up, size_t down)
      : up_(up), down_(down), out_(up, 'u'), reply_(down, 'd') {
    int listener = -1;
    if (unix_socket) {
      path_ = absl::StrCat("/tmp/packd-bench-", getpid(), ".sock");
      unlink(path_.c_str());
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path_.c_str());
      listener = socket(AF_UNIX, SOCK_STREAM, 0);
      if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
              0 ||
          listen(listener, 1) != 0) {
        Die("raw socket: cannot listen on a unix socket");
      }
      client_ = socket(AF_UNIX, SOCK_STREAM, 0);
      if (connect(client_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
          0) {
        Die("raw socket: cannot connect");
      }
    } else {
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      listener = socket(AF_INET, SOCK_STREAM, 0);
      socklen_t len = sizeof(addr);
      if (bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
          listen(listener, 1) != 0 ||
          getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) !=
              0) {
        Die("raw socket: cannot listen on loopback");
      }
      client_ = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(client_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
        Die("raw socket: cannot connect");
      }
      const int one = 1;
      setsockopt(client_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    server_ = accept(listener, nullptr, nullptr);
    close(listener);
    echo_ = std::thread([this] {
      std::string in(up_, '\0');
      while (ReadAll(server_, in.data(), up_) && WriteAll(server_, reply_)) {
      }
    });
  }
  ~RawSocketLimit() {
    shutdown(client_, SHUT_RDWR);
    close(client_);
    echo_.join();
    close(server_);
    if (!path_.empty()) unlink(path_.c_str());
  }

  void RoundTrip() {
    if (!WriteAll(client_, out_) || !ReadAll(client_, in_.data(), down_)) {
      Die("raw socket: round trip failed");
    }
  }

 private:
  static bool WriteAll(int fd, const std::string& bytes) {
    for (size_t at = 0; at < bytes.size();) {
      const ssize_t n = send(fd, bytes.data() + at, bytes.size() - at, 0);
      if (n <= 0) return false;
      at += n;
    }
    return true;
  }
  static bool ReadAll(int fd, char* out, size_t bytes) {
    for (size_t at = 0; at < bytes;) {
      const ssize_t n = recv(fd, out + at, bytes - at, 0);
      if (n <= 0) return false;
      at += n;
    }
    return true;
  }

  size_t up_, down_;
  std::string out_, reply_, in_ = std::string(down_, '\0');
  std::string path_;
  int client_ = -1, server_ = -1;
  std::thread echo_;
};

// A do-nothing RPC on the same gRPC stack and the same kind of method as
// Pack (a raw unary callback method), zero-copy at both ends: the request
// wraps the caller's memory, the server reads nothing and answers with
// `response_bytes` from a static buffer, and the client leaves the reply in
// gRPC's slices.
class NullService : public v1::PackService::WithRawCallbackMethod_Pack<
                        v1::PackService::CallbackService> {
 public:
  explicit NullService(size_t response_bytes) : payload_(response_bytes, 'x') {}

  grpc::ServerUnaryReactor* Pack(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer*,
                                 grpc::ByteBuffer* response) override {
    grpc::Slice slice(payload_.data(), payload_.size(),
                      grpc::Slice::STATIC_SLICE);
    *response = grpc::ByteBuffer(&slice, 1);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  std::string payload_;
};

// The do-nothing RPC's server on `listen`, and the stub that calls it.
struct NullServer {
  std::unique_ptr<NullService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::GenericStub> stub;

  // One call sending `request` (wrapped, not copied).
  void Call(const grpc::ByteBuffer& request) const {
    grpc::ClientContext context;
    grpc::ByteBuffer response;
    absl::Notification done;
    grpc::Status status;
    stub->UnaryCall(&context, "/packd.v1.PackService/Pack", grpc::StubOptions(),
                    &request, &response, [&](grpc::Status s) {
                      status = std::move(s);
                      done.Notify();
                    });
    done.WaitForNotification();
    Check(status, "do-nothing call");
    std::vector<grpc::Slice> slices;
    (void)response.Dump(&slices);
  }
};

grpc::ChannelArguments LargeMessages() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  return args;
}

NullServer StartNullServer(const std::string& listen, size_t response_bytes) {
  NullServer null;
  null.service = std::make_unique<NullService>(response_bytes);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.SetMaxSendMessageSize(1 << 30);
  builder.RegisterService(null.service.get());
  null.server = builder.BuildAndStart();
  if (null.server == nullptr) Die("cannot start the do-nothing server");
  const std::string address =
      absl::StartsWith(listen, "unix:")
          ? listen
          : absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  null.stub = std::make_unique<grpc::GenericStub>(grpc::CreateCustomChannel(
      address, grpc::InsecureChannelCredentials(), LargeMessages()));
  return null;
}

// `header` carrying x and the mask of `x`'s batch in place (both outlive it).
void CarryBatch(const at::Tensor& x, const at::Tensor& mask,
                Wire<v1::PackRequest>* header) {
  EncodeTensorHeader(DType::kBool, mask.sizes().vec(),
                     (*header)->mutable_mask());
  EncodeTensorHeader(DType::kBFloat16, x.sizes().vec(),
                     (*header)->add_inputs());
  header->Carry((*header)->mask(), Payload::Of(mask.data_ptr(), mask.nbytes()));
  header->Carry((*header)->inputs(0), Payload::Of(x.data_ptr(), x.nbytes()));
}

// ---- The batch -----------------------------------------------------------

// The large batch: x [B, S, H] bf16 and a prefix mask, with x copied into a
// shared-memory segment (registered as region "bench") whose second half takes
// the results of the handle path. `header` is the inline request without its
// tensors' bytes, which it carries in place.
struct LargeBatch {
  at::Tensor x, mask;
  std::unique_ptr<ShmMapping> segment;
  int64_t active = 0, packed_bytes = 0;
  v1::PackRequest inline_request, shm_request;
  Wire<v1::PackRequest> header;
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
      ShmMapping::Create(ShmMapping::UniqueKey("/packd_bench"), 2 * x_bytes));
  std::memcpy(batch.segment->data(), batch.x.data_ptr(), x_bytes);
  std::memset(batch.segment->data() + x_bytes, 0, x_bytes);

  CarryBatch(batch.x, batch.mask, &batch.header);

  EncodeInlineTensor(DType::kBool, batch.mask.sizes().vec(),
                     batch.mask.data_ptr(), batch.mask.nbytes(),
                     batch.inline_request.mutable_mask());
  EncodeInlineTensor(DType::kBFloat16, batch.x.sizes().vec(),
                     batch.x.data_ptr(), x_bytes,
                     batch.inline_request.add_inputs());
  *batch.shm_request.mutable_mask() = batch.inline_request.mask();
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

// ---- Rows ----------------------------------------------------------------

struct Row {
  std::string name;
  double unix_ms = 0, tcp_ms = 0;  // 0: not measured
};

// The active length of each row of a prefix mask, comma-separated.
std::string RowLengths(const at::Tensor& mask) {
  const at::Tensor lengths = mask.sum(1).to(at::kLong).contiguous();
  return absl::StrJoin(
      absl::MakeConstSpan(lengths.data_ptr<int64_t>(), lengths.numel()), ",");
}

// p50 of a Python client's inline Pack of a batch of the same shape, dtype
// and row lengths, or 0 when Python is not available.
double PythonPackMs(const std::string& address, const LargeBatch& batch,
                    int repeats) {
  const std::string python = absl::GetFlag(FLAGS_python);
  if (python.empty() || std::string(PACKD_PYTHON_DIR).empty()) return 0;
  const std::string out = absl::StrCat("/tmp/packd-bench-py-", getpid());
  const std::string command =
      absl::StrCat("PYTHONPATH=", PACKD_PYTHON_DIR, " ", python, " ",
                   PACKD_BENCH_PYTHON_SCRIPT, " --address=", address,
                   " --shape=", batch.x.size(0), ",", batch.x.size(1), ",",
                   batch.x.size(2), " --lengths=", RowLengths(batch.mask),
                   " --repeats=", repeats, " > ", out);
  if (std::system(command.c_str()) != 0) {
    std::fprintf(stderr, "bench_service: the Python client's run failed\n");
    return 0;
  }
  std::ifstream f(out);
  double ms = 0;
  f >> ms;
  unlink(out.c_str());
  return ms;
}

struct Servers {
  std::unique_ptr<PackdServer> tcp, unix_socket;
};

Servers StartServers() {
  Servers servers;
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.service.regions.enabled = true;
  options.service.regions.key_prefix = "/packd_bench";
  auto tcp = PackdServer::Start(options);
  Check(tcp.status(), "start the TCP server");
  options.listen =
      absl::StrCat("unix:/tmp/packd-bench-grpc-", getpid(), ".sock");
  auto unix_socket = PackdServer::Start(options);
  Check(unix_socket.status(), "start the unix-socket server");
  servers.tcp = std::move(*tcp);
  servers.unix_socket = std::move(*unix_socket);
  return servers;
}

std::unique_ptr<Client> ConnectClient(const std::string& address,
                                      int64_t split_threshold) {
  ClientOptions options;
  options.address = address;
  options.shared_memory_threshold_bytes = 0;  // inline
  options.split_threshold_bytes = split_threshold;
  auto client = Client::Connect(options);
  Check(client.status(), "connect");
  return std::move(*client);
}

std::vector<Row> MeasureLargeCalls(LargeBatch& batch, const Servers& servers,
                                   double density, int repeats) {
  const int64_t x_bytes = batch.x.nbytes();
  const size_t request_bytes = batch.inline_request.ByteSizeLong();
  size_t response_bytes = 0;
  auto stub_for = [](const std::string& address) {
    return v1::PackService::NewStub(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), LargeMessages()));
  };
  auto tcp_stub = stub_for(servers.tcp->address());
  auto unix_stub = stub_for(servers.unix_socket->address());
  {
    v1::PackResponse response;
    grpc::ClientContext c;
    Check(tcp_stub->Pack(&c, batch.inline_request, &response), "Pack");
    response_bytes = response.ByteSizeLong();
    // The result must be the kernel's.
    at::Tensor expected =
        at::empty({batch.active, batch.x.size(2)}, at::kBFloat16);
    PackOptions into;
    const std::vector<TensorView> inputs = {AsView(batch.x)};
    const std::vector<TensorView> outputs = {AsView(expected)};
    into.outputs = outputs;
    Check(Pack(inputs, AsView(batch.mask), into).status(), "in-process Pack");
    if (response.packed(0).data() !=
        std::string(static_cast<const char*>(expected.data_ptr()),
                    expected.nbytes())) {
      Die("the inline Pack's result differs from the kernel's");
    }
  }
  {
    v1::RegisterSystemRegionRequest reg;
    reg.set_name("bench");
    reg.set_key(batch.segment->key());
    reg.set_byte_size(batch.segment->size());
    for (auto* stub : {tcp_stub.get(), unix_stub.get()}) {
      grpc::ClientContext c;
      v1::RegisterRegionResponse r;
      Check(stub->RegisterSystemRegion(&c, reg, &r), "RegisterSystemRegion");
    }
  }
  const int slow = std::max(2, repeats / 3);
  std::vector<Row> rows;

  // The kernel in this process.
  at::Tensor touched =
      at::zeros({batch.active, batch.x.size(2)}, at::kBFloat16);
  const std::vector<TensorView> inputs = {AsView(batch.x)};
  const std::vector<TensorView> outputs = {AsView(touched)};
  PackOptions into;
  into.outputs = outputs;
  const double kernel = MedianMs(repeats, [&] {
    Check(Pack(inputs, AsView(batch.mask), into).status(), "in-process Pack");
  });
  rows.push_back({"in-process kernel (packd::Pack)", kernel, kernel});

  // The limits and the C++ client, interleaved call by call so that the
  // machine's drift over the run falls on all of them alike.
  const grpc::ByteBuffer wrapped = ToByteBuffer(batch.header);
  RawSocketLimit raw_unix(true, request_bytes, response_bytes);
  RawSocketLimit raw_tcp(false, request_bytes, response_bytes);
  NullServer null_unix = StartNullServer(
      absl::StrCat("unix:/tmp/packd-bench-null-", getpid(), ".sock"),
      response_bytes);
  NullServer null_tcp = StartNullServer("127.0.0.1:0", response_bytes);
  const int64_t two = int64_t{16} << 20;
  auto split_unix = ConnectClient(servers.unix_socket->address(), two);
  auto split_tcp = ConnectClient(servers.tcp->address(), two);
  auto one_unix = ConnectClient(servers.unix_socket->address(), 0);
  auto one_tcp = ConnectClient(servers.tcp->address(), 0);
  auto pack = [&](Client* client) {
    return [&batch, client] {
      Check(client->Pack({batch.x}, batch.mask).status(), "Pack (client)");
    };
  };
  const std::vector<double> ms = InterleavedMedianMs(
      repeats,
      {[&] { raw_unix.RoundTrip(); }, [&] { raw_tcp.RoundTrip(); },
       [&] { null_unix.Call(wrapped); }, [&] { null_tcp.Call(wrapped); },
       pack(split_unix.get()), pack(split_tcp.get()), pack(one_unix.get()),
       pack(one_tcp.get())});
  null_unix.server->Shutdown();
  null_tcp.server->Shutdown();
  const Row raw{"raw socket, same bytes (limit)", ms[0], ms[1]};
  const Row null{"zero-copy do-nothing RPC (limit)", ms[2], ms[3]};
  rows.push_back(raw);
  rows.push_back(null);
  rows.push_back({"Pack, C++ client (2 connections)", ms[4], ms[5]});
  rows.push_back({"Pack, C++ client (1 connection)", ms[6], ms[7]});
  Row python{"Pack, Python client"};
  python.unix_ms = PythonPackMs(servers.unix_socket->address(), batch, repeats);
  python.tcp_ms = PythonPackMs(servers.tcp->address(), batch, repeats);
  rows.push_back(python);
  // The generated stub, with a request of bytes fields or of handles.
  auto stub_row = [&](const char* name, const v1::PackRequest& request,
                      int times) {
    Row row{name};
    for (bool unix_socket : {true, false}) {
      auto* stub = unix_socket ? unix_stub.get() : tcp_stub.get();
      (unix_socket ? row.unix_ms : row.tcp_ms) = MedianMs(times, [&] {
        grpc::ClientContext c;
        v1::PackResponse r;
        Check(stub->Pack(&c, request, &r), name);
      });
    }
    rows.push_back(row);
  };
  stub_row("Pack, generated stub (bytes fields)", batch.inline_request, slow);
  stub_row("Pack, shared-memory handles", batch.shm_request, repeats);
  const Row& typed = rows[rows.size() - 2];
  const Row& shm = rows.back();
  if (std::memcmp(batch.segment->data() + x_bytes, touched.data_ptr(),
                  batch.packed_bytes) != 0) {
    Die("the handle path's result differs from the kernel's");
  }
  std::printf(
      "bench_service: x [%lld, %lld, %lld] bf16 (%.1f MiB), prefix mask "
      "density %.2f, %lld active rows (%.1f MiB packed); inline calls move "
      "%.1f MiB up and %.1f MiB back; median of %d (%d for the generated "
      "stub)\n\n",
      (long long)batch.x.size(0), (long long)batch.x.size(1),
      (long long)batch.x.size(2), x_bytes / 1048576.0, density,
      (long long)batch.active, batch.packed_bytes / 1048576.0,
      request_bytes / 1048576.0, response_bytes / 1048576.0, repeats, slow);
  const double moved = static_cast<double>(request_bytes + response_bytes);
  std::printf("%-38s %10s %10s %10s %10s\n", "path", "unix ms", "unix GB/s",
              "tcp ms", "tcp GB/s");
  for (const Row& r : rows) {
    auto cell = [&](double ms) {
      return ms > 0 ? absl::StrFormat("%10.2f %10.2f", ms, moved / (ms * 1e6))
                    : absl::StrFormat("%10s %10s", "-", "-");
    };
    std::printf("%-38s %s %s\n", r.name.c_str(), cell(r.unix_ms).c_str(),
                cell(r.tcp_ms).c_str());
  }
  auto ratio = [](double limit_ms, double ms) {
    return ms > 0 && limit_ms > 0 ? absl::StrFormat("%5.2f", limit_ms / ms)
                                  : std::string("    -");
  };
  const Row& cpp = rows[3];
  std::printf(
      "\nratios (time of the limit / time of the path; 1.0 = at the "
      "limit)                unix    tcp\n");
  std::printf("%-74s %s  %s\n", "Pack C++ / raw socket (target >= 0.5)",
              ratio(raw.unix_ms, cpp.unix_ms).c_str(),
              ratio(raw.tcp_ms, cpp.tcp_ms).c_str());
  std::printf("%-74s %s  %s\n",
              "Pack C++ / zero-copy do-nothing RPC (target >= 0.8)",
              ratio(null.unix_ms, cpp.unix_ms).c_str(),
              ratio(null.tcp_ms, cpp.tcp_ms).c_str());
  std::printf("%-74s %s  %s\n", "Pack Python / Pack C++ (target >= 0.5)",
              ratio(cpp.unix_ms, python.unix_ms).c_str(),
              ratio(cpp.tcp_ms, python.tcp_ms).c_str());
  std::printf("%-74s %s  %s\n",
              "Pack C++ 2 connections / 1 connection (speed-up)",
              ratio(rows[4].unix_ms, cpp.unix_ms).c_str(),
              ratio(rows[4].tcp_ms, cpp.tcp_ms).c_str());
  std::printf("%-74s %s  %s\n", "generated stub / Pack C++ (speed-up)",
              ratio(typed.unix_ms, cpp.unix_ms).c_str(),
              ratio(typed.tcp_ms, cpp.tcp_ms).c_str());
  std::printf("%-74s %s  %s\n", "in-process kernel / shared-memory handles",
              ratio(kernel, shm.unix_ms).c_str(),
              ratio(kernel, shm.tcp_ms).c_str());
  return rows;
}

// Latency of a small inline Pack through the C++ client at several
// concurrencies, against the zero-copy do-nothing RPC carrying the same bytes.
void MeasureSmallCalls(const Servers& servers, bool smoke) {
  const at::Tensor small_x =
      at::randint(-1000, 1000, {4, 128, 64}, at::kFloat).to(at::kBFloat16);
  const at::Tensor small_mask = at::rand({4, 128}) < 0.5;
  Wire<v1::PackRequest> header;
  CarryBatch(small_x, small_mask, &header);
  const grpc::ByteBuffer wrapped = ToByteBuffer(header);
  const int64_t active = small_mask.sum().item<int64_t>();
  const size_t response_bytes = active * 64 * 2 + 64;
  auto client = ConnectClient(servers.tcp->address(), 0);
  Check(client->Pack({small_x}, small_mask).status(), "Pack (small)");
  NullServer null = StartNullServer("127.0.0.1:0", response_bytes);
  const int calls = absl::GetFlag(FLAGS_small_calls);
  std::printf(
      "\nsmall calls over TCP loopback: x [4, 128, 64] bf16, random mask 0.5 "
      "(%zu request bytes, about %zu response bytes), %d calls of each kind "
      "per level, alternating call by call with the do-nothing RPC\n",
      wrapped.Length(), response_bytes, calls);
  std::printf("%12s %12s %12s %14s %14s %10s %10s %12s %12s %8s\n",
              "concurrency", "Pack p50", "Pack p99", "nothing p50",
              "nothing p99", "p50 x", "p99 x", "Pack /s", "nothing /s",
              "/s ratio");
  for (absl::string_view level : absl::StrSplit(
           absl::GetFlag(FLAGS_concurrencies), ',', absl::SkipEmpty())) {
    int c = 1;
    if (!absl::SimpleAtoi(level, &c) || c < 1) continue;
    const int total = smoke ? 2 * c : calls;
    // {p50 ms, p99 ms, calls a second}. The two kinds of call alternate
    // call by call on every thread, so that both see the same machine: its
    // speed moves 2-5x within minutes here. Calls a second with c in flight
    // (Little's law): c / the mean latency of the kind.
    struct Latencies {
      double p50, p99, per_second;
    };
    auto summary = [c](std::vector<double> ms) {
      std::sort(ms.begin(), ms.end());
      double sum = 0;
      for (double m : ms) sum += m;
      return Latencies{ms[ms.size() / 2],
                       ms[std::min(ms.size() - 1, ms.size() * 99 / 100)],
                       c * 1000.0 * ms.size() / sum};
    };
    std::vector<double> pack_ms, nothing_ms;
    {
      std::mutex mu;
      std::vector<std::thread> threads;
      for (int t = 0; t < c; ++t) {
        threads.emplace_back([&, t] {
          std::vector<double> pack_mine, nothing_mine;
          auto timed = [](const std::function<void()>& call,
                          std::vector<double>* into) {
            const auto t0 = std::chrono::steady_clock::now();
            call();
            into->push_back(std::chrono::duration<double, std::milli>(
                                std::chrono::steady_clock::now() - t0)
                                .count());
          };
          for (int i = 0; i < total / c; ++i) {
            // Half the threads start with the do-nothing call, so that at
            // every moment both kinds are in flight.
            const bool pack_first = (i + t) % 2 == 0;
            auto pack = [&] {
              Check(client->Pack({small_x}, small_mask).status(),
                    "Pack (small)");
            };
            auto nothing = [&] { null.Call(wrapped); };
            if (pack_first) timed(pack, &pack_mine);
            timed(nothing, &nothing_mine);
            if (!pack_first) timed(pack, &pack_mine);
          }
          std::lock_guard<std::mutex> lock(mu);
          pack_ms.insert(pack_ms.end(), pack_mine.begin(), pack_mine.end());
          nothing_ms.insert(nothing_ms.end(), nothing_mine.begin(),
                            nothing_mine.end());
        });
      }
      for (auto& thread : threads) thread.join();
    }
    const Latencies pack = summary(std::move(pack_ms));
    const Latencies nothing = summary(std::move(nothing_ms));
    std::printf(
        "%12d %10.3fms %10.3fms %12.3fms %12.3fms %10.2f %10.2f %12.0f %12.0f "
        "%8.2f\n",
        c, pack.p50, pack.p99, nothing.p50, nothing.p99, pack.p50 / nothing.p50,
        pack.p99 / nothing.p99, pack.per_second, nothing.per_second,
        pack.per_second / nothing.per_second);
  }
  null.server->Shutdown();
}

// Peak resident memory (VmHWM) of a packd process that served `concurrent`
// inline Packs of the batch at once, each through its own client; 0 when the
// binary could not be started.
int64_t PackdPeakRssBytes(const LargeBatch& batch, int concurrent,
                          const std::string& flag) {
  const std::string socket =
      absl::StrCat("/tmp/packd-bench-rss-", getpid(), ".sock");
  const std::string listen = absl::StrCat("--listen=unix:", socket);
  const std::string binary = absl::GetFlag(FLAGS_packd);
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the benchmark
    freopen("/dev/null", "w", stdout);
    freopen("/dev/null", "w", stderr);
    std::vector<std::string> args = {binary, listen};
    for (absl::string_view f : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
      args.emplace_back(f);
    }
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  int64_t peak = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  bool ready = false;
  while (!ready && absl::Now() < deadline) {
    auto probe = ConnectClient(absl::StrCat("unix:", socket), 0);
    ready = access(socket.c_str(), F_OK) == 0 && probe->Health("").ok();
    if (!ready) absl::SleepFor(absl::Milliseconds(20));
  }
  if (ready) {
    std::vector<std::thread> threads;
    for (int i = 0; i < concurrent; ++i) {
      threads.emplace_back([&] {
        auto client =
            ConnectClient(absl::StrCat("unix:", socket), int64_t{16} << 20);
        Check(client->Pack({batch.x}, batch.mask).status(), "Pack (rss)");
      });
    }
    for (auto& t : threads) t.join();
    std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
    std::string line;
    while (std::getline(status, line)) {
      if (absl::StartsWith(line, "VmHWM:")) {
        int64_t kb = 0;
        absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::StripSuffix(
                             absl::StripPrefix(line, "VmHWM:"), "kB")),
                         &kb);
        peak = kb * 1024;
      }
    }
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  unlink(socket.c_str());
  return peak;
}

void WriteJson(const std::string& path, const LargeBatch& batch, double density,
               const std::vector<Row>& rows) {
  std::ofstream f(path);
  f << "[\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    f << absl::StrFormat(
        "  {\"path\": \"%s\", \"B\": %d, \"S\": %d, \"hidden\": %d, "
        "\"density\": %g, \"active_rows\": %d, \"unix_median_ms\": %.4f, "
        "\"tcp_median_ms\": %.4f}%s\n",
        rows[i].name, batch.x.size(0), batch.x.size(1), batch.x.size(2),
        density, batch.active, rows[i].unix_ms, rows[i].tcp_ms,
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

  absl::StatusOr<LargeBatch> batch = MakeLargeBatch(B, S, H, density);
  Check(batch.status(), "make the batch");
  if (absl::GetFlag(FLAGS_rss_only)) {
    for (const std::string& flag : std::vector<std::string>(
             absl::StrSplit(absl::GetFlag(FLAGS_packd_flags), ' '))) {
      std::printf(
          "'%s': %.2f GiB\n", flag.c_str(),
          PackdPeakRssBytes(*batch, absl::GetFlag(FLAGS_rss_calls), flag) /
              1073741824.0);
    }
    return 0;
  }
  Servers servers = StartServers();
  if (absl::GetFlag(FLAGS_small_only)) {
    MeasureSmallCalls(servers, smoke);
    return 0;
  }
  const std::vector<Row> rows =
      MeasureLargeCalls(*batch, servers, density, repeats);
  MeasureSmallCalls(servers, smoke);
  const int concurrent = smoke ? 2 : absl::GetFlag(FLAGS_rss_calls);
  if (concurrent > 0) {
    std::printf(
        "\npeak resident memory of a packd process serving %d inline "
        "calls at once (target: no more than about 0.9 GiB):\n",
        concurrent);
    for (const char* flag :
         {"--keep_freed_memory=true", "--keep_freed_memory=false"}) {
      const absl::Time start = absl::Now();
      const double gib = PackdPeakRssBytes(*batch, concurrent, flag) /
                         static_cast<double>(1 << 30);
      std::printf("  %-36s %8.2f GiB  (%.1f s for the calls)\n", flag, gib,
                  absl::ToDoubleSeconds(absl::Now() - start));
    }
  }
  if (!absl::GetFlag(FLAGS_json).empty()) {
    WriteJson(absl::GetFlag(FLAGS_json), *batch, density, rows);
  }
  for (auto* server : {servers.tcp.get(), servers.unix_socket.get()}) {
    server->Drain();
    server->Wait();
  }
  return 0;
}

}  // namespace
}  // namespace packd

int main(int argc, char** argv) { return packd::Main(argc, argv); }
