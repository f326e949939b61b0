#include "tests/e2e/server_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"

#ifndef PACKD_BINARY
#error "PACKD_BINARY must name the packd binary under test"
#endif

namespace packd::testing {

std::unique_ptr<ServerProcess> ServerProcess::Start(
    const std::vector<std::string>& flags) {
  int fds[2];
  if (pipe(fds) != 0) return nullptr;
  std::vector<std::string> args = {PACKD_BINARY, "--listen=127.0.0.1:0"};
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  std::unique_ptr<ServerProcess> server(new ServerProcess);
  server->pid_ = fork();
  if (server->pid_ == 0) {
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    close(fds[1]);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  const int read_fd = fds[0];
  ServerProcess* s = server.get();
  s->reader_ = std::thread([s, read_fd] {
    char buf[4096];
    ssize_t n;
    while ((n = read(read_fd, buf, sizeof(buf))) > 0) {
      absl::MutexLock lock(&s->mu_);
      s->log_.append(buf, n);
    }
    close(read_fd);
  });

  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    {
      absl::MutexLock lock(&s->mu_);
      const size_t at = s->log_.find("listening on ");
      if (at != std::string::npos) {
        const size_t begin = at + 13;
        const size_t end = s->log_.find(',', begin);
        if (end != std::string::npos) {
          s->address_ = s->log_.substr(begin, end - begin);
          return server;
        }
      }
    }
    int status = 0;
    if (waitpid(s->pid_, &status, WNOHANG) == s->pid_) {
      s->exited_ = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::cerr << "packd did not start; its log:\n" << s->Log() << "\n";
  return nullptr;
}

ServerProcess::~ServerProcess() {
  if (!exited_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (reader_.joinable()) reader_.join();
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

}  // namespace packd::testing
