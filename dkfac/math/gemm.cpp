#include "dkfac/math/gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace dkfac::math {
namespace {

// Below this many multiply-adds the block triangle of gram() is not worth its extra calls.
constexpr double kMinTriangleWork = 4e6;
// Row blocks of gram()'s upper triangle: the triangle costs (1 + 1/blocks) / 2 of the full product.
constexpr int64_t kTriangleBlocks = 4;
// On a GPU the block triangle pays for wide factors: measured on an H200 (bench/kernel_probe.py, float32, 4096
// rows; docs/PERFORMANCE.md), 4096 wide: 2.39 ms against 2.69 for the full product (4097: 2.53 against 2.97),
// while 1024 wide it costs 0.243 ms against 0.196: narrow products already run below the GEMM rate. Widths in
// between were not measured; 2048 is the midpoint (in powers of two) of the two that were.
constexpr int64_t kMinDeviceTriangleDim = 2048;

// Runs fn(0) ... fn(tasks - 1), spread over this thread and LibTorch's inter-op pool (at::launch); used
// for the mirror copy, which calls no BLAS.
// The caller claims tasks too and waits only for tasks a pool thread has claimed, so it never waits for
// a pool that is busy (or that it runs on). at::parallel_for would need this file built with OpenMP, and a
// second OpenMP runtime next to the one of a pip LibTorch.
void run_tasks(int64_t tasks, int helpers, const std::function<void(int64_t)>& fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::mutex mutex;
    std::condition_variable done_cv;
    int64_t done = 0;
    std::exception_ptr error;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, tasks](const std::function<void(int64_t)>& body) {
    for (int64_t t; (t = shared->next.fetch_add(1)) < tasks;) {
      std::exception_ptr error;
      try {
        body(t);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(shared->mutex);
      if (error && !shared->error) shared->error = error;
      if (++shared->done == tasks) shared->done_cv.notify_all();
    }
  };
  // `fn` lives on the caller's stack: a helper that starts after every task was claimed never calls it.
  for (int h = 0; h < helpers; ++h) at::launch([work, &fn] { work(fn); });
  work(fn);
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->done_cv.wait(lock, [&] { return shared->done == tasks; });
  if (shared->error) std::rethrow_exception(shared->error);
}

// Copies the strict upper triangle of the square, contiguous `m` onto its lower triangle, in square
// tiles so that both the rows read and the columns written stay in cache; tile rows are spread over
// threads. A strided copy_ of the transposed blocks was 3x slower than the products it completes when
// the factor is built from few rows (d 4096 from 128 rows).
template <typename T>
void mirror_tiles(T* m, int64_t d, int threads) {
  constexpr int64_t kTile = 32;
  const int64_t tiles = (d + kTile - 1) / kTile;
  run_tasks(tiles, threads - 1, [&](int64_t ti) {
    const int64_t i0 = ti * kTile;
    const int64_t i1 = std::min(d, i0 + kTile);
    for (int64_t j0 = i0; j0 < d; j0 += kTile) {
      const int64_t j1 = std::min(d, j0 + kTile);
      for (int64_t i = i0; i < i1; ++i) {
        const T* row = m + i * d;
        for (int64_t j = std::max(j0, i + 1); j < j1; ++j) m[j * d + i] = row[j];
      }
    }
  });
}

}  // namespace

void mirror_upper(torch::Tensor& m, int threads) {
  TORCH_CHECK(m.dim() == 2 && m.size(0) == m.size(1), "mirror_upper expects a square matrix, got ", m.sizes());
  if (m.is_cpu() && m.is_contiguous() && m.scalar_type() == torch::kFloat32) {
    mirror_tiles(m.data_ptr<float>(), m.size(0), std::max(1, threads));
  } else if (m.is_cpu() && m.is_contiguous() && m.scalar_type() == torch::kFloat64) {
    mirror_tiles(m.data_ptr<double>(), m.size(0), std::max(1, threads));
  } else {  // one temporary of m's size (the strict upper triangle), the same sums as m.triu() + m.triu(1).t()
    m.triu_();
    m.add_(m.triu(1).t());
  }
}

torch::Tensor gram(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "gram expects a 2-D tensor, got shape ", x.sizes());
  const int64_t n = x.size(0);
  const int64_t d = x.size(1);
  const bool small = x.is_cpu() ? d < 128 || static_cast<double>(n) * d * d < kMinTriangleWork
                                 : d < kMinDeviceTriangleDim;
  if (small) {
    // Too narrow or too small for the block triangle to pay.
    auto c = torch::mm(x.t(), x);
    return torch::add(c, c.t()).mul_(0.5);
  }
  // Row block b of the output covers rows [s_b, s_{b+1}) and columns [s_b, d); its work is proportional
  // to the trapezoid's area, equal for every block when (d - s_b)^2 = d^2 (1 - b / blocks). The blocks
  // run one after another: each is a product BLAS spreads over LibTorch's threads itself.
  const int64_t blocks = kTriangleBlocks;
  std::vector<int64_t> start(blocks + 1);
  for (int64_t b = 0; b <= blocks; ++b) {
    start[b] = static_cast<int64_t>(std::llround(d * (1.0 - std::sqrt(1.0 - static_cast<double>(b) / blocks))));
  }
  start[blocks] = d;
  auto out = torch::empty({d, d}, x.options());
  const auto xt = x.t();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t s = start[b];
    const int64_t e = start[b + 1];
    if (e <= s) continue;
    auto target = out.slice(0, s, e).slice(1, s, d);
    torch::mm_out(target, xt.slice(0, s, e), x.slice(1, s, d));
  }
  mirror_upper(out, at::get_num_threads());
  return out;
}

}  // namespace dkfac::math
