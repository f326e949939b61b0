#include "client/connection.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/buffer.h"
#include "base/status_macros.h"
#include "base/tsan.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/grpc_wire.h"
#include "proto/tensor_codec.h"

namespace packd {
namespace {

// The contents of `path` (option `what`): FAILED_PRECONDITION when it cannot
// be read or is empty.
absl::StatusOr<std::string> ReadFile(const std::string& path,
                                     const char* what) {
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) text.clear();
  if (text.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read ", what, " ", path));
  }
  return text;
}

// The bearer token the options name: the first non-blank line of token_file,
// else the environment variable token_env; empty: none.
absl::StatusOr<std::string> ReadToken(const ClientOptions& options) {
  std::string token;
  if (!options.token_file.empty()) {
    std::ifstream file(options.token_file);
    std::string line;
    while (file && token.empty() && std::getline(file, line)) {
      token = std::string(absl::StripAsciiWhitespace(line));
    }
    if (token.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot read a token from ", options.token_file));
    }
  } else if (!options.token_env.empty()) {
    if (const char* value = std::getenv(options.token_env.c_str())) {
      token = std::string(absl::StripAsciiWhitespace(value));
    }
  }
  return token;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(
    const ClientOptions& options) {
  if (options.tls_ca_file.empty()) {
    if (!options.tls_cert_file.empty()) {
      return absl::InvalidArgumentError(
          "a client certificate needs TLS: give tls_ca_file too");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  PACKD_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                         ReadFile(options.tls_ca_file, "tls_ca_file"));
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert_file and tls_key_file go together");
  }
  if (!options.tls_cert_file.empty()) {
    PACKD_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                           ReadFile(options.tls_cert_file, "tls_cert_file"));
    PACKD_ASSIGN_OR_RETURN(ssl.pem_private_key,
                           ReadFile(options.tls_key_file, "tls_key_file"));
  }
  return grpc::SslCredentials(ssl);
}

// UNAVAILABLE: the server is draining, restarting or unreachable. CANCELLED:
// this client cancels nothing, so a call was cancelled by a server going away
// (gRPC cancels the calls that reach a server while it shuts down, before a
// handler sees them: grpc/grpc#41785). Every packd call may be repeated.
bool IsRetried(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE ||
         code == grpc::StatusCode::CANCELLED;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Connection>> Connection::Open(
    ClientOptions options) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError(
        "address is empty: give HOST:PORT or unix:PATH");
  }
  PACKD_ASSIGN_OR_RETURN(std::string token, ReadToken(options));
  PACKD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                         Credentials(options));
  if (options.keep_freed_memory) KeepFreedMemoryMapped();
  return std::unique_ptr<Connection>(
      new Connection(std::move(options), std::move(token), credentials));
}

Connection::Connection(
    ClientOptions options, std::string token,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials)
    : options_(std::move(options)), token_(std::move(token)) {
  for (int i = 0; i < std::max(options_.connections, 1); ++i) {
    grpc::ChannelArguments args;
    const int limit = static_cast<int>(
        std::min<int64_t>(options_.max_message_bytes, INT32_MAX));
    args.SetMaxReceiveMessageSize(limit);
    args.SetMaxSendMessageSize(limit);
    // Channels with different arguments do not share a connection.
    args.SetInt("packd.connection", i);
    if (!options_.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options_.tls_server_name);
    }
    std::string policy = options_.load_balancing_policy;
    if (policy.empty() && absl::StartsWith(options_.address, "dns:")) {
      policy = "round_robin";
    }
    if (!policy.empty()) args.SetLoadBalancingPolicyName(policy);
    // Reconnect as often as calls are retried: gRPC's own backoff (1 s,
    // growing to 2 min) would leave a restarted server unreached while the
    // retries run out.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                static_cast<int>(absl::ToInt64Milliseconds(std::max(
                    options_.initial_backoff, absl::Milliseconds(1)))));
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                static_cast<int>(absl::ToInt64Milliseconds(
                    std::max(options_.max_backoff, absl::Milliseconds(1)))));
    channels_.push_back(
        options_.interceptors
            ? grpc::experimental::CreateCustomChannelWithInterceptors(
                  options_.address, credentials, args, options_.interceptors())
            : grpc::CreateCustomChannel(options_.address, credentials, args));
    generic_.push_back(std::make_unique<grpc::GenericStub>(channels_.back()));
  }
  stub_ = v1::PackService::NewStub(channels_[0]);
}

