#include "server/server.h"

#include <fcntl.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <exception>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/buffer.h"
#include "base/status_macros.h"
#include "kernels/registry.h"
#include "kernels/thread_pool.h"
#include "server/log.h"

namespace packd {
namespace {

// Packs a small, known batch through the service path and checks every byte.
absl::Status SelfCheck(ServiceCore& service, const Device& device) {
  v1::PackRequest request;
  request.set_device(device.ToString());
  v1::Tensor* mask = request.mutable_mask();
  mask->set_dtype(v1::DTYPE_BOOL);
  mask->add_shape(2);
  mask->add_shape(3);
  mask->set_data(std::string("\1\0\1\0\0\1", 6));
  v1::Tensor* x = request.add_inputs();
  x->set_dtype(v1::DTYPE_UINT8);
  x->add_shape(2);
  x->add_shape(3);
  x->add_shape(2);
  x->set_data("aAbBcCdDeEfF");
  request.set_with_position_ids(true);
  v1::PackResponse response;
  absl::Status status;
  try {
    status = service.DoPack(request, &response);
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat(
        "self-check pack on ", device.ToString(), " threw: ", e.what()));
  }
  if (!status.ok()) return status;
  if (response.packed_size() != 1 || response.packed(0).data() != "aAcCfF" ||
      response.total_active() != 3 || response.cu_seqlens_size() != 3 ||
      response.cu_seqlens(1) != 2 || response.max_seqlen() != 2 ||
      response.last_index(0) != 2 || response.last_index(1) != 2 ||
      response.position_ids(1) != 1) {
    return absl::InternalError(absl::StrCat(
        "self-check pack on ", device.ToString(),
        " returned a wrong result: ", response.ShortDebugString()));
  }
  return absl::OkStatus();
}

// grpc.health.v1 Check for the health-only listener: liveness ("") always
// SERVING, readiness as `ready` says, other services NOT_FOUND (as gRPC's own
// health service answers). Watch is not offered: probes call Check.
class HealthOnly : public grpc::health::v1::Health::CallbackService {
 public:
  explicit HealthOnly(const std::atomic<bool>* ready) : ready_(ready) {}

  grpc::ServerUnaryReactor* Check(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request,
      grpc::health::v1::HealthCheckResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    using Response = grpc::health::v1::HealthCheckResponse;
    if (request->service().empty()) {
      response->set_status(Response::SERVING);
    } else if (request->service() == kReadinessService) {
      response->set_status(ready_->load() ? Response::SERVING
                                          : Response::NOT_SERVING);
    } else {
      reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                   "unknown service " + request->service()));
      return reactor;
    }
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  const std::atomic<bool>* ready_;
};

// Where a builder listening on `listen` got bound: `port` for HOST:PORT.
std::string BoundAddress(const std::string& listen, int port) {
  if (absl::StartsWith(listen, "unix:")) return listen;
  return absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
}

// Whether a server accepts connections on the unix socket at `path`.
bool UnixSocketAnswers(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool answers =
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return answers;
}

// Starts `builder` listening on `listen` (the flag `flag` in errors), with
// `*bound` the address actually bound. UNAVAILABLE when it cannot listen.
//
// An address another server holds is refused, never shared: by default gRPC
// binds TCP ports with SO_REUSEPORT (a second server on the port would take
// half of the new connections) and replaces the file of a unix socket (the
// first server would be left running, unreachable).
absl::StatusOr<std::unique_ptr<grpc::Server>> Listen(
    grpc::ServerBuilder& builder, const std::string& listen, const char* flag,
    std::shared_ptr<grpc::ServerCredentials> credentials, std::string* bound) {
  absl::string_view path = listen;
  if ((absl::ConsumePrefix(&path, "unix://") ||
       absl::ConsumePrefix(&path, "unix:")) &&
      UnixSocketAnswers(std::string(path))) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", listen, " (", flag,
                     "): another server is listening there"));
  }
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  builder.AddListeningPort(listen, std::move(credentials), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", listen, " (", flag,
                     "): address in use or not valid"));
  }
  *bound = BoundAddress(listen, port);
  return server;
}

