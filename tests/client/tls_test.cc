// Transport security against the real packd: TLS, mutual TLS and bearer
// tokens, with certificates made at test time (tests/support/
// make_test_certs.sh), and health on --health_listen reachable without any
// of them.
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shm_mapping.h"
#include "gtest/gtest.h"
#include "tests/e2e/server_process.h"
#include "tests/kernels/test_util.h"

#ifndef PACKD_MAKE_TEST_CERTS
#error "PACKD_MAKE_TEST_CERTS must name tests/support/make_test_certs.sh"
#endif

namespace packd {
namespace {

using testing::ServerProcess;

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char dir[] = "/tmp/packd-certs-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    certs_ = new std::string(dir);
    ASSERT_EQ(
        std::system(absl::StrCat(PACKD_MAKE_TEST_CERTS, " ", dir, " >/dev/null")
                        .c_str()),
        0);
  }
  static void TearDownTestSuite() {
    std::system(absl::StrCat("rm -rf ", *certs_).c_str());
    delete certs_;
  }

  static std::string Cert(const std::string& name) {
    return absl::StrCat(*certs_, "/", name);
  }

  // A server on a unix socket speaking TLS, health alone on a second socket.
  static std::unique_ptr<ServerProcess> Start(bool mutual,
                                              const std::string& extra = "") {
    std::vector<std::string> flags = {"--tls_cert_file=" + Cert("server.pem"),
                                      "--tls_key_file=" + Cert("server.key"),
                                      "--health_listen=unix:{dir}/health.sock"};
    if (mutual) flags.push_back("--tls_client_ca_file=" + Cert("ca.pem"));
    if (!extra.empty()) flags.push_back(extra);
    return ServerProcess::Start(flags);
  }

  // A Pack through a client with `options` (address filled in): its status,
  // and the bytes checked when it succeeds.
  static absl::Status PackThrough(const ServerProcess& server,
                                  ClientOptions options) {
    options.address = server.address();
    options.tls_server_name = "localhost";
    options.max_attempts = 1;
    options.deadline = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(std::move(options));
    if (!client.ok()) return client.status();
    testing::Rng rng = testing::Rng::Fresh();
    const at::Tensor mask =
        testing::RandomMask(rng, DType::kBool, 3, 50, 0.5, MaskPattern::kHoles);
    const at::Tensor x =
        testing::RandomTensor(rng, DType::kBFloat16, {3, 50, 8});
    absl::StatusOr<PackedBatch> r = (*client)->Pack({x}, mask);
    if (!r.ok()) return r.status();
    EXPECT_TRUE(
        testing::SameBytes(testing::ReferencePack(x, mask), r->packed[0]));
    return absl::OkStatus();
  }

  static ClientOptions Trusting(const std::string& ca) {
    ClientOptions options;
    options.tls_ca_file = Cert(ca);
    return options;
  }

  static std::string HealthOn(const std::string& address,
                              const std::string& service) {
    return testing::HealthStatus(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()),
        service);
  }

  static std::string* certs_;
};

std::string* TlsTest::certs_ = nullptr;

