// dkfac/options.h: every option is declared once (DKFAC_OPTIONS); the table, the setters and the checks by name
// that the Python front end and `dkfac train` use all come from that declaration.
#include "dkfac/options.h"

#include <fstream>
#include <limits>
#include <regex>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace dkfac {
namespace {

const OptionInfo& info(const std::string& name) { return option_info(name); }

// Every declared option, whatever is added: declared once, documented, reachable by name (get and set, which
// Python's keywords and `dkfac train`'s flags go through) with its declared default, and a numeric value outside
// its declared range is refused naming the option and the range. (docs/OPTIONS.md's table, Python's keywords and the
// command line's flags are checked against the same table: below, tests/python/test_messages.py,
// tests/tools/train_flags_test.cpp.)
TEST(OptionTable, EveryOptionIsReachableByNameWithItsDefaultAndRefusesOutOfRange) {
  std::set<std::string> names;
  for (const auto& o : option_table()) {
    EXPECT_TRUE(names.insert(o.name).second) << o.name << " declared twice";
    EXPECT_FALSE(o.doc.empty()) << o.name;
    const Options defaults;
    EXPECT_EQ(option_text(o, defaults.get(o.name)), o.default_text.empty() ? "none" : o.default_text) << o.name;
    EXPECT_NO_THROW(Options().set(o.name, defaults.get(o.name))) << o.name << ": its own default is refused";
    if ((o.type != OptionType::kInt && o.type != OptionType::kDouble) || o.range.min <= -1e308) continue;
    const double below = o.range.min - 1;
    const OptionValue bad = o.type == OptionType::kInt ? OptionValue(static_cast<int64_t>(below)) : OptionValue(below);
    try {
      Options().set(o.name, bad);
      ADD_FAILURE() << o.name << " accepted " << below << " outside " << o.range.describe();
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find(o.name), std::string::npos) << message;
      EXPECT_NE(message.find(o.range.describe()), std::string::npos) << message;
    }
  }
  EXPECT_EQ(info("damping").default_text, "0.001");
  EXPECT_EQ(info("damping").range.describe(), "> 0");
  EXPECT_TRUE(info("damping").schedule);
  EXPECT_EQ(info("damping").flag, "--damping");
  EXPECT_EQ(info("compute_method").choices, (std::vector<std::string>{"eigen", "inverse"}));
  EXPECT_EQ(info("factor_dtype").choices, (std::vector<std::string>{"float32", "float64", "bfloat16", "float16"}));
  EXPECT_EQ(info("inv_dtype").default_text, "none");
  EXPECT_EQ(info("inv_dtype").kfac_pytorch_default, "float32");
  EXPECT_EQ(info("large_factor_dim").default_text, "4096");
  EXPECT_EQ(info("lr").flag, "") << "the training loop sets it";
}

// The builder's setters take any value; validate() (the Preconditioner's construction, make_step_plan) checks every
// number against its declaration. pad_widths, second_order_concurrency and auto_recheck_steps were left out: pad
// widths 0 failed at the first step (a division by zero in the time model's padded_width: SIGFPE).
TEST(OptionTable, ValidateChecksEveryNumbersRange) {
  using testing::expect_error;
  expect_error<c10::Error>([] { Options().pad_widths(0).validate(); }, {"pad_widths must be >= 1, got 0"});
  expect_error<c10::Error>([] { Options().second_order_concurrency(-4).validate(); },
                           {"second_order_concurrency must be >= 0, got -4"});
  expect_error<c10::Error>([] { Options().auto_recheck_steps(-5).validate(); },
                           {"auto_recheck_steps must be >= 0, got -5"});
  EXPECT_NO_THROW(Options().validate());
}

// Integers past int64's range (9.2e18) were cast to INT64_MIN, and a double past 2^53 rounded: an integer given as
// one is kept as it is, and a number (or a schedule's value) outside the range is refused naming the option.
TEST(OptionTable, IntegersKeepTheirValueAndRefuseWhatInt64CannotHold) {
  using testing::expect_error;
  const int64_t most = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(std::get<int64_t>(Options().set("factor_update_steps", most).get("factor_update_steps")), most);
  const int64_t odd = (int64_t{1} << 53) + 1;
  EXPECT_EQ(std::get<int64_t>(Options().set("large_factor_dim", odd).get("large_factor_dim")), odd);
  expect_error<c10::Error>([] { Options().set("large_factor_dim", 1e300); },
                           {"large_factor_dim must be an integer of at most 2^63 - 1 in size, got 1e+300"});
  const auto huge = Options().set("factor_update_steps", std::function<double(int64_t)>([](int64_t) { return 1e30; }));
  expect_error<c10::Error>([&] { huge.factor_update_steps_at(3); },
                           {"factor_update_steps must be an integer of at most 2^63 - 1 in size, got 1e+30 at step 3"});
}

