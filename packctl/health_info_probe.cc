// packctl health, info and probe: what an operator or a Kubernetes probe asks.
#include <cstdio>

#include "absl/strings/str_format.h"
#include "packctl/packctl.h"

namespace packd::packctl {

int Health(Connection& connection) {
  absl::StatusOr<std::string> live = connection.Health("");
  if (!live.ok()) return Fail(kRpcError, live.status().ToString());
  absl::StatusOr<std::string> ready = connection.Health("packd.v1.PackService");
  if (!ready.ok()) return Fail(kRpcError, ready.status().ToString());
  std::printf(
      "liveness  (\"\"):                   %s\nreadiness "
      "(packd.v1.PackService): %s\n",
      live->c_str(), ready->c_str());
  return *ready == "SERVING" ? kOk : kCheckFailed;
}

int Info(Connection& connection) {
  absl::StatusOr<v1::ServerInfo> info = connection.Info();
  if (!info.ok()) return Fail(kRpcError, info.status().ToString());
  std::printf(
      "version:          %s\ndefault device:   %s\nmax message:      %llu "
      "bytes\n"
      "shared memory:    %s (your key prefix: %s)\ndevices:\n",
      info->version().c_str(), info->default_device().c_str(),
      static_cast<unsigned long long>(info->max_message_bytes()),
      info->shared_memory_enabled() ? "on" : "off",
      info->shm_key_prefix().c_str());
  for (const v1::DeviceInfo& d : info->devices()) {
    const std::string memory =
        d.memory_bytes() > 0
            ? absl::StrFormat("%.1f GiB", d.memory_bytes() / 1073741824.0)
            : "";
    std::printf("  %-10s %-5s %-10s %s\n", d.name().c_str(), d.kind().c_str(),
                memory.c_str(), d.uuid().c_str());
  }
  return kOk;
}

int Probe(Connection& connection, double max_latency_ms) {
  Batch batch;  // x = 0..15 as float32 [2, 4, 2]
  batch.dtype = DType::kFloat32;
  batch.shape = {2, 4, 2};
  batch.mask = {1, 1, 0, 1, 0, 0, 1, 1};
  for (int i = 0; i < 16; ++i) {
    const float v = static_cast<float>(i);
    const char* p = reinterpret_cast<const char*>(&v);
    batch.x.insert(batch.x.end(), p, p + sizeof(v));
  }
  absl::StatusOr<PackResult> r = PackInline(connection, batch, false);
  if (!r.ok()) return Fail(kRpcError, r.status().ToString());
  if (r->packed != batch.Packed() || r->reply->total_active() != 5) {
    return Fail(kCheckFailed, "probe: the server returned a wrong result");
  }
  if (r->ms > max_latency_ms) {
    return Fail(kCheckFailed,
                absl::StrFormat("probe: %.2f ms is over --max_latency_ms=%g",
                                r->ms, max_latency_ms));
  }
  std::printf("probe ok: %.2f ms\n", r->ms);
  return kOk;
}

}  // namespace packd::packctl