absl::Status Connection::Call(
    const std::function<grpc::Status(grpc::ClientContext*)>& rpc,
    const std::function<bool()>& may_retry, CallTimes times) {
  const absl::Time deadline =
      absl::Now() +
      (times.total > absl::ZeroDuration() ? times.total : options_.deadline);
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext context;
    const absl::Time own = std::min(deadline, absl::Now() + times.attempt);
    context.set_deadline(absl::ToChronoTime(own));
    if (!token_.empty())
      context.AddMetadata("authorization", "Bearer " + token_);
    const grpc::Status status = rpc(&context);
    const bool expired_early =
        status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
        own < deadline;
    if (!(IsRetried(status.error_code()) || expired_early) ||
        attempt >= options_.max_attempts || absl::Now() + backoff >= deadline ||
        (may_retry && !may_retry())) {
      return FromGrpcStatus(status);
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

absl::Status Connection::RawCall(int connection, const char* method,
                                 const WireMessage& request,
                                 WireMessage* response, CallTimes times) {
  const grpc::ByteBuffer sent = ToByteBuffer(request);
  grpc::ByteBuffer received;
  PACKD_RETURN_IF_ERROR(Call(
      [&](grpc::ClientContext* context) {
        absl::Notification done;
        grpc::Status status;
        received.Clear();
        context->AddMetadata(kRequestBytesHeader,
                             std::to_string(sent.Length()));
        HandOff(&done);
        generic_[connection % generic_.size()]->UnaryCall(
            context, method, grpc::StubOptions(), &sent, &received,
            [&](grpc::Status s) {
              TakeOver(&done);
              status = std::move(s);
              done.Notify();
            });
        done.WaitForNotification();
        return status;
      },
      nullptr, times));
  const absl::Status parsed = Receive(received, response);
  if (!parsed.ok()) {
    return absl::InternalError(
        absl::StrCat("the server's reply: ", parsed.message()));
  }
  return absl::OkStatus();
}

absl::Status Connection::RawStream(
    const char* method, const WireMessage& request,
    const std::function<absl::Status(const grpc::ByteBuffer&)>& on_message,
    CallTimes times) {
  const grpc::ByteBuffer sent = ToByteBuffer(request);
  bool delivered = false;
  absl::Status refused;  // what on_message answered, when it failed
  absl::Status status = Call(
      [&](grpc::ClientContext* context) {
        context->AddMetadata(kRequestBytesHeader,
                             std::to_string(sent.Length()));
        // One completion queue for the call's own operations, one at a time.
        grpc::CompletionQueue cq;
        std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
            generic_[0]->PrepareCall(context, method, &cq);
        auto wait = [&cq] {
          void* tag = nullptr;
          bool ok = false;
          return cq.Next(&tag, &ok) && ok;
        };
        call->StartCall(nullptr);
        if (wait()) {
          call->Write(sent, nullptr);
          if (wait()) {
            call->WritesDone(nullptr);
            wait();
          }
        }
        while (true) {
          grpc::ByteBuffer message;
          call->Read(&message, nullptr);
          if (!wait()) break;
          delivered = true;
          if (refused.ok()) refused = on_message(message);
          if (!refused.ok()) context->TryCancel();
        }
        grpc::Status finished;
        call->Finish(&finished, nullptr);
        wait();
        cq.Shutdown();
        void* tag = nullptr;
        bool ok = false;
        while (cq.Next(&tag, &ok)) {
        }
        return finished;
      },
      [&] { return !delivered; }, times);
  return refused.ok() ? status : refused;
}

absl::StatusOr<v1::ServerInfo> Connection::Info() {
  v1::ServerInfo info;
  PACKD_RETURN_IF_ERROR(Call([&](grpc::ClientContext* c) {
    return stub_->GetServerInfo(c, v1::GetServerInfoRequest(), &info);
  }));
  return info;
}

absl::StatusOr<std::string> Connection::Health(const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channels_[0]);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  PACKD_RETURN_IF_ERROR(Call([&](grpc::ClientContext* c) {
    return health->Check(c, request, &response);
  }));
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
      response.status());
}

absl::StatusOr<v1::PlanResponse> Connection::Plan(
    const v1::PlanRequest& request) {
  v1::PlanResponse response;
  PACKD_RETURN_IF_ERROR(Call([&](grpc::ClientContext* c) {
    return stub_->PlanMicroBatches(c, request, &response);
  }));
  return response;
}

Connection::SegmentName Connection::NewSegmentName(absl::string_view tag) {
  std::optional<std::string> known;
  {
    absl::MutexLock lock(&mu_);
    known = key_prefix_;
  }
  if (!known.has_value()) {
    // A server without tenants (or an older one) says nothing: the option.
    absl::StatusOr<v1::ServerInfo> info = Info();
    known = info.ok() && !info->shm_key_prefix().empty()
                ? info->shm_key_prefix()
                : options_.shm_key_prefix;
    if (info.ok()) {
      absl::MutexLock lock(&mu_);
      key_prefix_ = known;
    }
  }
  const std::string prefix = absl::StrCat(*known, "_", tag, "_");
  SegmentName name;
  name.key = ShmMapping::UniqueKey(prefix.substr(0, prefix.size() - 1));
  name.region = absl::StrCat(tag, "-", name.key.substr(prefix.size()));
  return name;
}

absl::Status Connection::RegisterSegment(ShmMapping& segment,
                                         const std::string& region) {
  v1::RegisterSystemRegionRequest request;
  request.set_name(region);
  request.set_key(segment.key());
  request.set_byte_size(static_cast<uint64_t>(segment.size()));
  request.set_lease_seconds(options_.lease_seconds);
  v1::RegisterRegionResponse response;
  PACKD_RETURN_IF_ERROR(Call([&](grpc::ClientContext* c) {
    return stub_->RegisterSystemRegion(c, request, &response);
  }));
  segment.Unlink();
  return absl::OkStatus();
}

absl::Status Connection::UnregisterRegion(const std::string& name) {
  v1::UnregisterRegionRequest request;
  request.set_name(name);
  v1::UnregisterRegionResponse response;
  return Call([&](grpc::ClientContext* c) {
    return stub_->UnregisterRegion(c, request, &response);
  });
}

std::string Connection::LoadBalancingPolicy() const {
  return channels_[0]->GetLoadBalancingPolicyName();
}

}  // namespace packd
