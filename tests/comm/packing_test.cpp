// The wire layout of K-FAC tensors (comm/packing.h): triangles, fused buffers, buckets.
#include "dkfac/comm/packing.h"

#include <gtest/gtest.h>

namespace dkfac::comm {
namespace {

TEST(BucketGroups, PacksInReadyOrderUpToTheCap) {
  EXPECT_EQ(bucket_groups({10, 10, 10, 10}, 25), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(bucket_groups({10, 30, 5, 5}, 25), (std::vector<int64_t>{1, 1, 2})) << "too big: alone";
  EXPECT_EQ(bucket_groups({1, 2, 3}, 0), (std::vector<int64_t>{1, 1, 1})) << "cap 0: each alone";
  EXPECT_EQ(bucket_groups({1, 2, 3}, 1 << 20), (std::vector<int64_t>{3}));
  EXPECT_TRUE(bucket_groups({}, 10).empty());
}

TEST(TrianglePacking, RoundTrip) {
  auto m = torch::randn({5, 5}, torch::kFloat64);
  m = m + m.t();
  auto packed = pack_upper(m);
  EXPECT_EQ(packed.numel(), 15);
  EXPECT_TRUE(torch::equal(unpack_upper(packed, 5), m));
}

// The row copies against the gather by triu_indices they replace (row-major upper triangle), for both
// dtypes, sizes around the mirror's 32 x 32 tiles, and a transposed (non-contiguous) input.
TEST(TrianglePacking, MatchesTriuIndicesOrder) {
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (int64_t n : {1, 2, 31, 33, 70}) {
      SCOPED_TRACE(c10::str(dtype, " n ", n));
      auto m = torch::randn({n, n}, dtype);
      m = m + m.t();
      const auto idx = torch::triu_indices(n, n);
      const auto expected = m.index({idx[0], idx[1]});
      EXPECT_TRUE(torch::equal(pack_upper(m), expected));
      EXPECT_TRUE(torch::equal(pack_upper(m.t()), expected));
      EXPECT_TRUE(torch::equal(unpack_upper(expected, n), m));
    }
  }
  EXPECT_THROW(unpack_upper(torch::zeros({5}), 3), c10::Error);
}

TEST(SymmetricPacking, TriangleOrFlatRoundTrip) {
  auto m = torch::randn({4, 4}, torch::kFloat32);
  m = m + m.t();
  EXPECT_EQ(packed_length(4, true), 10);
  EXPECT_EQ(packed_length(4, false), 16);
  EXPECT_TRUE(torch::equal(pack_symmetric(m, true), pack_upper(m)));
  EXPECT_TRUE(torch::equal(pack_symmetric(m, false), m.view(-1)));
  for (bool triangle : {true, false}) {
    EXPECT_TRUE(torch::equal(unpack_symmetric(pack_symmetric(m, triangle), 4, triangle), m)) << triangle;
  }
}

TEST(Fuse, ConcatenatesInOrderAndSendsASingleTensorAsItself) {
  auto a = torch::arange(3, torch::kFloat64);
  auto b = torch::arange(3, 5, torch::kFloat64);
  EXPECT_TRUE(torch::equal(fuse({a, b}), torch::arange(5, torch::kFloat64)));
  EXPECT_TRUE(fuse({a}).is_same(a));
}

}  // namespace
}  // namespace dkfac::comm
