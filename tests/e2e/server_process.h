// ServerProcess: the real packd binary (or packd_testing, packd with the
// tests' hooks), started on a unix socket in a fresh directory for a test,
// ready once grpc.health.v1 answers SERVING, with its log captured; and
// helpers to call it.
//
//   auto server = ServerProcess::Start({"--max_message_bytes=1048576"});
//   auto stub = packd::v1::PackService::NewStub(server->Channel());
#ifndef PACKD_TESTS_E2E_SERVER_PROCESS_H_
#define PACKD_TESTS_E2E_SERVER_PROCESS_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace packd::testing {

class ServerProcess {
 public:
  enum class Binary { kPackd, kTesting };

  // Starts PACKD_BINARY (or PACKD_TESTING_BINARY) with --listen=unix:... (or
  // the --listen among `flags`) and `flags`, and waits (up to 60 s) until its
  // readiness is SERVING (asked on
  // --health_listen when a flag sets it). "{dir}" in a flag stands for the
  // server's own fresh directory. Returns null, with the log printed, if it
  // exits or is never ready.
  static std::unique_ptr<ServerProcess> Start(
      const std::vector<std::string>& flags = {},
      Binary binary = Binary::kPackd);
  ~ServerProcess();

  const std::string& address() const { return address_; }
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }
  // A channel that sends and receives messages up to 1 GiB.
  std::shared_ptr<grpc::Channel> Channel() const;

  void Signal(int signal);
  // Whether the process is still running (false once it has exited, by
  // itself or asked).
  bool Alive();
  // Kills the process with SIGKILL and starts it again, on the same address
  // with the same flags; true once it is ready.
  bool Restart();
  // Waits for the process to exit (up to `timeout`) and returns its exit code,
  // or -1 if it was killed by a signal or did not exit in time.
  int Wait(absl::Duration timeout = absl::Seconds(60));
  // Everything the server has logged so far.
  std::string Log() const;
  // The log, once it holds `text` (packd logs its start-up line just after it
  // turns ready) or `timeout` has passed.
  std::string LogOnce(absl::string_view text,
                      absl::Duration timeout = absl::Seconds(10)) const;
  // "HOST:PORT" of the metrics endpoint of a server started with
  // --metrics_listen, from its log; empty when it has none.
  std::string MetricsAddress() const;

 private:
  ServerProcess() = default;

  // Starts the process with args_ and waits until it is ready.
  bool Launch();
  // Polls readiness until SERVING, the process exits, or `deadline`.
  bool WaitUntilReady(absl::Time deadline);

  pid_t pid_ = -1;
  bool exited_ = false;
  std::string dir_;
  std::string address_;
  std::string health_address_;  // readiness is asked here when set
  std::vector<std::string> args_;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string log_ ABSL_GUARDED_BY(mu_);
};

// A loopback port nothing listens on (now), below the kernel's ephemeral
// range: no other process is given it while a test's server restarts on it
// (bind to port 0 and connect() take ports from that range).
int UnusedPort();

// GET `path` from the HTTP endpoint at "HOST:PORT"; the whole response.
std::string HttpGet(const std::string& address, const std::string& path);

// Runs `command` in a shell with stderr joined to stdout, which it leaves in
// `*output`; its exit code, or -1 if it did not exit normally.
int RunCommand(const std::string& command, std::string* output);

// The shell command that runs the packd binary under test with `flags`.
std::string PackdCommand(absl::string_view flags);

// A size from /proc/PID/status ("VmRSS:", "VmHWM:", "RssAnon:"), in bytes;
// -1 when the process or the field is missing.
int64_t ProcStatusBytes(pid_t pid, absl::string_view field);

// grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... or the RPC's error text.
std::string HealthStatus(const std::shared_ptr<grpc::Channel>& channel,
                         const std::string& service);

}  // namespace packd::testing

#endif  // PACKD_TESTS_E2E_SERVER_PROCESS_H_
