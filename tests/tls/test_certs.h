// Certificates for TLS tests, made fresh by openssl (make_certs.sh) into the
// test's temporary directory. Not thread-safe.
#ifndef TE_TESTS_TLS_TEST_CERTS_H_
#define TE_TESTS_TLS_TEST_CERTS_H_

#include <string>

#include "absl/status/statusor.h"

namespace te::testing {

struct TestCerts {
  std::string dir;
  // A file of the set ("ca.pem", "server.key", ... see make_certs.sh): its path.
  std::string Path(const std::string& name) const { return dir + "/" + name; }
  // Its content; empty if it cannot be read.
  std::string Read(const std::string& name) const;
};

// Runs make_certs.sh into a new directory under $TEST_TMPDIR. UNAVAILABLE if
// openssl fails (the message carries its exit status).
absl::StatusOr<TestCerts> MakeTestCerts();

}  // namespace te::testing

#endif  // TE_TESTS_TLS_TEST_CERTS_H_
