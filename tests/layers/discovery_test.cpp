// dkfac/layers/discovery.h: the one rule set both front ends register layers by.
#include "dkfac/layers/discovery.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace dkfac {
namespace {

using Warnings = testing::CapturedWarnings;

const std::vector<ModuleCandidate> kModel = {
    {"stem", "Conv2d", LayerKind::kConv2d, true, 1},
    {"depthwise", "Conv2d", LayerKind::kConv2d, true, 8},       // grouped: plain gradient, warned
    {"frozen", "Linear", LayerKind::kLinear, false, 1},         // frozen: silently left alone
    {"attn.out_proj", "NonDynamicallyQuantizableLinear", LayerKind::kLinear, true, 1},
    {"head", "Linear", LayerKind::kLinear, true, 1},
};

TEST(ChooseLayers, FrozenAndGroupedAreLeftAloneAndPatternsSearchNameKindAndClass) {
  Warnings warnings;
  EXPECT_EQ(choose_layers(kModel, {}, "Net"), (std::vector<size_t>{0, 3, 4}));
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_EQ(warnings.messages[0], "dkfac: layer 'depthwise' is a grouped Conv2d (groups=8); it keeps its plain gradient");

  Warnings by_kind;
  EXPECT_EQ(choose_layers(kModel, {"^Linear$"}, "Net"), (std::vector<size_t>{0})) << "the kind of a subclass too";
  Warnings by_class;
  EXPECT_EQ(choose_layers(kModel, {"Quantizable"}, "Net"), (std::vector<size_t>{0, 4}));
  Warnings by_name;
  EXPECT_EQ(choose_layers(kModel, {"^stem$", "out_"}, "Net"), (std::vector<size_t>{4}));
}

TEST(ChooseLayers, UnmatchedPatternIsWarnedListingTheCandidatesAndNoneLeftIsAnError) {
  Warnings warnings;
  EXPECT_EQ(choose_layers(kModel, {"Embedding"}, "Net").size(), 3u);
  ASSERT_EQ(warnings.messages.size(), 2u);  // the grouped conv, then the pattern
  EXPECT_EQ(warnings.messages[1],
            "dkfac: skip_layers pattern 'Embedding' matches no layer, so it skips nothing; patterns are searched "
            "(ECMAScript regular expressions) in these layer names, kinds and classes: 'stem' (Conv2d), "
            "'attn.out_proj' (NonDynamicallyQuantizableLinear), 'head' (Linear)");
  testing::expect_error<c10::Error>([] { choose_layers(kModel, {"."}, "Net"); },
                                    {"found no Linear, Conv2d or Embedding layer to precondition in Net"});
  testing::expect_error<c10::Error>([] { choose_layers(kModel, {"("}, "Net"); },
                                    {"skip_layers pattern '(' is not a valid regular expression"});
}

}  // namespace
}  // namespace dkfac
