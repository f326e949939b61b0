#include "tests/e2e/server_process.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"

#if !defined(PACKD_BINARY) || !defined(PACKD_TESTING_BINARY)
#error "PACKD_BINARY and PACKD_TESTING_BINARY must name the binaries under test"
#endif

namespace packd::testing {

std::unique_ptr<ServerProcess> ServerProcess::Start(
    const std::vector<std::string>& flags, Binary binary) {
  std::unique_ptr<ServerProcess> server(new ServerProcess);
  char dir[] = "/tmp/packd-test-XXXXXX";
  if (mkdtemp(dir) == nullptr) return nullptr;
  server->dir_ = dir;
  server->address_ = absl::StrCat("unix:", dir, "/packd.sock");

  server->args_ = {binary == Binary::kPackd ? PACKD_BINARY
                                            : PACKD_TESTING_BINARY};
  for (std::string flag : flags) {
    for (size_t at; (at = flag.find("{dir}")) != std::string::npos;) {
      flag.replace(at, 5, dir);
    }
    if (absl::StartsWith(flag, "--health_listen=")) {
      server->health_address_ = flag.substr(16);
    }
    if (absl::StartsWith(flag, "--listen=")) {
      server->address_ = flag.substr(9);
      continue;
    }
    server->args_.push_back(std::move(flag));
  }
  server->args_.push_back("--listen=" + server->address_);
  if (server->Launch()) return server;
  return nullptr;
}

bool ServerProcess::Launch() {
  int fds[2];
  if (pipe(fds) != 0) return false;
  std::vector<char*> argv;
  for (std::string& a : args_) argv.push_back(a.data());
  argv.push_back(nullptr);

  exited_ = false;
  pid_ = fork();
  if (pid_ == 0) {
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    close(fds[1]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  const int read_fd = fds[0];
  reader_ = std::thread([this, read_fd] {
    char buf[4096];
    ssize_t n;
    while ((n = read(read_fd, buf, sizeof(buf))) > 0) {
      absl::MutexLock lock(&mu_);
      log_.append(buf, n);
    }
    close(read_fd);
  });
  if (WaitUntilReady(absl::Now() + absl::Seconds(60))) return true;
  std::cerr << "packd did not become ready; its log:\n" << Log() << "\n";
  return false;
}

bool ServerProcess::Alive() {
  if (exited_ || pid_ <= 0) return false;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) != pid_) return true;
  exited_ = true;
  if (reader_.joinable()) reader_.join();
  std::cerr << "packd (pid " << pid_ << ") exited by itself with status "
            << status << "; its log:\n"
            << Log() << "\n";
  return false;
}

bool ServerProcess::Restart() {
  if (!exited_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (reader_.joinable()) reader_.join();
  return Launch();
}

bool ServerProcess::WaitUntilReady(absl::Time deadline) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("packd.v1.PackService");
  int attempts = 0;
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      return false;
    }
    // A channel dialled before the server listens backs off for seconds
    // between attempts: each attempt dials afresh.
    grpc::ChannelArguments args;
    args.SetInt("packd.attempt", ++attempts);
    auto health = grpc::health::v1::Health::NewStub(grpc::CreateCustomChannel(
        health_address_.empty() ? address_ : health_address_,
        grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    grpc::health::v1::HealthCheckResponse response;
    if (health->Check(&context, request, &response).ok() &&
        response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

ServerProcess::~ServerProcess() {
  // Ended by itself, unasked (a crash, a sanitizer report)? Alive() says why.
  if (Alive()) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (reader_.joinable()) reader_.join();
  if (!dir_.empty()) std::filesystem::remove_all(dir_);
}

std::shared_ptr<grpc::Channel> ServerProcess::Channel() const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  return grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(),
                                   args);
}

void ServerProcess::Signal(int signal) { kill(pid_, signal); }

int ServerProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return -1;
}

std::string ServerProcess::Log() const {
  absl::MutexLock lock(&mu_);
  return log_;
}

std::string ServerProcess::LogOnce(absl::string_view text,
                                   absl::Duration timeout) const {
  auto logged = [this, text]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return absl::StrContains(log_, text);
  };
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&logged), timeout);
  return log_;
}

int64_t ProcStatusBytes(pid_t pid, absl::string_view field) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, field)) {
      return std::strtoll(line.c_str() + field.size(), nullptr, 10) * 1024;
    }
  }
  return -1;
}

int UnusedPort() {
  int low = 32768;  // the kernel's default, when /proc does not say
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  // Ports [10000, low); with an ephemeral range that starts lower, any.
  const int first = low > 11000 ? 10000 : 1024;
  const int span = low > 11000 ? std::min(low, 32768) - first : 65535 - first;
  // Start at a place of this process's own, so that tests beside pick apart.
  const int start = static_cast<int>(
      (int64_t{getpid()} * 7919 + absl::ToUnixMicros(absl::Now())) % span);
  for (int i = 0; i < span; ++i) {
    const int port = first + (start + i) % span;
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(port);
    const bool free =
        bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) return port;
  }
  return 0;
}

int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = popen(absl::StrCat(command, " 2>&1").c_str(), "r");
  output->clear();
  if (pipe == nullptr) return -1;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), pipe)) > 0;) {
    output->append(buf, n);
  }
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string PackdCommand(absl::string_view flags) {
  return absl::StrCat(PACKD_BINARY, " ", flags);
}

std::string HealthStatus(const std::shared_ptr<grpc::Channel>& channel,
                         const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    return absl::StrCat("error ", status.error_code(), ": ",
                        status.error_message());
  }
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
      response.status());
}

std::string ServerProcess::MetricsAddress() const {
  const std::string log = LogOnce("metrics on http://");
  const size_t at = log.find("metrics on http://");
  if (at == std::string::npos) return "";
  const size_t begin = at + 18;
  return log.substr(begin, log.find("/metrics", begin) - begin);
}

std::string HttpGet(const std::string& address, const std::string& path) {
  const size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(std::stoi(address.substr(colon + 1)));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "connect failed";
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\n\r\n");
  send(fd, request.data(), request.size(), 0);
  std::string response;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, n);
  close(fd);
  return response;
}

}  // namespace packd::testing
