#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

namespace dkfac::testing {

/// The device that device-parametrised tests run their K-FAC work on: DKFAC_TEST_DEVICE, "cpu" (default) or
/// "cuda" (cuda:0; ctest's gpu label sets it). References stay on the CPU.
inline c10::Device test_device() {
  const char* name = std::getenv("DKFAC_TEST_DEVICE");
  if (name == nullptr || std::string(name) == "cpu") return c10::Device(c10::kCPU);
  if (std::string(name) == "cuda") return c10::Device(c10::kCUDA, 0);
  ADD_FAILURE() << "DKFAC_TEST_DEVICE must be cpu or cuda, got '" << name << "'";
  return c10::Device(c10::kCPU);
}

/// True when DKFAC_TEST_DIAG (a comma-separated list) names `knob`: switches for diagnosing a failure on a
/// machine lent for minutes (scripts/gpu_diagnose.sh), read by the distributed test harness.
inline bool diagnostic(const std::string& knob) {
  const char* list = std::getenv("DKFAC_TEST_DIAG");
  if (list == nullptr) return false;
  const std::string all = "," + std::string(list) + ",";
  return all.find("," + knob + ",") != std::string::npos;
}

/// CUDA math as exact as the CPU's, for tests that compare CUDA results with a float32/float64 reference or
/// with another CUDA run: no TF32 in cuBLAS or cuDNN (torch 2.11 leaves cuDNN's on for float32 convolutions,
/// about 5e-4 relative), no reduced-precision float16/bfloat16 reductions in cuBLAS, and deterministic
/// algorithms (cuBLAS's needs CUBLAS_WORKSPACE_CONFIG before its first handle; ops without a deterministic
/// kernel warn rather than fail). Each ctest case runs in its own process, so this holds for the whole test.
inline void exact_cuda_math() {
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  auto& context = at::globalContext();
  context.setAllowTF32CuBLAS(false);
  context.setAllowTF32CuDNN(false);
  context.setAllowFP16ReductionCuBLAS(false);
  context.setAllowBF16ReductionCuBLAS(false);
  context.setDeterministicCuDNN(true);
  context.setBenchmarkCuDNN(false);
  context.setDeterministicAlgorithms(true, /*warn_only=*/true);
}

/// Skips the current test, with the reason, when it should run on a CUDA device and none is visible; on a
/// CUDA device, makes its math exact (exact_cuda_math).
#define DKFAC_SKIP_WITHOUT_TEST_DEVICE()                                                                     \
  if (::dkfac::testing::test_device().is_cuda() && !torch::cuda::is_available())                            \
    GTEST_SKIP() << "no CUDA device visible (DKFAC_TEST_DEVICE=cuda): this GPU test runs on a GPU machine, " \
                    "see scripts/gpu_check.sh";                                                              \
  if (::dkfac::testing::test_device().is_cuda()) ::dkfac::testing::exact_cuda_math()

/// Skips the current CUDA-only test (tests/gpu/), with the reason, without a CUDA device; with one, makes its math
/// exact (exact_cuda_math).
#define DKFAC_REQUIRE_CUDA()                                                                                    \
  if (!torch::cuda::is_available())                                                                            \
    GTEST_SKIP() << "no CUDA device visible: this GPU test runs on a GPU machine (scripts/gpu_check.sh)";      \
  ::dkfac::testing::exact_cuda_math()

/// The lock seeded_float64 holds: one for every Net type, since torch::manual_seed is the process's.
inline std::mutex& seeding_mutex() {
  static std::mutex mutex;
  return mutex;
}

/// A fresh `Net` (default-constructed) with the weights torch::manual_seed(`seed`) draws, in float64. Ranks of
/// tests/multi_rank.h are threads: every seeding holds one lock, so that no two draws interleave.
template <class Net>
std::shared_ptr<Net> seeded_float64(uint64_t seed) {
  std::lock_guard<std::mutex> lock(seeding_mutex());
  torch::manual_seed(seed);
  auto net = std::make_shared<Net>();
  net->to(torch::kFloat64);
  return net;
}

/// Collects TORCH_WARN messages while alive (the handler in place before it is restored at the end).
class CapturedWarnings : public c10::WarningHandler {
 public:
  CapturedWarnings() : guard_(this) {}
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  /// Every message, one per line (for failure messages).
  std::string all() const {
    std::string out;
    for (const auto& m : messages) out += m + "\n";
    return out;
  }
  std::vector<std::string> messages;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};

/// A fresh directory for the running test, named after it, removed when the scope ends.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix)
      : path_(std::filesystem::temp_directory_path() /
              (prefix + "-" + std::to_string(::getpid()) + "-" +
               ::testing::UnitTest::GetInstance()->current_test_info()->name())) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// `fn` must throw an `E` (c10::Error by default) whose message (a c10::Error's without backtrace) contains
/// every one of `needles` and none of `absent`.
template <typename E = c10::Error>
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles,
                  const std::vector<std::string>& absent = {}) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << needles.front() << "'";
  } catch (const E& e) {
    std::string message;
    if constexpr (std::is_same_v<E, c10::Error>) {
      message = e.what_without_backtrace();
    } else {
      message = e.what();
    }
    for (const auto& n : needles) EXPECT_NE(message.find(n), std::string::npos) << "'" << n << "' not in: " << message;
    for (const auto& n : absent) EXPECT_EQ(message.find(n), std::string::npos) << "'" << n << "' in: " << message;
  }
}