std::shared_ptr<grpc::ServerCredentials> Credentials(const TlsOptions& tls) {
  if (tls.cert_chain.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      tls.client_ca.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = tls.client_ca;
  ssl.pem_key_cert_pairs.push_back({tls.private_key, tls.cert_chain});
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

PackdServer::PackdServer(const ServerOptions& options)
    : options_(options),
      service_(
          [&] {
            ServiceOptions service = options.service;
            service.on_device_lost = [this](const absl::Status& reason) {
              OnDeviceLost(reason);
            };
            return service;
          }(),
          [&] {
            RpcOptions rpc = options.rpc;
            // Set before the first connection is accepted, never after.
            rpc.peer_uid = [this](const std::string& peer) {
              return unix_ != nullptr ? unix_->UidOf(peer) : std::nullopt;
            };
            return rpc;
          }()) {}

void PackdServer::OnDeviceLost(const absl::Status& reason) {
  Log(LogLevel::kWarning,
      absl::StrCat("readiness NOT_SERVING: ", reason.message()));
  if (server_ != nullptr) {
    SetReady(false);
  }
}

void PackdServer::SetReady(bool ready) {
  ready_.store(ready);
  server_->GetHealthCheckService()->SetServingStatus(kReadinessService, ready);
}

absl::StatusOr<std::unique_ptr<PackdServer>> PackdServer::Start(
    const ServerOptions& options) {
  if (options.keep_freed_memory) KeepFreedMemoryMapped();
  PACKD_RETURN_IF_ERROR(
      Registry::Runtime(options.service.default_device).status());

  std::unique_ptr<PackdServer> server(new PackdServer(options));
  if (!options.health_listen.empty()) {
    // Built first: the reflection plugin, once initialised below, joins every
    // server built after it, and this one serves health alone.
    grpc::EnableDefaultHealthCheckService(false);
    server->health_service_ = std::make_unique<HealthOnly>(&server->ready_);
    grpc::ServerBuilder health;
    health.RegisterService(server->health_service_.get());
    PACKD_ASSIGN_OR_RETURN(
        server->health_server_,
        Listen(health, options.health_listen, "--health_listen",
               grpc::InsecureServerCredentials(), &server->health_address_));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC refuses messages over its own limit with its own message; set it
  // above ours so that the service can name --max_message_bytes instead.
  const int64_t grpc_limit =
      std::min<int64_t>(INT_MAX, 2 * options.service.max_message_bytes);
  builder.SetMaxReceiveMessageSize(static_cast<int>(grpc_limit));
  builder.SetMaxSendMessageSize(static_cast<int>(grpc_limit));
  // Without bandwidth-delay probing, a stream's receive window stays at
  // HTTP/2's initial 64 KiB until the call asks for its message, which packd
  // does once the memory budget admits the call: requests still waiting stay
  // with their senders.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.RegisterService(&server->service_);
  builder.RegisterCallbackGenericService(server->service_.raw_methods());
  absl::string_view unix_path = options.listen;
  if ((absl::ConsumePrefix(&unix_path, "unix://") ||
       absl::ConsumePrefix(&unix_path, "unix:")) &&
      options.tls.cert_chain.empty()) {
    // packd accepts the socket's connections itself, to know each peer's uid
    // (server/unix_listener.h).
    const std::string path(unix_path);
    if (UnixSocketAnswers(path)) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", options.listen,
                       " (--listen): another server is listening there"));
    }
    server->server_ = builder.BuildAndStart();
    if (server->server_ == nullptr) {
      return absl::UnavailableError("cannot start the gRPC server");
    }
    PACKD_ASSIGN_OR_RETURN(server->unix_, UnixListener::Bind(path));
    server->unix_->Serve(server->server_.get());
    server->address_ = options.listen;
  } else {
    PACKD_ASSIGN_OR_RETURN(server->server_,
                           Listen(builder, options.listen, "--listen",
                                  Credentials(options.tls), &server->address_));
  }
  server->service_.steps().SetAddress(options.advertise_address.empty()
                                          ? server->address_
                                          : options.advertise_address);
  server->SetReady(false);
  absl::Status check =
      SelfCheck(server->service_.core(), options.service.default_device);
  if (!check.ok()) {
    server->server_->Shutdown();
    return check;
  }
  if (!options.metrics_listen.empty()) {
    auto metrics = MetricsServer::Start(options.metrics_listen,
                                        server->service_.metrics());
    if (!metrics.ok()) {
      server->server_->Shutdown();
      return metrics.status();
    }
    server->metrics_ = std::move(*metrics);
  }
  server->SetReady(true);
  return server;
}

void PackdServer::Drain() {
  SetReady(false);
  service_.StartDraining();
  Log(absl::StrCat(
      "draining: readiness NOT_SERVING, new calls UNAVAILABLE, "
      "waiting up to ",
      absl::FormatDuration(options_.drain), " for calls in flight"));
  const bool idle = service_.WaitForIdle(absl::Now() + options_.drain);
  // No new connection from now on; the calls on those accepted still find
  // their peers' uids.
  if (unix_ != nullptr) unix_->StopAccepting();
  if (!idle) {
    Log(LogLevel::kWarning,
        "drain time is up: cancelling the calls still running");
  }
  server_->Shutdown(
      absl::ToChronoTime(absl::Now() + absl::Milliseconds(idle ? 1000 : 100)));
  if (health_server_ != nullptr) health_server_->Shutdown();
}