TEST(OptionTable, KfacPytorchNamesAreAliases) {
  EXPECT_EQ(info("symmetry_aware").name, "symmetric_comm");
  EXPECT_EQ(info("assignment_strategy").name, "balance");
  EXPECT_EQ(Options().set("symmetry_aware", true).symmetric_comm(), true);
  EXPECT_EQ(Options().set("assignment_strategy", std::string("memory")).balance(), assign::Balance::kMemory);
}

TEST(OptionTable, SetByNameConvertsAndChecksAgainstTheDeclaration) {
  Options o;
  o.set("damping", 0.01).set("factor_update_steps", int64_t{10}).set("compute_method", std::string("inverse"));
  o.set("factor_dtype", std::string("bfloat16")).set("skip_layers", std::string("fc1"));
  o.set("large_factor_dim", int64_t{0}).set("spd_fusion", std::vector<int64_t>{4, 2}).set("spd_redundant_dim", int64_t{64});
  EXPECT_EQ(o.damping_at(3), 0.01);
  EXPECT_TRUE(o.damping().is_constant()) << "a number set by name is a constant schedule, checked at construction";
  EXPECT_EQ(o.factor_update_steps_at(0), 10);
  EXPECT_EQ(o.compute_method(), ComputeMethod::kInverse);
  EXPECT_EQ(o.factor_dtype(), c10::kBFloat16);
  EXPECT_EQ(o.skip_layers(), std::vector<std::string>{"fc1"});
  EXPECT_EQ(o.large_factor_dim(), 0);
  EXPECT_EQ(o.spd().fusion(), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(o.spd().redundant_dim(), 64);
  EXPECT_EQ(Options().set("damping", int64_t{1}).damping_at(0), 1.0) << "an integer is a number";
  EXPECT_EQ(Options().set("grad_worker_fraction", std::string("mem-opt")).grad_worker_fraction(), 0.0);
  EXPECT_EQ(Options().set("grad_worker_fraction", std::string("HYBRID_OPT")).grad_worker_fraction(), 0.5);
  EXPECT_EQ(Options().set("kl_clip", std::monostate()).kl_clip_at(0), 0.0) << "none turns clipping off";
  EXPECT_EQ(Options().set("factor_dtype", std::monostate()).factor_dtype(), std::nullopt);
  EXPECT_EQ(Options().set("inv_update_steps", std::string("100")).inv_update_steps_at(0), 100) << "text as typed";
  // Strategy auto is no Strategy: the option holds none until the Preconditioner chose one.
  EXPECT_EQ(Options().set("strategy", std::string("auto")).strategy(), kStrategyAuto);
  EXPECT_EQ(Options().set("strategy", std::string("dp")).strategy(), Strategy::kDp);
  EXPECT_EQ(std::get<std::string>(Options().strategy(kStrategyAuto).get("strategy")), "auto");
  EXPECT_STREQ(to_string(Options().strategy(kStrategyAuto).strategy()), "auto");
  EXPECT_STREQ(to_string(Options().strategy()), "kaisa");
  Options().strategy(kStrategyAuto).memory_budget(1).validate();
  testing::expect_error<c10::Error>([] { Options().strategy(Strategy::kKaisa).memory_budget(1).validate(); },
                                    {"memory_budget applies to strategy auto only (kaisa"});
  // Schedules: a function of the step; an integer schedule's values must be whole.
  auto scheduled = Options().set("damping", std::function<double(int64_t)>([](int64_t s) { return 0.1 / (s + 1); }));
  EXPECT_DOUBLE_EQ(scheduled.damping_at(4), 0.02);
  auto halves = Options().set("inv_update_steps", std::function<double(int64_t)>([](int64_t) { return 2.5; }));
  testing::expect_error<c10::Error>([&] { halves.inv_update_steps_at(3); }, {"inv_update_steps must be an integer, got 2.5 at step 3"});

  using testing::expect_error;
  expect_error<c10::Error>([] { Options().set("damping", 0.0); }, {"damping must be finite and > 0, got 0"});
  expect_error<c10::Error>([] { Options().set("damping", 0.0, "--kfac-damping"); }, {"--kfac-damping must be finite and > 0"});
  expect_error<c10::Error>([] { Options().set("damping", true); }, {"damping must be a number, got true"});
  expect_error<c10::Error>([] { Options().set("factor_decay", 1.5); }, {"factor_decay must be finite and in [0, 1], got 1.5"});
  expect_error<c10::Error>([] { Options().set("large_factor_dim", 2.5); }, {"large_factor_dim must be an integer, got 2.5"});
  expect_error<c10::Error>([] { Options().set("large_factor_dim", int64_t{-1}); }, {"large_factor_dim must be >= 0, got -1"});
  expect_error<c10::Error>([] { Options().set("compute_method", std::string("svd")); },
                           {"compute_method must be one of eigen, inverse, got 'svd'"});
  expect_error<c10::Error>([] { Options().set("strategy", std::string("horovod")); },
                           {"strategy must be one of kaisa, spd, dp, auto, got 'horovod'"});
  expect_error<c10::Error>([] { Options().set("factor_dtype", std::string("int32")); },
                           {"factor_dtype must be one of float32, float64, bfloat16, float16 or none"});
  expect_error<c10::Error>([] { Options().set("grad_worker_fraction", std::string("most")); },
                           {"grad_worker_fraction must be a number or one of comm-opt, hybrid-opt, mem-opt"});
  expect_error<c10::Error>([] { Options().set("pi_damping", int64_t{1}); }, {"pi_damping must be true or false"});
  expect_error<c10::Error>([] { Options().set("spd_fusion", std::vector<int64_t>{2, 0}); },
                           {"spd_fusion entries must be >= 1, got 0"});
  expect_error<c10::Error>([] { Options().set("dampening", 0.1); }, {"unknown option 'dampening'", "damping", "spd_fusion"});
}

TEST(OptionTable, DescribeAndGetShowEveryOption) {
  const auto o = Options().damping(0.003).strategy(Strategy::kSpd).skip_layers({"fc1", "conv"});
  const auto text = o.describe();
  for (const auto& i : option_table()) EXPECT_NE(text.find(i.name + "="), std::string::npos) << i.name;
  EXPECT_NE(text.find("damping=0.003"), std::string::npos) << text;
  EXPECT_NE(text.find("strategy=spd"), std::string::npos) << text;
  EXPECT_NE(text.find("skip_layers=[fc1, conv]"), std::string::npos) << text;
  EXPECT_NE(text.find("factor_dtype=none"), std::string::npos) << text;
  EXPECT_NE(Options().lr([](int64_t) { return 0.1; }).describe().find("lr=(a function of the step)"), std::string::npos);
  EXPECT_EQ(std::get<double>(o.get("damping")), 0.003);
}

// docs/OPTIONS.md's option table lists every option with its default and, where it has them, its flag and
// kfac_pytorch keyword, as option_table() declares them.
TEST(OptionTable, ReadmeTableIsTheDeclaration) {
  std::ifstream in(std::string(DKFAC_SOURCE_DIR) + "/docs/OPTIONS.md");
  ASSERT_TRUE(in) << "docs/OPTIONS.md not found";
  std::stringstream text;
  text << in.rdbuf();
  const std::string readme = text.str();
  // | `name` | default | `--flag` | `alias` | doc |
  const std::regex row(R"(\n\| `(\w+)` \| `([^`]*)` \| ([^|]*) \| ([^|]*) \|)");
  std::map<std::string, std::vector<std::string>> rows;
  for (auto it = std::sregex_iterator(readme.begin(), readme.end(), row); it != std::sregex_iterator(); ++it) {
    rows[(*it)[1]] = {(*it)[2], (*it)[3], (*it)[4]};
  }
  auto cell = [](const std::string& value) { return value.empty() ? std::string("") : "`" + value + "`"; };
  auto trim = [](std::string s) {
    s.erase(0, s.find_first_not_of(' '));
    s.erase(s.find_last_not_of(' ') + 1);
    return s;
  };
  for (const auto& o : option_table()) {
    ASSERT_EQ(rows.count(o.name), 1u) << "README's option table has no row for " << o.name;
    const auto& r = rows[o.name];
    EXPECT_EQ(r[0], o.default_text) << o.name;
    EXPECT_EQ(trim(r[1]), cell(o.flag)) << o.name;
    EXPECT_EQ(trim(r[2]), cell(o.alias)) << o.name;
  }
  EXPECT_EQ(rows.size(), option_table().size()) << "README lists an option the code does not declare";
}

}  // namespace
}  // namespace dkfac