TEST_F(TlsTest, TlsServesTrustingClientsOnly) {
  auto server = Start(/*mutual=*/false);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(PackThrough(*server, Trusting("ca.pem")).ok());
  // A plaintext client, and one that trusts another CA, get no connection.
  EXPECT_EQ(PackThrough(*server, ClientOptions()).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(PackThrough(*server, Trusting("other-ca.pem")).code(),
            absl::StatusCode::kUnavailable);
  // Health: plaintext on --health_listen, liveness and readiness, and
  // nothing else there.
  const std::string health =
      absl::StrCat("unix:", server->dir(), "/health.sock");
  EXPECT_EQ(HealthOn(health, ""), "SERVING");
  EXPECT_EQ(HealthOn(health, "packd.v1.PackService"), "SERVING");
  EXPECT_NE(HealthOn(health, "no.such.Service"), "SERVING");
  auto stub = v1::PackService::NewStub(
      grpc::CreateChannel(health, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::ServerInfo info;
  EXPECT_EQ(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info)
                .error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  // Draining: readiness goes NOT_SERVING on the health listener too.
  server->Signal(SIGTERM);
  EXPECT_EQ(server->Wait(), 0);
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificate) {
  auto server = Start(/*mutual=*/true);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(PackThrough(*server, Trusting("ca.pem")).code(),
            absl::StatusCode::kUnavailable);
  ClientOptions with_cert = Trusting("ca.pem");
  with_cert.tls_cert_file = Cert("client.pem");
  with_cert.tls_key_file = Cert("client.key");
  EXPECT_TRUE(PackThrough(*server, with_cert).ok());
  // A certificate with another certificate's key proves nothing.
  ClientOptions mismatched = Trusting("ca.pem");
  mismatched.tls_cert_file = Cert("client.pem");
  mismatched.tls_key_file = Cert("server.key");
  EXPECT_FALSE(PackThrough(*server, mismatched).ok());
  EXPECT_EQ(HealthOn(absl::StrCat("unix:", server->dir(), "/health.sock"),
                     "packd.v1.PackService"),
            "SERVING");
}

// Under mutual TLS each client certificate's subject is a tenant
// (docs/design.md §15): B, with another certificate, cannot see, read,
// unregister or name the key of A's region.
TEST_F(TlsTest, EachClientCertificateIsATenant) {
  auto server = Start(/*mutual=*/true, "--shared_memory=on");
  ASSERT_NE(server, nullptr);
  auto connect = [&](const std::string& cert) {
    ClientOptions options = Trusting("ca.pem");
    options.address = server->address();
    options.tls_server_name = "localhost";
    options.tls_cert_file = Cert(cert + ".pem");
    options.tls_key_file = Cert(cert + ".key");
    return Client::Connect(std::move(options)).value();
  };
  std::unique_ptr<Client> a = connect("client"), b = connect("client-b");
  const std::string prefix_a = a->connection().Info()->shm_key_prefix();
  const std::string prefix_b = b->connection().Info()->shm_key_prefix();
  EXPECT_EQ(prefix_a.rfind("/packdcert-", 0), 0u) << prefix_a;
  EXPECT_EQ(prefix_b.rfind("/packdcert-", 0), 0u) << prefix_b;
  EXPECT_NE(prefix_a, prefix_b);

  std::unique_ptr<ShmMapping> seg =
      ShmMapping::Create(ShmMapping::UniqueKey(prefix_a), 4096).value();
  const std::string key = seg->key();
  std::memset(seg->data(), 0xA5, 4096);
  ASSERT_TRUE(a->connection().RegisterSegment(*seg, "A-secret").ok());

  auto list = [](Client& c) {
    grpc::ClientContext context;
    v1::ListRegionsResponse response;
    EXPECT_TRUE(c.stub().ListRegions(&context, {}, &response).ok());
    std::vector<std::string> names;
    for (const auto& r : response.regions()) names.push_back(r.name());
    return names;
  };
  EXPECT_TRUE(list(*b).empty());
  EXPECT_EQ(list(*a), std::vector<std::string>{"A-secret"});
  EXPECT_EQ(b->connection().UnregisterRegion("A-secret").code(),
            absl::StatusCode::kNotFound);
  v1::PackRequest read;
  read.mutable_mask()->set_dtype(v1::DTYPE_BOOL);
  read.mutable_mask()->add_shape(1);
  read.mutable_mask()->add_shape(4);
  read.mutable_mask()->set_data(std::string(4, '\1'));
  v1::Tensor* x = read.add_inputs();
  x->set_dtype(v1::DTYPE_UINT8);
  x->add_shape(1);
  x->add_shape(4);
  x->mutable_region()->set_region("A-secret");
  x->mutable_region()->set_byte_size(4);
  auto pack = [&](Client& c, v1::PackResponse* response) {
    grpc::ClientContext context;
    return c.stub().Pack(&context, read, response);
  };
  v1::PackResponse response;
  EXPECT_EQ(pack(*b, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::RegisterSystemRegionRequest steal;
  steal.set_name("stolen");
  steal.set_key(key);
  steal.set_byte_size(4096);
  grpc::ClientContext context;
  v1::RegisterRegionResponse registered;
  const grpc::Status denied =
      b->stub().RegisterSystemRegion(&context, steal, &registered);
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(denied.error_message().find(prefix_b), std::string::npos);
  // A's region is as it was.
  ASSERT_TRUE(pack(*a, &response).ok());
  EXPECT_EQ(response.packed(0).data(), std::string(4, '\xA5'));
}

TEST_F(TlsTest, TokensOverMutualTlsAndHealthWithoutEither) {
  const std::string tokens = Cert("tokens");
  std::ofstream(tokens) << "tls-token\n";
  auto server = Start(/*mutual=*/true, "--auth_token_file=" + tokens);
  ASSERT_NE(server, nullptr);
  ClientOptions options = Trusting("ca.pem");
  options.tls_cert_file = Cert("client.pem");
  options.tls_key_file = Cert("client.key");
  options.token_env = "";
  EXPECT_EQ(PackThrough(*server, options).code(),
            absl::StatusCode::kUnauthenticated);
  options.token_file = tokens;
  EXPECT_TRUE(PackThrough(*server, options).ok());
  EXPECT_EQ(HealthOn(absl::StrCat("unix:", server->dir(), "/health.sock"), ""),
            "SERVING");
}

TEST_F(TlsTest, BadTlsFlagsAndOptionsAreClearErrors) {
  ClientOptions options;
  options.tls_cert_file = Cert("client.pem");
  EXPECT_EQ(Client::Connect(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.tls_ca_file = Cert("missing.pem");
  options.tls_key_file = Cert("client.key");
  EXPECT_EQ(Client::Connect(options).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The server refuses to start on half a TLS configuration.
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(ServerProcess::Start({"--tls_cert_file=" + Cert("server.pem")}),
            nullptr);
  EXPECT_EQ(ServerProcess::Start({"--tls_client_ca_file=" + Cert("ca.pem")}),
            nullptr);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("--tls_cert_file and --tls_key_file go together"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("--tls_client_ca_file needs TLS"), std::string::npos)
      << log;
}

}  // namespace
}  // namespace packd