void PackdServer::Wait() {
  server_->Wait();
  if (health_server_ != nullptr) health_server_->Wait();
}

namespace {

// The start-up line's values for collectors, one field each (those set).
LogFields StartedFields(const PackdServer& server,
                        const ServiceOptions& service) {
  LogFields fields = {
      {"address", server.address()},
      {"device", service.default_device.ToString()},
      {"threads", absl::StrCat(ThreadPool::Global().num_threads())}};
  if (!server.health_address().empty()) {
    fields.emplace_back("health_address", server.health_address());
  }
  if (!server.metrics_address().empty()) {
    fields.emplace_back("metrics_address", server.metrics_address());
  }
  return fields;
}

// The write end of the pipe the shutdown signals' handler writes each
// signal's number to; the signal thread reads the other end.
int signal_pipe = -1;

void OnSignal(int signal) {
  const int saved = errno;
  const unsigned char number = static_cast<unsigned char>(signal);
  // When the pipe is full a signal is already waiting to be read: enough.
  [[maybe_unused]] const ssize_t written = write(signal_pipe, &number, 1);
  errno = saved;
}

}  // namespace

int ServeUntilSignalled(const ServerOptions& options) {
  // The shutdown signals are caught by a handler that hands them to one
  // thread through a pipe, whichever thread the kernel delivers them to:
  // threads that libraries start before main (OpenBLAS's pool, say) do not
  // block them, so a sigwait alone would leave a SIGTERM to kill the process.
  // packd's own threads (gRPC's included, so this comes first) block them, and
  // the signal thread unblocks them, so that it takes them when no other
  // thread would.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);  // re-reads --auth_token_file
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    Log(LogLevel::kError,
        absl::StrCat("cannot start: pipe: ", strerror(errno)));
    return 1;
  }
  signal_pipe = fds[1];
  struct sigaction action {};
  action.sa_handler = OnSignal;
  action.sa_flags = SA_RESTART;
  sigfillset(&action.sa_mask);
  for (int signal : {SIGTERM, SIGINT, SIGHUP})
    sigaction(signal, &action, nullptr);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<PackdServer>> server =
      PackdServer::Start(options);
  if (!server.ok()) {
    Log(LogLevel::kError,
        absl::StrCat("cannot start: ", server.status().ToString()),
        {{"code", absl::StatusCodeToString(server.status().code())}});
    return 1;
  }
  const ServiceOptions& service = options.service;
  Log(LogLevel::kInfo,
      absl::StrCat(
          "listening on ", (*server)->address(),
          options.tls.cert_chain.empty()
              ? " (plaintext)"
              : (options.tls.client_ca.empty() ? " (TLS)" : " (mutual TLS)"),
          (*server)->health_address().empty()
              ? ""
              : absl::StrCat(", health alone on ", (*server)->health_address()),
          ", device ", service.default_device.ToString(), ", ",
          ThreadPool::Global().num_threads(), " threads, messages up to ",
          service.max_message_bytes, " bytes, inline calls in flight up to ",
          service.max_inflight_bytes > 0
              ? absl::StrCat(service.max_inflight_bytes, " bytes")
              : std::string("any size"),
          ", shared memory ",
          service.regions.enabled
              ? absl::StrCat("on (keys under ", service.regions.key_prefix, ")")
              : "off",
          (*server)->metrics_address().empty()
              ? ""
              : absl::StrCat(", metrics on http://",
                             (*server)->metrics_address(), "/metrics"),
          options.rpc.auth != nullptr
              ? absl::StrCat(", bearer tokens from ", options.rpc.auth->path())
              : ""),
      StartedFields(**server, service));

  std::thread signal_thread([&] {
    pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
    // The next signal's number from the handler, waiting for it.
    auto next = [read_end = fds[0]]() {
      for (;;) {
        pollfd ready{read_end, POLLIN, 0};
        poll(&ready, 1, -1);
        unsigned char number = 0;
        if (read(read_end, &number, 1) == 1) return static_cast<int>(number);
      }
    };
    int signal = 0;
    while ((signal = next()) == SIGHUP) {
      if (options.rpc.auth == nullptr) {
        Log("received Hangup: nothing to reload");
        continue;
      }
      const absl::Status reloaded = options.rpc.auth->Reload();
      Log(reloaded.ok() ? LogLevel::kInfo : LogLevel::kWarning,
          reloaded.ok() ? absl::StrCat("received Hangup: tokens reloaded from ",
                                       options.rpc.auth->path())
                        : absl::StrCat("received Hangup: ", reloaded.message(),
                                       "; the previous tokens stay"));
    }
    Log(absl::StrCat("received ", strsignal(signal)));
    (*server)->Drain();
  });
  (*server)->Wait();
  signal_thread.join();
  Log("stopped");
  return 0;
}

}  // namespace packd
