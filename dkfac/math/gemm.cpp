#include "dkfac/math/gemm.h"

#include <ATen/Parallel.h>

#include <dlfcn.h>

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

// Below this many multiply-adds a product is not worth splitting.
constexpr double kMinSplitWork = 4e6;

// Runs fn(0) ... fn(tasks - 1), spread over this thread and LibTorch's inter-op pool (at::launch).
// The caller claims tasks too and waits only for tasks a pool thread has claimed, so it never waits for
// a pool that is busy (or that it runs on). at::parallel_for would need this file built with OpenMP, and a
// second OpenMP runtime next to the one of a pip LibTorch.
// Threads of the BLAS library itself, or 1 when it cannot be asked. OpenBLAS is found among the libraries
// already loaded (the Python extension is loaded RTLD_LOCAL, so a global dlsym would not see it).
int blas_threads() {
  using GetThreads = int (*)();
  static const GetThreads get = [] {
    for (const char* name : {"libopenblas.so.0", "libblas.so.3", "libopenblas.so"}) {
      if (void* handle = ::dlopen(name, RTLD_NOW | RTLD_NOLOAD)) {
        if (auto* f = reinterpret_cast<GetThreads>(::dlsym(handle, "openblas_get_num_threads"))) return f;
      }
    }
    return reinterpret_cast<GetThreads>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  }();
  return get != nullptr ? std::max(1, get()) : 1;
}

// Tasks to split a product into: LibTorch's threads when each BLAS call runs on one thread; one when BLAS
// is itself multi-threaded (splitting then would run threads x BLAS threads on the cores: in a Python
// process, where OpenBLAS keeps its default of one thread per core, that made preconditioning slower).
int split_threads() { return blas_threads() > 1 ? 1 : at::get_num_threads(); }

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
  } else {
    m.copy_(m.triu() + m.triu(1).t());
  }
}

torch::Tensor gram(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "gram expects a 2-D tensor, got shape ", x.sizes());
  const int64_t n = x.size(0);
  const int64_t d = x.size(1);
  const int threads = split_threads();
  if (!x.is_cpu() || d < 128 || static_cast<double>(n) * d * d < kMinSplitWork) {
    // Too narrow or too small for the block triangle to pay; parallel_mm still spreads a large narrow
    // product (many rows, d < 128) over the threads, and leaves small ones to torch::mm.
    auto c = parallel_mm(x.t(), x);
    return torch::add(c, c.t()).mul_(0.5);
  }
  // Row block b of the output covers rows [s_b, s_{b+1}) and columns [s_b, d); its work is proportional
  // to the trapezoid's area, equal for every block when (d - s_b)^2 = d^2 (1 - b / blocks).
  const int64_t blocks = std::max(4, 2 * threads);
  std::vector<int64_t> start(blocks + 1);
  for (int64_t b = 0; b <= blocks; ++b) {
    start[b] = static_cast<int64_t>(std::llround(d * (1.0 - std::sqrt(1.0 - static_cast<double>(b) / blocks))));
  }
  start[blocks] = d;
  auto out = torch::empty({d, d}, x.options());
  const auto xt = x.t();
  run_tasks(blocks, threads - 1, [&](int64_t b) {
    const int64_t s = start[b];
    const int64_t e = start[b + 1];
    if (e <= s) return;
    auto target = out.slice(0, s, e).slice(1, s, d);
    torch::mm_out(target, xt.slice(0, s, e), x.slice(1, s, d));
  });
  mirror_upper(out, threads);
  return out;
}

torch::Tensor parallel_mm(const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "mm expects [m, k] @ [k, n], got ",
              a.sizes(), " and ", b.sizes());
  const int64_t m = a.size(0);
  const int threads = split_threads();
  const double work = static_cast<double>(m) * a.size(1) * b.size(1);
  if (!a.is_cpu() || threads < 2 || m < 2 * threads || work < kMinSplitWork) return torch::mm(a, b);
  auto out = torch::empty({m, b.size(1)}, a.options());
  const int64_t rows = (m + threads - 1) / threads;
  run_tasks(threads, threads - 1, [&](int64_t t) {
    const int64_t s = t * rows;
    const int64_t e = std::min(m, s + rows);
    if (e <= s) return;
    auto target = out.slice(0, s, e);
    torch::mm_out(target, a.slice(0, s, e), b);
  });
  return out;
}

}  // namespace dkfac::math