/// Max |a - b| / max(|b|_max, tiny): relative error normalised by the reference's magnitude.
inline double relative_error(const torch::Tensor& actual, const torch::Tensor& expected) {
  auto a = actual.to(torch::kFloat64);
  auto e = expected.to(torch::kFloat64);
  const double scale = std::max(e.abs().max().item<double>(), 1e-30);
  return (a - e).abs().max().item<double>() / scale;
}

/// Passes when shapes agree and relative_error(actual, expected) <= rtol; prints both otherwise.
inline ::testing::AssertionResult tensors_near(const torch::Tensor& actual, const torch::Tensor& expected, double rtol) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << "shape " << actual.sizes() << " != expected " << expected.sizes();
  }
  const double err = relative_error(actual, expected);
  if (err <= rtol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "relative error " << err << " > " << rtol << "\nactual:\n"
                                       << actual << "\nexpected:\n" << expected;
}

#define EXPECT_TENSOR_NEAR(actual, expected, rtol) \
  EXPECT_TRUE(::dkfac::testing::tensors_near((actual), (expected), (rtol)))

/// Explicit Kronecker product (A kron G)[i*g + k, j*g + l] = A[i, j] * G[k, l], written as loops.
inline torch::Tensor kron_loops(const torch::Tensor& a, const torch::Tensor& g) {
  auto a64 = a.to(torch::kFloat64).contiguous();
  auto g64 = g.to(torch::kFloat64).contiguous();
  const int64_t na = a.size(0), ng = g.size(0);
  auto out = torch::zeros({na * ng, na * ng}, torch::kFloat64);
  auto A = a64.accessor<double, 2>();
  auto G = g64.accessor<double, 2>();
  auto O = out.accessor<double, 2>();
  for (int64_t i = 0; i < na; ++i)
    for (int64_t j = 0; j < na; ++j)
      for (int64_t k = 0; k < ng; ++k)
        for (int64_t l = 0; l < ng; ++l) O[i * ng + k][j * ng + l] = A[i][j] * G[k][l];
  return out;
}

/// Column-major vec of a [g, a] matrix, and its inverse.
inline torch::Tensor vec(const torch::Tensor& m) { return m.t().contiguous().reshape({-1}); }
inline torch::Tensor unvec(const torch::Tensor& v, int64_t rows, int64_t cols) {
  return v.reshape({cols, rows}).t();
}

/// Dense reference: solve (A kron G + damping I) vec(V) = vec(grad).
inline torch::Tensor dense_eigen_reference(const torch::Tensor& a, const torch::Tensor& g, const torch::Tensor& grad,
                                           double damping) {
  auto k = kron_loops(a, g);
  k.diagonal().add_(damping);
  auto v = torch::linalg_solve(k, vec(grad.to(torch::kFloat64)));
  return unvec(v, grad.size(0), grad.size(1));
}

/// Dense reference: solve ((A + damping_a I) kron (G + damping_g I)) vec(V) = vec(grad).
inline torch::Tensor dense_inverse_reference(const torch::Tensor& a, const torch::Tensor& g,
                                             const torch::Tensor& grad, double damping_a, double damping_g) {
  auto a_d = a.to(torch::kFloat64) + damping_a * torch::eye(a.size(0), torch::kFloat64);
  auto g_d = g.to(torch::kFloat64) + damping_g * torch::eye(g.size(0), torch::kFloat64);
  auto v = torch::linalg_solve(kron_loops(a_d, g_d), vec(grad.to(torch::kFloat64)));
  return unvec(v, grad.size(0), grad.size(1));
}

/// A random symmetric positive semi-definite [n, n] matrix of rank <= rows.
inline torch::Tensor random_spd(int64_t n, int64_t rows, torch::Dtype dtype) {
  auto x = torch::randn({rows, n}, dtype);
  return torch::mm(x.t(), x) / static_cast<double>(rows);
}

}  // namespace dkfac::testing
