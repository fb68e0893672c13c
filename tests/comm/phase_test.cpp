// Communication phases: the names traffic(), the metrics and the Python front end report.
#include "dkfac/comm/communicator.h"

#include <algorithm>

#include <gtest/gtest.h>

namespace dkfac::comm {
namespace {

TEST(Purpose, NamesAreTheReportedOnes) {
  EXPECT_EQ(Communicator::all_phase_names(),
            (std::vector<std::string>{"data_parallel", "factors", "second_order", "gradients", "calibration", "setup",
                                      "finite-check", "control"}));
}

// Every enumerator of Purpose (every value to_string names; it throws for the others) is in all_purposes(), so
// that per-phase summaries list a phase added later.
TEST(Purpose, EveryEnumeratorIsListed) {
  const auto& listed = Communicator::all_purposes();
  size_t named = 0;
  for (int value = 0; value < 256; ++value) {
    const auto phase = static_cast<Purpose>(value);
    try {
      (void)to_string(phase);
    } catch (const c10::Error&) {
      continue;
    }
    ++named;
    EXPECT_NE(std::find(listed.begin(), listed.end(), phase), listed.end())
        << "Purpose " << value << " (" << to_string(phase) << ") is missing from Communicator::all_purposes()";
  }
  EXPECT_EQ(named, listed.size()) << "all_purposes() lists a value twice or one to_string does not name";
}

}  // namespace
}  // namespace dkfac::comm
