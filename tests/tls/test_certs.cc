#include "tests/tls/test_certs.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "tests/runfiles.h"

namespace te::testing {
namespace {

std::string ScriptPath() { return RunfilePath("tests/tls/make_certs.sh"); }

}  // namespace

std::string TestCerts::Read(const std::string& name) const {
  std::ifstream in(Path(name), std::ios::binary);
  std::stringstream content;
  content << in.rdbuf();
  return content.str();
}

absl::StatusOr<TestCerts> MakeTestCerts() {
  static int made = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  TestCerts certs;
  certs.dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/certs_", getpid(), "_", made++);
  const std::string command = absl::StrCat("bash '", ScriptPath(), "' '", certs.dir, "'");
  const int status = std::system(command.c_str());
  if (status != 0) {
    return absl::UnavailableError(
        absl::StrCat(command, " failed: wait status ", status, " (is openssl installed?)"));
  }
  return certs;
}

}  // namespace te::testing
