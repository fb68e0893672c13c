// Communication phases: the names traffic(), the metrics and the Python front end report.
#include "dkfac/comm/communicator.h"

#include <gtest/gtest.h>

namespace dkfac::comm {
namespace {

TEST(Phase, NamesAreTheReportedOnes) {
  EXPECT_EQ(Communicator::all_phase_names(),
            (std::vector<std::string>{"data_parallel", "factors", "second_order", "gradients", "calibration", "setup",
                                      "finite-check", "control"}));
  ASSERT_EQ(Communicator::all_phases().size(), Communicator::all_phase_names().size());
  for (const Phase phase : Communicator::all_phases()) {
    EXPECT_EQ(phase_from_string(to_string(phase)), phase) << to_string(phase);
  }
}

TEST(Phase, UnknownNameIsAnErrorListingTheKnownOnes) {
  try {
    phase_from_string("factor");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("'factor' (known: data_parallel, factors,"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace
}  // namespace dkfac::comm
