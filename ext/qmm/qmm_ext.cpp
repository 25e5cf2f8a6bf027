// afm_core._mlx.qmm_ext: an MLX primitive computing x @ dequantize(w).T on the CPU
// for MLX's affine quantized layout (2, 3, 4, 5, 6 or 8 bits, groups of 32, 64
// or 128),
// with the integer kernels of qmm_kernels.cpp spread over a small persistent
// thread pool.  Built by setup.py (qmm_extensions) against the headers of the
// installed mlx wheel and the nanobind version mlx was built with (domain
// "mlx", so mlx.core.array crosses the binding).  No GPU kernel: eval_gpu
// raises, and afm_core._mlx.qmatmul only calls this on the CPU device.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#include <pthread.h>
#endif
#if defined(__linux__)
#include <sched.h>

#include <cstdio>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

#include "attention_kernels.h"
#include "cpu_task.h"
#include "kquant_kernels.h"
#include "prefill_attention.h"
#include "qmm_kernels.h"
#include "quantized_attention.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace afm_layer {
void register_layer_ops(nb::module_& m);  // layer_ops.cpp
// silu(gate) * up over n contiguous elements, as the swiglu operation
// computes a row (layer_ops.cpp).
void swiglu_row(const float* gate, const float* up, float* out, int64_t n);
// rms_norm's rows of x (float32, any strides) into out (rows x D, dense),
// as the rms_norm operation computes them (layer_ops.cpp).
void rms_norm_rows(const mx::array& x, const mx::array& w, float* out, float eps);
// rope_decode's embedding of x (B, H, L, D) into out (row-contiguous; out may
// be x itself when x is row-contiguous), as that operation computes it.
void rope_rows(const mx::array& x, const mx::array& offset, const mx::array& freqs, mx::array& out,
               int dims, bool traditional);
// rope_decode's checks of its arguments for an x of `shape` (float32): std::invalid_argument
void check_rope_shape(const mx::Shape& shape, const mx::array& offset, const mx::array& freqs, int dims);
}

namespace afm_qmm {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  return std::atoi(v);
}

// Workers sleep on a condition variable between jobs; AFM_QMM_SPIN_US makes
// them spin that long first.  Default 30: long enough to span the gap to the
// next product of a decode step's layer (a few operations apart), short
// enough to sleep between steps.  With the 100k-work threshold below, on the
// default model's single-stream decode (benchmarks/decode_served.py, 10
// rounds alternating, an AVX2-only 2-core EPYC) 64.9-65.1 tok/s against
// 59.0 with neither, 65.2 against 59.6 with the spin alone; Qwen2.5-Coder-1.5B
// (every product above both thresholds) 14.1 against 14.2, and the default
// model under two CPU-bound processes 30.6 against 31.0: no change.  (300 us
// had made an AVX-512 machine's step slower, the spinning worker taking the
// core MLX's own thread needs.)
//
// A job is split into chunks that the caller and the woken workers claim from
// one counter.  The caller starts on the chunks at once, so a worker that
// wakes late (a futex wake-up costs tens of microseconds here, as long as a
// whole decode-size product) finds less or nothing left to do, instead of
// the caller spinning idle until that worker has done its fixed share.
class Pool {
 public:
  explicit Pool(int threads) : size_(threads < 1 ? 1 : threads) {
    spin_us_.store(env_int("AFM_QMM_SPIN_US", 30));
    for (int i = 1; i < size_; ++i) std::thread([this, i] { work(i); }).detach();
  }
  int size() const { return size_; }
  int spin_us() const { return spin_us_.load(); }
  void set_spin_us(int us) { spin_us_.store(us < 0 ? 0 : us); }

  // fn(c) for every chunk c in [0, chunks), on the caller and up to n - 1
  // workers; all on the caller when another thread is using the pool.
  void run(int n, int chunks, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::defer_lock);
    if (n <= 1 || chunks <= 1 || !busy.try_lock()) {
      for (int c = 0; c < chunks; ++c) fn(c);
      return;
    }
    if (chunks > kMaxChunks) chunks = kMaxChunks;  // (callers ask for far fewer)
    job_.store(&fn, std::memory_order_relaxed);
    active_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ++gen_;
    // the chunk count rides in the state word, so a claim can only succeed
    // for the job it was read for (see claim())
    state_.store(gen << 32 | static_cast<uint64_t>(chunks) << 16, std::memory_order_release);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    int c;
    while ((c = claim(gen)) >= 0) {
      fn(c);
      done_.fetch_add(1, std::memory_order_release);
    }
    wait_done(chunks);
  }

 private:
  static constexpr int kMaxChunks = 0xFFFF;

  // Until the workers' claimed chunks are done: a short spin (the usual
  // case: a worker finishing its last chunk), then yielding the core, so a
  // worker that the scheduler preempted mid-chunk (other processes, or more
  // threads than cores) can finish it instead of the caller burning the
  // core it needs.
  void wait_done(int chunks) {
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins < kWaitSpins) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
  }
  static constexpr int kWaitSpins = 2000;  // ~10-50 us of pause instructions

  // The next unclaimed chunk of job `gen`, or -1 when it has none left (or a
  // newer job replaced it).  A successful claim means job `gen` is still
  // running: its caller waits for every claimed chunk before returning.
  int claim(uint64_t gen) {
    uint64_t cur = state_.load(std::memory_order_acquire);
    for (;;) {
      const int chunks = static_cast<int>((cur >> 16) & 0xFFFF);
      const int next = static_cast<int>(cur & 0xFFFF);
      if ((cur >> 32) != gen || next >= chunks) return -1;
      if (state_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel)) return next;
    }
  }

  uint64_t wait_for_job(uint64_t seen) {
    uint64_t g;
    const auto start = std::chrono::steady_clock::now();
    int spins = 0;
    while ((g = state_.load(std::memory_order_acquire) >> 32) == seen) {
      cpu_relax();
      if ((++spins & 63) == 0 &&
          std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_.load())) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1);
        cv_.wait(lk, [&] { return (state_.load() >> 32) != seen; });
        sleepers_.fetch_sub(1);
      }
    }
    return g;
  }

  void work(int index) {
    uint64_t seen = 0;
    for (;;) {
      seen = wait_for_job(seen);
      if (index >= active_.load(std::memory_order_relaxed)) continue;
      // read after the state that published this job: it is this job's
      // function or a newer one's, and a claim below fails for a newer one
      const std::function<void(int)>* fn = job_.load(std::memory_order_acquire);
      int c;
      while ((c = claim(seen)) >= 0) {
        (*fn)(c);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  const int size_;
  std::atomic<int> spin_us_{0};
  uint64_t gen_ = 0;  // the last job's number (under busy_)
  std::mutex busy_, mu_;
  std::condition_variable cv_;
  // job number << 32 | chunks << 16 | next chunk to claim
  std::atomic<uint64_t> state_{0};
  std::atomic<const std::function<void(int)>*> job_{nullptr};
  std::atomic<int> active_{0}, done_{0}, sleepers_{0};
};

Pool* g_pool = nullptr;
std::mutex g_pool_mu;
std::atomic<int> g_thread_limit{0};  // 0: all of the pool
std::atomic<const KernelSet*> g_kernels{nullptr};

#if defined(__linux__)
std::string read_text(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return {};
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  return std::string(buf, n);
}

// Physical cores among the CPUs this process may run on (SMT siblings share a
// core's load units and memory path: a second thread on one does not help
// these memory-bound products), 0 if unknown.
int affinity_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
  std::vector<std::string> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    const std::string topo = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    const std::string id = read_text(topo + "physical_package_id") + "/" + read_text(topo + "core_id");
    if (id == "/") return CPU_COUNT(&set);  // no topology: count the CPUs
    if (std::find(cores.begin(), cores.end(), id) == cores.end()) cores.push_back(id);
  }
  return static_cast<int>(cores.size());
}

// The CPUs a cgroup CPU quota allows (a container's --cpus), rounded up; 0 if none.
int cgroup_cpus() {
  std::string own;  // this process's cgroup v2 path ("0::/path")
  const std::string groups = read_text("/proc/self/cgroup");
  if (const size_t at = groups.find("0::"); at != std::string::npos) {
    own = groups.substr(at + 3, groups.find('\n', at) - at - 3);
  }
  long long quota = -1, period = 0;
  const std::string v2 = read_text("/sys/fs/cgroup" + own + "/cpu.max");
  if (!v2.empty()) {
    if (v2.rfind("max", 0) == 0) return 0;
    std::sscanf(v2.c_str(), "%lld %lld", &quota, &period);
  } else {  // cgroup v1
    std::sscanf(read_text("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").c_str(), "%lld", &quota);
    std::sscanf(read_text("/sys/fs/cgroup/cpu/cpu.cfs_period_us").c_str(), "%lld", &period);
  }
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>((quota + period - 1) / period);
}
#endif

// AFM_QMM_THREADS, else the physical cores this process may use (within a
// cgroup's CPU quota), at most 16.
int default_threads() {
  int n = env_int("AFM_QMM_THREADS", 0);
  if (n > 0) return n > 16 ? 16 : n;
#if defined(__linux__)
  n = affinity_cores();
  if (const int quota = cgroup_cpus(); quota > 0 && (n <= 0 || quota < n)) n = quota;
#endif
  if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
  if (n <= 0) n = 1;
  return n > 16 ? 16 : n;
}

Pool& pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (g_pool == nullptr) {
    g_pool = new Pool(default_threads());  // never freed: its threads are detached
#if defined(__unix__) || defined(__APPLE__)
    static bool hooked = [] {
      // a forked child has none of the workers: it makes a new pool
      pthread_atfork(nullptr, nullptr, [] { g_pool = nullptr; });
      return true;
    }();
    (void)hooked;
#endif
  }
  return *g_pool;
}

// Threads for a job of `work` units: the pool's (or set_thread_limit's), or
// 1 below `min_work`.
int pool_threads(const Pool& p, double work, double min_work) {
  int threads = p.size();
  const int limit = g_thread_limit.load();
  if (limit > 0 && limit < threads) threads = limit;
  return work < min_work ? 1 : threads;
}

const KernelSet& kernels() {
  const KernelSet* k = g_kernels.load();
  return k != nullptr ? *k : select_kernels();
}

// The process's cblas_sgemm (the OpenBLAS afm_core._mlx.blas binds under MLX,
// which it loads into the global scope), for products of many rows.
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                       float, float*, int);
Sgemm find_sgemm() {
#if defined(__unix__) || defined(__APPLE__)
  static Sgemm f = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return f;
#else
  return nullptr;
#endif
}
std::atomic<int> g_gemm_rows{-1};
std::atomic<int> g_passes{-1};  // activation passes: 1 (int8) or 2 (int8 + remainder)

int act_passes() {
  int v = g_passes.load();
  if (v < 0) {
    v = env_int("AFM_QMM_ACT_BITS", 16) <= 8 ? 1 : 2;
    g_passes.store(v);
  }
  return v;
}

// The K-quant products' activation passes (AFM_KQUANT_ACT_BITS, default 8:
// one int8 pass per 256 values, llama.cpp's Q8_K and precision for these
// blocks).  Two passes (16) cost as many multiplies again, which is what
// makes the integer sub-scales pay in the first place: the 1.5B's products
// were 1.1-1.5x faster than the MLX layout's with 16-bit activations at
// one pass, 0.9-1.3x at two (benchmarks/README.md, twelfth stop).
std::atomic<int> g_kquant_passes{-1};

int kquant_passes() {
  int v = g_kquant_passes.load();
  if (v < 0) {
    v = env_int("AFM_KQUANT_ACT_BITS", 8) <= 8 ? 1 : 2;
    g_kquant_passes.store(v);
  }
  return v;
}

// Rows from which a product goes through sgemm (set_gemm_rows; -1: the
// default).  The default is AFM_QMM_GEMM_ROWS, else where the kernel set in
// use stops beating dequantize + sgemm: 64 rows for avx512-vnni (a decode step
// of 32 streams took 230-250 ms through sgemm against 113-138 ms on the
// integer kernels, and products of 48 rows still favour them), 32 for the others.
int gemm_rows() {
  const int v = g_gemm_rows.load();
  if (v >= 0) return v;
  static const int env = env_int("AFM_QMM_GEMM_ROWS", -1);
  if (env >= 0) return env;
  return std::strcmp(kernels().name, "avx512-vnni") == 0 ? 64 : 32;
}

// Weight rows per sgemm call for a product of M rows of K: a tile ~4 MB as
// float32 and its product with x at most ~4 MB, a multiple of 8.  Every
// product of (M, K) cuts its columns at the same multiples of it from where
// it starts, so a member's columns get the same calls (and bits: OpenBLAS's
// sums depend on the shape of the call) whether computed alone, in a family's
// split product or in the SwiGLU epilogue's pieces.
int gemm_tile(int M, int K) {
  const int rows = std::min((1 << 20) / std::max(K, 1), (1 << 20) / std::max(M, 1));
  return std::max(16, rows / 8 * 8);
}

// Columns [n0, n1) of x (M x K, dense) @ dequantize(w).T through sgemm, into
// y (M rows, `ldy` apart), gemm_tile(M, K) weight rows at a time.
void gemm_columns(Sgemm sgemm, const float* x, int M, const QWeights& wt, int n0, int n1,
                  float* y, int ldy) {
  const int K = wt.K;
  const int tile_rows = gemm_tile(M, K);
  thread_local std::vector<float> tile;
  tile.resize(static_cast<size_t>(std::min(tile_rows, n1 - n0)) * K);
  const KernelSet& ks = kernels();
  Pool& p = pool();
  for (int t0 = n0; t0 < n1; t0 += tile_rows) {
    const int t1 = std::min(n1, t0 + tile_rows);
    // the tile's rows dequantized on the pool's threads (OpenBLAS's then
    // multiply it): one thread took as long as sgemm itself for a prompt of
    // a few dozen rows
    const int rows = t1 - t0;
    const int threads = std::min(pool_threads(p, static_cast<double>(rows) * K, 100000.0), rows);
    float* const tp = tile.data();  // (the jobs run on other threads: not the thread_local)
    const DequantizeFn dequantize = wt.kquant != 0 ? ks.kquant_dequantize : ks.dequantize;
    if (threads <= 1) {
      dequantize(wt, t0, t1, tp);
    } else {
      const int chunks = std::min(rows, 4 * threads);
      const std::function<void(int)> job = [&](int c) {
        const int r0 = t0 + static_cast<int>(static_cast<int64_t>(rows) * c / chunks);
        const int r1 = t0 + static_cast<int>(static_cast<int64_t>(rows) * (c + 1) / chunks);
        dequantize(wt, r0, r1, tp + static_cast<size_t>(r0 - t0) * K);
      };
      p.run(threads, chunks, job);
    }
    // row-major, x not transposed, tile transposed
    sgemm(101, 111, 112, M, t1 - t0, K, 1.0f, x, K, tp, K, 0.0f, y + (t0 - n0), ldy);
  }
}

template <typename T>
const T* contiguous_2d(const mx::array& a, std::vector<T>& copy) {
  if (a.flags().row_contiguous) return a.data<T>();
  const int rows = a.shape(0), cols = a.shape(1);
  copy.resize(static_cast<size_t>(rows) * cols);
  const T* p = a.data<T>();
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) {
      copy[static_cast<size_t>(i) * cols + j] = p[i * a.strides(0) + j * a.strides(1)];
    }
  }
  return copy.data();
}

ScaleType scale_type(mx::Dtype t) {
  if (t == mx::float32) return ScaleType::f32;
  if (t == mx::float16) return ScaleType::f16;
  if (t == mx::bfloat16) return ScaleType::bf16;
  throw std::invalid_argument("afm qmm: scales and biases must be float32, float16 or bfloat16");
}

// x's rows as dense float32 (x itself when it already is): a decode step's few
// rows of a float16 or bfloat16 model, converted here instead of by two MLX
// operations around the product.
const float* float_rows(const mx::array& x, int M, int K, const int64_t* offs, int64_t ks,
                        std::vector<float>& buf) {
  bool dense = ks == 1;
  for (int m = 0; dense && m < M; ++m) dense = offs[m] == static_cast<int64_t>(m) * K;
  if (x.dtype() == mx::float32 && dense) return x.data<float>();
  buf.resize(static_cast<size_t>(M) * K);
  for (int m = 0; m < M; ++m) {
    float* dst = buf.data() + static_cast<size_t>(m) * K;
    if (x.dtype() == mx::float32) {
      const float* src = x.data<float>() + offs[m];
      for (int k = 0; k < K; ++k) dst[k] = src[k * ks];
    } else if (x.dtype() == mx::float16) {
      const mx::float16_t* src = x.data<mx::float16_t>() + offs[m];
      for (int k = 0; k < K; ++k) dst[k] = static_cast<float>(src[k * ks]);
    } else {
      const mx::bfloat16_t* src = x.data<mx::bfloat16_t>() + offs[m];
      for (int k = 0; k < K; ++k) dst[k] = static_cast<float>(src[k * ks]);
    }
  }
  return buf.data();
}

// The product's operands as the kernels read them: x's rows as dense float32
// (M x K) and the weight's planes row-contiguous (copies in thread_local
// buffers where they are not; the pointers hold until this thread's next call).
struct Operands {
  const float* x = nullptr;
  int M = 0;
  QWeights wt;
};

// x's rows as dense float32 (M x K): x's own buffer where it is one, else a
// thread_local copy (held until this thread's next call)
const float* dense_rows(const mx::array& x, int M, int K) {
  // row m of x: offsets from the strides of the leading dimensions
  thread_local std::vector<int64_t> offsets;
  offsets.resize(M);
  const int lead = x.ndim() - 1;
  for (int m = 0; m < M; ++m) {
    int64_t rem = m, off = 0;
    for (int ax = lead - 1; ax >= 0; --ax) {
      const int64_t dim = x.shape(ax);
      off += (rem % dim) * x.strides(ax);
      rem /= dim;
    }
    offsets[m] = off;
  }
  thread_local std::vector<float> xbuf;
  return float_rows(x, M, K, offsets.data(), x.strides(-1), xbuf);
}

// A 0-d biases argument's value (see checked_stream).
float bias_factor(const mx::array& b) {
  if (b.dtype() == mx::float32) return b.data<float>()[0];
  if (b.dtype() == mx::float16) return static_cast<float>(b.data<mx::float16_t>()[0]);
  return static_cast<float>(b.data<mx::bfloat16_t>()[0]);
}

// rows: x's rows already dense (a norm prologue's, normed_rows), or null.
Operands operands(const mx::array& x, const mx::array& w, const mx::array& scales,
                  const mx::array& biases, int group, int bits, const float* rows = nullptr) {
  Operands o;
  const int K = x.shape(-1);
  o.M = K > 0 ? static_cast<int>(x.size() / K) : 0;
  o.x = rows != nullptr ? rows : dense_rows(x, o.M, K);
  thread_local std::vector<uint32_t> wcopy;
  thread_local std::vector<uint16_t> scopy16, bcopy16;
  thread_local std::vector<float> scopy32, bcopy32;
  QWeights& wt = o.wt;
  if (group == kKQuantBlock) {  // GGUF's K-quant blocks (checked_stream): no scales or biases
    thread_local std::vector<uint8_t> bcopy;
    wt.w = contiguous_2d<uint8_t>(w, bcopy);
    wt.kquant = bits;
    wt.N = w.shape(0);
    wt.K = K;
    wt.group = group;
    wt.bits = bits;
    return o;
  }
  wt.w = reinterpret_cast<const uint8_t*>(contiguous_2d<uint32_t>(w, wcopy));
  wt.scale_type = scale_type(scales.dtype());
  if (wt.scale_type == ScaleType::f32) {
    wt.scales = contiguous_2d<float>(scales, scopy32);
    if (biases.ndim() != 0) wt.biases = contiguous_2d<float>(biases, bcopy32);
  } else {
    wt.scales = contiguous_2d<uint16_t>(scales, scopy16);
    if (biases.ndim() != 0) wt.biases = contiguous_2d<uint16_t>(biases, bcopy16);
  }
  if (biases.ndim() == 0) {  // a symmetric weight: every bias this times its scale
    const float f = bias_factor(biases);
    if (f != 0.0f) {
      wt.bias_factor = f;
      wt.biases = wt.scales;
    } else {  // (every bias 0: a plane of zeros, float32 or halves alike)
      thread_local std::vector<float> zeros;
      zeros.assign(scales.size(), 0.0f);
      wt.biases = zeros.data();
    }
  }
  wt.N = w.shape(0);
  wt.K = K;
  wt.group = group;
  wt.bits = bits;
  return o;
}

// Rows from which a product with K-quant blocks goes through sgemm: what
// set_gemm_rows chose, else AFM_KQUANT_GEMM_ROWS, else 96.  The blocks' int8
// kernels beat sgemm on their dequantized tiles well past the affine
// kernels' 32 rows (the 1.5B's forward: a 62-token prompt 1.48-1.55 s on the
// block kernels against 1.96-2.23 s through sgemm, 100 tokens 2.38-2.70
// against 2.72-2.90 s).
int kquant_gemm_rows() {
  const int v = g_gemm_rows.load();
  if (v >= 0) return v;
  static const int env = env_int("AFM_KQUANT_GEMM_ROWS", 96);
  return env;
}

// The process's sgemm when a product of M rows with wt goes through it, else null.
Sgemm sgemm_for(int M, const QWeights& wt) {
  Sgemm sgemm = find_sgemm();
  const int rows = wt.kquant != 0 ? kquant_gemm_rows() : gemm_rows();
  return sgemm != nullptr && rows > 0 && M >= rows ? sgemm : nullptr;
}

// The output rows [0, N) of a product split over the pool's threads in
// chunks of whole multiples of 8 rows, range(n0, n1) computing each.
void split_rows(Pool& p, int threads, int N, const std::function<void(int, int)>& range) {
  if (threads == 1) {
    range(0, N);
    return;
  }
  const int units = (N + 7) / 8;
  const int chunks = std::min(units, 8 * threads);
  const std::function<void(int)> job = [&](int c) {
    const int n0 = std::min(N, static_cast<int>(static_cast<int64_t>(units) * c / chunks) * 8);
    const int n1 = std::min(N, static_cast<int>(static_cast<int64_t>(units) * (c + 1) / chunks) * 8);
    if (n0 < n1) range(n0, n1);
  };
  p.run(threads, chunks, job);
}

// The threads a product of M x N x K multiply-adds takes.  Below 100k
// (AFM_QMM_POOL_MIN_WORK) a hand-off costs more than it saves.  With workers
// that sleep at once, waking one takes tens of microseconds, as long as a
// decode-size product, and a million was the threshold (an AVX-512 machine:
// 75.2 tok/s against 73.3 at 200k).  With the pool's short spin, the default
// model's q/k/v (0.55M), output (0.33M) and MLP-down (0.88M) products of one
// row split in two too (alone, with a spinning worker: 48 -> 34, 31 -> 25 and
// 73 -> 37 us); the step: see the spin's comment.
int product_threads(Pool& p, int M, int N, int K) {
  static const int min_work = env_int("AFM_QMM_POOL_MIN_WORK", 100000);
  return std::min(pool_threads(p, static_cast<double>(M) * N * K, min_work), std::max(N, 1));
}

// integer_product for a K-quant weight (kquant_kernels.h): the activations as
// Q8_K rows (quantized on this thread: a decode step's few rows of K), then
// the kernel set's K-quant kernel over the output rows.
void kquant_product(const float* xp, int M, const QWeights& wt, float* y) {
  const int K = wt.K, N = wt.N;
  const int passes = kquant_passes();
  const int MQ = M * passes;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int16_t> bsums;
  QActs a;
  a.q = aligned64(q, static_cast<size_t>(MQ) * K);
  a.d = aligned64(d, static_cast<size_t>(MQ) * (K / kKQuantBlock));
  a.bsums = aligned64(bsums, static_cast<size_t>(MQ) * (K / 16));
  a.M = MQ;
  a.K = K;
  a.passes = passes;
  kquant_quantize_rows(xp, K, passes, const_cast<int8_t*>(a.q), const_cast<float*>(a.d),
                       const_cast<int16_t*>(a.bsums), 0, M);
  const RangeKernel range = kernels().kquant_range;
  Pool& p = pool();
  split_rows(p, product_threads(p, M, N, K), N, [&](int n0, int n1) { range(a, wt, y, n0, n1); });
}

// y (M x N, float32, dense) = x @ dequantize(w).T on the integer kernels.
void integer_product(const float* xp, int M, const QWeights& wt, float* y) {
  if (wt.kquant != 0) {
    if (M > 0 && wt.N > 0) kquant_product(xp, M, wt, y);
    return;
  }
  const int K = wt.K, N = wt.N, group = wt.group, bits = wt.bits;
  const int nb = K / 32, ng = K / group;
  if (M == 0 || N == 0) return;
  thread_local std::vector<int64_t> dense;
  dense.resize(M);
  for (int m = 0; m < M; ++m) dense[m] = static_cast<int64_t>(m) * K;
  const int64_t ks = 1;
  const int passes = act_passes();
  const int MQ = M * passes;  // rows of quantized activations
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, xsum;
  int8_t* const qa = aligned64(q, static_cast<size_t>(MQ) * K);
  float* const da = aligned64(d, static_cast<size_t>(MQ) * nb);
  float* const sa = aligned64(xsum, static_cast<size_t>(MQ) * ng);
  QActs a;
  a.q = qa;
  a.d = da;
  a.xsum = sa;
  a.M = MQ;
  a.passes = passes;
  a.K = K;

  // (the jobs below run on other threads: they must not name the thread_locals)
  const int64_t* offs = dense.data();
  int8_t* qp = qa;
  float* dp = da;
  float* sp = sa;
  const KernelSet& ks_set = kernels();

  Pool& p = pool();
  const int threads = product_threads(p, M, N, K);

  // Both stages are split into chunks claimed by whichever thread is free
  // (Pool::run): several per thread, so a late worker costs little.
  if (threads == 1 || M < 16 * threads) {
    ks_set.quantize(xp, offs, ks, K, group, bits, passes, qp, dp, sp, 0, M);
  } else {
    const int chunks = std::min(M, 4 * threads);
    const std::function<void(int)> quant = [&](int c) {
      ks_set.quantize(xp, offs, ks, K, group, bits, passes, qp, dp, sp,
                    static_cast<int>(static_cast<int64_t>(M) * c / chunks),
                    static_cast<int>(static_cast<int64_t>(M) * (c + 1) / chunks));
    };
    p.run(threads, chunks, quant);
  }
  split_rows(p, threads, N, [&](int n0, int n1) { ks_set.range(a, wt, y, n0, n1); });
}

// out[m, :] = y[m, start : start + n] (+ bias), in out's dtype (rounded to
// nearest even, as MLX's astype); y may be out's own float32 buffer (N == n,
// start 0: the bias added in place).
void write_columns(const float* y, int M, int N, int start, int n, const mx::array* bias,
                   mx::array& out) {
  thread_local std::vector<float> bf;
  const float* bp = nullptr;
  if (bias != nullptr) {
    bf.resize(n);
    for (int j = 0; j < n; ++j) {
      const int64_t at = static_cast<int64_t>(j) * bias->strides(0);
      bf[j] = bias->dtype() == mx::float32   ? bias->data<float>()[at]
              : bias->dtype() == mx::float16 ? static_cast<float>(bias->data<mx::float16_t>()[at])
                                             : static_cast<float>(bias->data<mx::bfloat16_t>()[at]);
    }
    bp = bf.data();
  }
  for (int m = 0; m < M; ++m) {
    const float* src = y + static_cast<size_t>(m) * N + start;
    const size_t row = static_cast<size_t>(m) * n;
    if (out.dtype() == mx::float32) {
      float* dst = out.data<float>() + row;
      // (y + bias is the one float32 addition MLX's own add would make)
      for (int j = 0; j < n; ++j) dst[j] = bp != nullptr ? src[j] + bp[j] : src[j];
    } else if (out.dtype() == mx::float16) {
      mx::float16_t* dst = out.data<mx::float16_t>() + row;
      for (int j = 0; j < n; ++j) dst[j] = static_cast<mx::float16_t>(bp != nullptr ? src[j] + bp[j] : src[j]);
    } else {
      mx::bfloat16_t* dst = out.data<mx::bfloat16_t>() + row;
      for (int j = 0; j < n; ++j) dst[j] = static_cast<mx::bfloat16_t>(bp != nullptr ? src[j] + bp[j] : src[j]);
    }
  }
}

// out += r, both float32 of one shape, out row-contiguous, r of any strides:
// a residual connection added in the product's epilogue.  Each element is
// the one float32 addition MLX's add of the two arrays makes (in either
// order: it is commutative).
void add_residual(const mx::array& r, mx::array& out) {
  float* o = out.data<float>();
  const float* rp = r.data<float>();
  const size_t n = out.size();
  if (r.flags().row_contiguous) {
    for (size_t i = 0; i < n; ++i) o[i] += rp[i];
    return;
  }
  const int nd = static_cast<int>(r.ndim());
  std::vector<int64_t> idx(nd, 0);
  for (size_t i = 0; i < n; ++i) {
    int64_t at = 0;
    for (int d = 0; d < nd; ++d) at += idx[d] * r.strides(d);
    o[i] += rp[at];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < r.shape(d)) break;
      idx[d] = 0;
    }
  }
}

// silu(x @ gate.T) * (x @ up.T) into out (M x I, float32), w's rows being
// gate's I then up's I: the grouped gate/up product of a SwiGLU MLP with the
// activation as its epilogue, so neither half is ever a whole array.  Each
// output element is the bits of swiglu(gate, up) on the product's two
// outputs: the same per-element product (sgemm's or the integer kernels'),
// then afm_layer::swiglu_row on pieces that start at multiples of 8.
void swiglu_product(const Operands& o, float* out) {
  const int M = o.M, N = o.wt.N, I = N / 2, K = o.wt.K;
  if (M == 0 || I == 0) return;
  if (Sgemm sgemm = sgemm_for(M, o.wt); sgemm != nullptr) {
    // pieces of gemm_tile's width of gate and up columns (the calls the split
    // product makes), their two products side by side
    const int width = gemm_tile(M, K);
    thread_local std::vector<float> pair;
    pair.resize(static_cast<size_t>(M) * 2 * std::min(width, I));
    for (int j0 = 0; j0 < I; j0 += width) {
      const int j1 = std::min(I, j0 + width), n = j1 - j0;
      gemm_columns(sgemm, o.x, M, o.wt, j0, j1, pair.data(), 2 * n);
      gemm_columns(sgemm, o.x, M, o.wt, I + j0, I + j1, pair.data() + n, 2 * n);
      for (int m = 0; m < M; ++m) {
        const float* g = pair.data() + static_cast<size_t>(m) * 2 * n;
        afm_layer::swiglu_row(g, g + n, out + static_cast<size_t>(m) * I + j0, n);
      }
    }
    return;
  }
  // the integer kernels: blocks of rows, each block's whole product (a block
  // is a decode step's few rows; more only with sgemm turned off)
  constexpr int kBlock = 64;
  thread_local std::vector<float> ybuf;
  ybuf.resize(static_cast<size_t>(std::min(M, kBlock)) * N);
  for (int m0 = 0; m0 < M; m0 += kBlock) {
    const int rows = std::min(M, m0 + kBlock) - m0;
    integer_product(o.x + static_cast<size_t>(m0) * K, rows, o.wt, ybuf.data());
    for (int m = 0; m < rows; ++m) {
      const float* y = ybuf.data() + static_cast<size_t>(m) * N;
      afm_layer::swiglu_row(y, y + I, out + static_cast<size_t>(m0 + m) * I, I);
    }
  }
}

// x @ dequantize(w).T as one or more outputs: output i is the columns
// [offset_i, offset_i + splits[i]) of the product, plus bias i where given
// (sibling projections of one input computed as one product, each member's
// columns in an array of its own: no slice operations, no view keeping the
// whole product alive); or, `swiglu`, the one output silu(first half) *
// (second half) (swiglu_product).
// rms_norm(x, w, eps)'s rows, dense, in a thread_local buffer (held until
// this thread's next call): a product's norm prologue.
const float* normed_rows(const mx::array& x, const mx::array& w, float eps) {
  thread_local std::vector<float> buf;
  buf.resize(x.size());
  afm_layer::rms_norm_rows(x, w, buf.data(), eps);
  return buf.data();
}

class AfmQuantizedMatmul : public mx::Primitive {
 public:
  AfmQuantizedMatmul(mx::Stream stream, int group, int bits, std::vector<int> splits,
                     std::vector<bool> has_bias, bool swiglu = false, bool residual = false,
                     bool norm = false, float norm_eps = 0.0f, std::vector<mx::Shape> shapes = {},
                     int rope_outputs = 0, int rope_dims = 0, bool rope_traditional = false)
      : mx::Primitive(stream), group_(group), bits_(bits), splits_(std::move(splits)),
        has_bias_(std::move(has_bias)), swiglu_(swiglu), residual_(residual), norm_(norm),
        norm_eps_(norm_eps), shapes_(std::move(shapes)), rope_outputs_(rope_outputs),
        rope_dims_(rope_dims), rope_traditional_(rope_traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) afm_cpu::allocate(o);
    std::vector<mx::array> weak_in, weak_out;
    for (const auto& a : inputs) weak_in.push_back(mx::array::unsafe_weak_copy(a));
    for (const auto& o : outputs) weak_out.push_back(mx::array::unsafe_weak_copy(o));
    afm_cpu::dispatch(stream(), inputs, outputs,
                      [in = std::move(weak_in), out = std::move(weak_out), group = group_,
                       bits = bits_, splits = splits_, has_bias = has_bias_, swiglu = swiglu_,
                       residual = residual_, norm = norm_, eps = norm_eps_,
                       rope_outputs = rope_outputs_, rope_dims = rope_dims_,
                       rope_trad = rope_traditional_]() mutable {
                        // with a norm prologue, inputs[4] is its weight (the biases follow)
                        const float* rows = norm ? normed_rows(in[0], in[4], eps) : nullptr;
                        if (swiglu) {
                          swiglu_product(operands(in[0], in[1], in[2], in[3], group, bits, rows),
                                         out[0].data<float>());
                        } else {
                          run(in, out, group, bits, splits, has_bias, rows, norm ? 5 : 4);
                          if (residual) add_residual(in.back(), out[0]);
                          // the rotary epilogue: the offset and frequencies are the last inputs
                          const size_t k = in.size();
                          for (int i = 0; i < rope_outputs; ++i) {
                            afm_layer::rope_rows(out[i], in[k - 2], in[k - 1], out[i], rope_dims, rope_trad);
                          }
                        }
                      });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("afm qmm: this primitive runs on the CPU only");
  }

  const char* name() const override {
    return swiglu_ ? "AfmQuantizedSwiglu" : "AfmQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AfmQuantizedMatmul&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && splits_ == o.splits_ &&
           has_bias_ == o.has_bias_ && swiglu_ == o.swiglu_ &&
           residual_ == o.residual_ && norm_ == o.norm_ && norm_eps_ == o.norm_eps_ &&
           shapes_ == o.shapes_ && rope_outputs_ == o.rope_outputs_ && rope_dims_ == o.rope_dims_ &&
           rope_traditional_ == o.rope_traditional_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    if (!shapes_.empty()) return shapes_;
    std::vector<mx::Shape> shapes;
    for (int n : splits_) {
      mx::Shape shape = inputs[0].shape();
      shape.back() = n;
      shapes.push_back(std::move(shape));
    }
    return shapes;
  }

 private:
  static void run(std::vector<mx::array>& in, std::vector<mx::array>& out, int group, int bits,
                  const std::vector<int>& splits, const std::vector<bool>& has_bias,
                  const float* rows, size_t first_bias) {
    const Operands o = operands(in[0], in[1], in[2], in[3], group, bits, rows);
    const int M = o.M, N = o.wt.N;
    if (M == 0) return;
    bool all_f32 = true;
    for (const auto& a : out) all_f32 = all_f32 && a.dtype() == mx::float32;
    const Sgemm sgemm = sgemm_for(M, o.wt);
    if (sgemm != nullptr && all_f32) {
      // each member's columns straight into its own output, its bias added there
      int start = 0;
      size_t next_bias = first_bias;
      for (size_t i = 0; i < splits.size(); ++i) {
        float* y = out[i].data<float>();
        gemm_columns(sgemm, o.x, M, o.wt, start, start + splits[i], y, splits[i]);
        if (has_bias[i]) write_columns(y, M, splits[i], 0, splits[i], &in[next_bias++], out[i]);
        start += splits[i];
      }
      return;
    }
    const bool direct = splits.size() == 1 && !has_bias[0] && out[0].dtype() == mx::float32;
    thread_local std::vector<float> ybuf;
    float* y = out[0].data<float>();
    if (!direct) {
      ybuf.resize(static_cast<size_t>(M) * N);
      y = ybuf.data();
    }
    if (sgemm != nullptr) {  // member by member, as above: the calls each makes alone
      int start = 0;
      for (int n : splits) {
        gemm_columns(sgemm, o.x, M, o.wt, start, start + n, y + start, N);
        start += n;
      }
    } else {
      integer_product(o.x, M, o.wt, y);
    }
    if (direct) return;
    int start = 0;
    size_t next_bias = first_bias;
    for (size_t i = 0; i < splits.size(); ++i) {
      const mx::array* bias = has_bias[i] ? &in[next_bias++] : nullptr;
      write_columns(y, M, N, start, splits[i], bias, out[i]);
      start += splits[i];
    }
  }

  int group_, bits_;
  std::vector<int> splits_;
  std::vector<bool> has_bias_;
  bool swiglu_, residual_, norm_;
  float norm_eps_;
  std::vector<mx::Shape> shapes_;  // the outputs' shapes, when not x's with the split's width
  int rope_outputs_, rope_dims_;   // the first rope_outputs outputs get the rotary embedding
  bool rope_traditional_;
};

// The CPU stream of the default device, and x's dtype checked.
mx::Stream cpu_stream(const mx::array& x) {
  const mx::Stream stream = mx::default_stream(mx::default_device());
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("afm qmm: the default device must be the CPU");
  }
  const mx::Dtype out_type = x.dtype();
  if (out_type != mx::float32 && out_type != mx::float16 && out_type != mx::bfloat16) {
    throw std::invalid_argument("afm qmm: x must be float32, float16 or bfloat16");
  }
  return stream;
}

// group_size 256: w is GGUF's K-quant blocks as uint8 rows (bits 4: Q4_K,
// 6: Q6_K; kquant_kernels.h); scales and biases are not read.
mx::Stream checked_kquant_stream(const mx::array& x, const mx::array& w, const mx::array& scales,
                                 const mx::array& biases, int bits) {
  const int bytes = kquant_block_bytes(bits);
  if (bytes == 0) {
    throw std::invalid_argument("afm qmm: group_size 256 (K-quant blocks) needs bits 4 (Q4_K) or 6 (Q6_K)");
  }
  if (w.ndim() != 2 || w.dtype() != mx::uint8 || w.shape(1) % bytes != 0) {
    throw std::invalid_argument("afm qmm: K-quant blocks must be a 2-D uint8 array of whole blocks a row");
  }
  // (a layer's own are empty, (N, 0); 0-d ones are accepted too)
  if ((scales.size() != 0 && scales.ndim() != 0) || (biases.size() != 0 && biases.ndim() != 0)) {
    throw std::invalid_argument(
        "afm qmm: K-quant blocks hold their scales: scales and biases must be empty or 0-d (not read)");
  }
  if (x.ndim() < 1 || x.shape(-1) != w.shape(1) / bytes * kKQuantBlock) {
    throw std::invalid_argument("afm qmm: x's last dimension does not match w");
  }
  return cpu_stream(x);
}

// The checks every product makes of its operands; the CPU stream it runs on.
mx::Stream checked_stream(const mx::array& x, const mx::array& w, const mx::array& scales,
                          const mx::array& biases, int group_size, int bits) {
  if (group_size == kKQuantBlock) return checked_kquant_stream(x, w, scales, biases, bits);
  if (bits < 2 || bits > 8 || bits == 7) {
    throw std::invalid_argument("afm qmm: bits must be 2, 3, 4, 5, 6 or 8");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("afm qmm: group_size must be 32, 64 or 128");
  }
  if (w.ndim() != 2 || w.dtype() != mx::uint32) {
    throw std::invalid_argument("afm qmm: w must be a 2-D uint32 array");
  }
  const int K = w.shape(1) * 32 / bits;
  const int N = w.shape(0);
  if (x.ndim() < 1 || x.shape(-1) != K) {
    throw std::invalid_argument("afm qmm: x's last dimension does not match w");
  }
  const mx::Shape sshape = {N, K / group_size};
  // biases: (N, K / group_size) as the scales, or 0-d: a symmetric weight's
  // factor c, every group's bias c times its scale (QWeights::bias_factor)
  if (scales.shape() != sshape ||
      (biases.ndim() != 0 && (biases.shape() != sshape || scales.dtype() != biases.dtype()))) {
    throw std::invalid_argument(
        "afm qmm: scales must be (N, K / group_size) and biases the same, or 0-d (every bias "
        "that times its scale)");
  }
  (void)scale_type(biases.dtype());
  (void)scale_type(scales.dtype());
  return cpu_stream(x);
}

// A product's norm prologue: rms_norm(x, weight, eps) is the product's input.
void check_norm(const mx::array& x, const std::optional<mx::array>& norm_weight) {
  if (norm_weight.has_value() &&
      (x.dtype() != mx::float32 || norm_weight->dtype() != mx::float32 ||
       norm_weight->ndim() != 1 || norm_weight->shape(0) != x.shape(-1))) {
    throw std::invalid_argument(
        "afm qmm: a norm prologue needs float32 x and a float32 weight of x's last dimension");
  }
}

std::vector<mx::array> quantized_matmul_split(const mx::array& x, const mx::array& w,
                                              const mx::array& scales, const mx::array& biases,
                                              int group_size, int bits, std::vector<int> splits,
                                              const std::vector<std::optional<mx::array>>& bias,
                                              const std::optional<mx::array>& norm_weight,
                                              float norm_eps,
                                              const std::vector<std::vector<int>>& out_shapes,
                                              const std::optional<mx::array>& rope_offset,
                                              const std::optional<mx::array>& rope_freqs,
                                              int rope_dims, bool rope_traditional,
                                              int rope_outputs) {
  const mx::Stream stream = checked_stream(x, w, scales, biases, group_size, bits);
  check_norm(x, norm_weight);
  const int N = w.shape(0);
  const mx::Dtype out_type = x.dtype();
  if (splits.empty()) splits.push_back(N);
  int total = 0;
  for (int n : splits) {
    if (n <= 0) throw std::invalid_argument("afm qmm: every split must have columns");
    total += n;
  }
  if (total != N) throw std::invalid_argument("afm qmm: the splits must add up to w's rows");
  if (!bias.empty() && bias.size() != splits.size()) {
    throw std::invalid_argument("afm qmm: one bias (or None) per split");
  }
  std::vector<mx::array> inputs = {x, w, scales, biases};
  if (norm_weight.has_value()) inputs.push_back(*norm_weight);
  std::vector<bool> has_bias(splits.size(), false);
  for (size_t i = 0; i < bias.size(); ++i) {
    if (!bias[i].has_value()) continue;
    const mx::array& b = *bias[i];
    if (b.ndim() != 1 || b.shape(0) != splits[i] || b.dtype() != out_type) {
      throw std::invalid_argument("afm qmm: a bias must be 1-D, of its split's width and of x's dtype");
    }
    inputs.push_back(b);
    has_bias[i] = true;
  }
  std::vector<mx::Shape> shapes;
  for (int n : splits) {
    mx::Shape shape = x.shape();
    shape.back() = n;
    shapes.push_back(std::move(shape));
  }
  std::vector<mx::Shape> custom;
  if (!out_shapes.empty()) {  // the same elements in the same order, shaped as asked
    if (out_shapes.size() != splits.size()) {
      throw std::invalid_argument("afm qmm: one shape per split");
    }
    const int64_t rows = x.shape(-1) > 0 ? static_cast<int64_t>(x.size() / x.shape(-1)) : 0;
    for (size_t i = 0; i < splits.size(); ++i) {
      int64_t size = 1;
      for (int d : out_shapes[i]) size *= d;
      if (size != rows * splits[i]) {
        throw std::invalid_argument("afm qmm: a split's shape must hold its rows x width elements");
      }
      custom.emplace_back(out_shapes[i].begin(), out_shapes[i].end());
    }
    shapes = custom;
  }
  if (rope_outputs > 0) {  // rope_decode of outputs 0 .. rope_outputs - 1, in place
    if (!rope_offset.has_value() || !rope_freqs.has_value() || out_type != mx::float32 ||
        rope_outputs > static_cast<int>(splits.size())) {
      throw std::invalid_argument(
          "afm qmm: a rotary epilogue needs float32 x, rope_offset, rope_freqs and that many outputs");
    }
    const mx::array& offset = *rope_offset;
    const mx::array& freqs = *rope_freqs;
    for (int i = 0; i < rope_outputs; ++i) {
      try {
        afm_layer::check_rope_shape(shapes[i], offset, freqs, rope_dims);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("afm qmm: the rotary epilogue of output " + std::to_string(i) + ": " +
                                    e.what());
      }
    }
    inputs.push_back(offset);
    inputs.push_back(freqs);
  } else {
    rope_outputs = 0;
  }
  std::vector<mx::Dtype> dtypes(splits.size(), out_type);
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<AfmQuantizedMatmul>(stream, group_size, bits, splits, has_bias, false, false,
                                           norm_weight.has_value(), norm_eps, std::move(custom),
                                           rope_outputs, rope_dims, rope_traditional),
      inputs);
}

// silu(x @ gate.T) * (x @ up.T), w (and its scales and biases) being gate's
// rows then up's: one float32 output of half w's rows.
mx::array quantized_matmul_swiglu(const mx::array& x, const mx::array& w, const mx::array& scales,
                                  const mx::array& biases, int group_size, int bits,
                                  const std::optional<mx::array>& norm_weight, float norm_eps) {
  const mx::Stream stream = checked_stream(x, w, scales, biases, group_size, bits);
  check_norm(x, norm_weight);
  if (x.dtype() != mx::float32) throw std::invalid_argument("afm qmm: swiglu: x must be float32");
  if (w.shape(0) % 2 != 0) {
    throw std::invalid_argument("afm qmm: swiglu: w must have an even number of rows (gate, up)");
  }
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0) / 2;
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<AfmQuantizedMatmul>(stream, group_size, bits,
                                                        std::vector<int>{w.shape(0) / 2},
                                                        std::vector<bool>{false}, true, false,
                                                        norm_weight.has_value(), norm_eps),
                   norm_weight.has_value() ? std::vector<mx::array>{x, w, scales, biases, *norm_weight}
                                           : std::vector<mx::array>{x, w, scales, biases});
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits,
                           const std::optional<mx::array>& bias,
                           const std::optional<mx::array>& residual) {
  mx::array y =
      quantized_matmul_split(x, w, scales, biases, group_size, bits, {}, {bias}, std::nullopt, 0.0f, {},
                             std::nullopt, std::nullopt, 0, false, 0)[0];
  if (!residual.has_value()) return y;
  // the same product with the residual added in its epilogue
  if (x.dtype() != mx::float32 || residual->dtype() != mx::float32 ||
      residual->shape() != y.shape()) {
    throw std::invalid_argument(
        "afm qmm: a residual must be float32 and of the output's shape, with float32 x");
  }
  std::vector<mx::array> inputs = y.inputs();
  inputs.push_back(*residual);
  return mx::array(y.shape(), mx::float32,
                   std::make_shared<AfmQuantizedMatmul>(
                       y.primitive().stream(), group_size, bits, std::vector<int>{w.shape(0)},
                       std::vector<bool>{bias.has_value()}, false, true),
                   std::move(inputs));
}

// ---------------------------------------------------------------- attention

// Query positions per call: a decode step (1) or a speculative verify step
// (1 + guesses).  Scratch grows with L * S, and for prompt-length L the
// matrix products of MLX's graph are the faster way.
constexpr int kMaxQueryPositions = 16;

afm_attn::View4 view4(const mx::array& a) {
  afm_attn::View4 v;
  v.p = a.dtype() == mx::float16 ? static_cast<const void*>(a.data<mx::float16_t>())
                                 : static_cast<const void*>(a.data<float>());
  for (int i = 0; i < 4; ++i) v.s[i] = a.strides(i);
  return v;
}

// length: the keys read (the first `length` of k's and v's positions), or -1: all
void attention_compute(const mx::array& q, const mx::array& k, const mx::array& v,
                       const mx::array* mask, mx::array& out, float scale, bool causal,
                       int length) {
  afm_attn::Args a;
  a.q = view4(q);
  a.k = view4(k);
  a.v = view4(v);
  a.half = k.dtype() == mx::float16;
  a.portable = std::strcmp(kernels().name, "scalar") == 0;
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.Hkv = k.shape(1);
  a.L = q.shape(2);
  a.S = length >= 0 ? length : k.shape(2);
  a.D = q.shape(3);
  a.causal = causal;
  a.scale = scale;
  a.out = out.data<float>();
  if (mask != nullptr) {  // broadcast to (B, Hq, L, S): strides 0 where it was
    a.mask_kind = mask->dtype() == mx::bool_ ? afm_attn::MaskKind::boolean
                                             : afm_attn::MaskKind::additive;
    a.mask = mask->data<void>();
    for (int i = 0; i < 4; ++i) a.ms[i] = mask->strides(i);
  }
  const int units = a.B * a.Hkv;
  if (units == 0) return;
  Pool& p = pool();
  int threads = pool_threads(p, static_cast<double>(a.B) * a.Hq * a.L * a.S * a.D, 300000.0);
  if (units == 1) threads = 1;
  if (threads == 1) {
    afm_attn::decode_attention_units(a, 0, units);
    return;
  }
  const std::function<void(int)> job = [&](int u) { afm_attn::decode_attention_units(a, u, u + 1); };
  p.run(threads, units, job);
}

class AfmDecodeAttention : public mx::Primitive {
 public:
  AfmDecodeAttention(mx::Stream stream, float scale, bool causal, int length = -1,
                     bool merge_heads = false)
      : mx::Primitive(stream), scale_(scale), causal_(causal), length_(length),
        merge_heads_(merge_heads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    afm_cpu::allocate(out);
    const bool masked = inputs.size() == 4;
    afm_cpu::dispatch(stream(), inputs, out, [q = mx::array::unsafe_weak_copy(inputs[0]),
                  k = mx::array::unsafe_weak_copy(inputs[1]),
                  v = mx::array::unsafe_weak_copy(inputs[2]),
                  m = mx::array::unsafe_weak_copy(inputs[masked ? 3 : 0]), masked,
                  out = mx::array::unsafe_weak_copy(out), scale = scale_,
                  causal = causal_, length = length_]() mutable {
      attention_compute(q, k, v, masked ? &m : nullptr, out, scale, causal, length);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("afm attention: this primitive runs on the CPU only");
  }

  const char* name() const override { return "AfmDecodeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AfmDecodeAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && length_ == o.length_ &&
           merge_heads_ == o.merge_heads_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const mx::Shape& q = inputs[0].shape();
    if (merge_heads_) return {{q[0], q[2], q[1] * q[3]}};
    return {q};
  }

 private:
  float scale_;
  bool causal_;
  int length_;
  bool merge_heads_;
};

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           float scale, const std::optional<mx::array>& mask, bool causal,
                           int length, bool merge_heads) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    throw std::invalid_argument("afm attention: q, k and v must have 4 dimensions");
  }
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hkv = k.shape(1);
  if (length > k.shape(2) || length < -1 || (length >= 0 && length < L)) {
    throw std::invalid_argument("afm attention: length must be -1 or from L to the keys' positions");
  }
  if (merge_heads && L != 1) {
    throw std::invalid_argument("afm attention: merge_heads needs one query position");
  }
  const int S = length >= 0 ? length : k.shape(2);
  if (L < 1 || L > kMaxQueryPositions) {
    throw std::invalid_argument("afm attention: 1 to " + std::to_string(kMaxQueryPositions) +
                                " query positions");
  }
  if (k.shape(0) != B || v.shape(0) != B || k.shape(3) != D || v.shape(3) != D ||
      v.shape(1) != Hkv || v.shape(2) != k.shape(2)) {
    throw std::invalid_argument("afm attention: k and v must be (B, Hkv, S, D) for q (B, Hq, L, D)");
  }
  if (Hkv == 0 || Hq % Hkv != 0) {
    throw std::invalid_argument("afm attention: query heads must be a multiple of key heads");
  }
  if (q.dtype() != mx::float32 || (k.dtype() != mx::float32 && k.dtype() != mx::float16) ||
      v.dtype() != k.dtype()) {
    throw std::invalid_argument(
        "afm attention: q must be float32, k and v both float32 or both float16");
  }
  const mx::Stream stream = mx::default_stream(mx::default_device());
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("afm attention: the default device must be the CPU");
  }
  std::vector<mx::array> inputs = {q, k, v};
  if (mask.has_value()) {
    if (mask->dtype() != mx::bool_ && mask->dtype() != mx::float32) {
      throw std::invalid_argument("afm attention: the mask must be bool or float32");
    }
    // (raises for a mask that does not broadcast to the scores)
    inputs.push_back(mx::broadcast_to(*mask, {B, Hq, L, S}, stream));
  }
  mx::Shape shape = merge_heads ? mx::Shape{B, L, Hq * D} : mx::Shape{B, Hq, L, D};
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<AfmDecodeAttention>(stream, scale, causal, length, merge_heads),
                   std::move(inputs));
}

}  // namespace
}  // namespace afm_qmm

// ---------------------------------------------------------------- quantized attention
// quantized_decode_attention (quantized_attention.cpp) on this module's pool.
namespace afm_qmm {
namespace {

void register_quantized_attention(nb::module_& m) {
  afm_qattn::Runner runner;
  runner.threads = [](double work, double min_work) { return pool_threads(pool(), work, min_work); };
  runner.run = [](int n, int chunks, const std::function<void(int)>& fn) {
    pool().run(n, chunks, fn);
  };
  m.def("quantized_decode_attention",
        [runner](const mx::array& q, const std::vector<mx::array>& keys,
                 const std::vector<mx::array>& values, float scale,
                 const std::optional<mx::array>& mask, int group_size, int bits) {
          return afm_qattn::quantized_decode_attention(q, keys, values, scale, mask, group_size,
                                                       bits, runner);
        },
        "q"_a, "keys"_a, "values"_a, "scale"_a, "mask"_a = nb::none(), "group_size"_a = 64,
        "bits"_a = 8,
        "mlx-lm's quantized_scaled_dot_product_attention for one query position per (batch, "
        "head): q (B, Hq, 1, D) float32; keys and values mx.quantize'd (data, scales, biases), "
        "(B, Hkv, S, *), float32 scales; a bool mask keeps where true, a float32 mask is added; "
        "both broadcast to (B, Hq, 1, S).");
}

// prefill_attention (prefill_attention.cpp) on this module's pool and kernel setting.
void register_prefill_attention(nb::module_& m) {
  afm_pattn::Runner runner;
  runner.threads = [](double work, double min_work) { return pool_threads(pool(), work, min_work); };
  runner.run = [](int n, int chunks, const std::function<void(int)>& fn) {
    pool().run(n, chunks, fn);
  };
  runner.isa = [] { return kernels().name; };
  m.def("prefill_attention",
        [runner](const mx::array& q, const std::vector<mx::array>& keys,
                 const std::vector<mx::array>& values, float scale,
                 const std::optional<mx::array>& mask, bool causal, int window, int group_size,
                 int bits) {
          return afm_pattn::prefill_attention(q, keys, values, scale, mask, causal, window,
                                              group_size, bits, runner);
        },
        "q"_a, "keys"_a, "values"_a, "scale"_a, "mask"_a = nb::none(), "causal"_a = false,
        "window"_a = 0, "group_size"_a = 64, "bits"_a = 0,
        "softmax(scale * q k^T + mask) v for many query positions, flash-attention style (no "
        "score matrix): q (B, Hq, L, D) float32; keys and values [k] and [v] (B, Hkv, S, D) "
        "float32 or float16, or with bits 4 or 8 mx.quantize'd (data, scales, biases) triples; "
        "query l is key S - L + l: causal sees the keys up to it, window > 0 only the last "
        "window of them; a bool mask keeps where true, a float32 mask is added (broadcast to "
        "(B, Hq, L, S)).  A row that sees no key is zeros.");
  m.def("prefill_attention_path",
        [runner](int head_dim) { return afm_pattn::prefill_attention_path(runner, head_dim); },
        "head_dim"_a = 64,
        "The kernel path prefill_attention takes now for value heads of head_dim: 'portable', "
        "'avx2' or 'avx512' (from the instruction set in use, see set_isa).");
}

}  // namespace
}  // namespace afm_qmm

NB_MODULE(qmm_ext, m) {
  nb::module_::import_("mlx.core");
  m.doc() = "x @ dequantize(w).T on the CPU for MLX's affine quantized layout";
  m.def("quantized_matmul", &afm_qmm::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "bias"_a = nb::none(), "residual"_a = nb::none(),
        "x @ dequantize(w, scales, biases).T (+ bias, 1-D, x's dtype), in x's dtype (float32, "
        "float16 or bfloat16), float32 accumulation, activations quantized per block of 32; "
        "+ residual (float32, the output's shape, float32 x), the bits of adding it after; "
        "biases may be a 0-d array c instead (a symmetric weight: every group's bias c times "
        "its scale, c = -2^(bits-1) for GGUF's Q4_0/Q5_0/Q8_0/Q6_K): the same result where "
        "the biases are exactly that, without reading them");
  m.def("quantized_matmul_split", &afm_qmm::quantized_matmul_split, "x"_a, "w"_a, "scales"_a,
        "biases"_a, "group_size"_a, "bits"_a, "splits"_a, "bias"_a = std::vector<std::optional<mx::array>>{},
        "norm_weight"_a = nb::none(), "norm_eps"_a = 0.0f,
        "shapes"_a = std::vector<std::vector<int>>{}, "rope_offset"_a = nb::none(),
        "rope_freqs"_a = nb::none(), "rope_dims"_a = 0, "rope_traditional"_a = false,
        "rope_outputs"_a = 0,
        "quantized_matmul as one array per split: output i is the next splits[i] columns of "
        "the product, plus bias[i] where it is not None (1-D, x's dtype); with norm_weight, "
        "of rms_norm(x, norm_weight, norm_eps) (float32): the bits of rms_norm's output; "
        "shapes: each output's shape (its elements in the same order); rope_outputs > 0: "
        "the first rope_outputs outputs (float32, shaped (B, H, L, D)) get rope_decode(out, "
        "rope_offset, rope_freqs, rope_dims, rope_traditional) in the same operation (its bits)");
  m.def("quantized_matmul_swiglu", &afm_qmm::quantized_matmul_swiglu, "x"_a, "w"_a, "scales"_a,
        "biases"_a, "group_size"_a, "bits"_a, "norm_weight"_a = nb::none(), "norm_eps"_a = 0.0f,
        "silu(x @ gate.T) * (x @ up.T) for w = gate's rows then up's (a SwiGLU MLP's grouped "
        "gate/up projections), float32: the bits of swiglu() on quantized_matmul_split's two "
        "outputs, without either of them as an array");
  afm_layer::register_layer_ops(m);
  m.def("decode_attention", &afm_qmm::decode_attention, "q"_a, "k"_a, "v"_a, "scale"_a,
        "mask"_a = nb::none(), "causal"_a = false, "length"_a = -1, "merge_heads"_a = false,
        "softmax(scale * q k^T + mask) v for a few query positions per (batch, head): q (B, "
        "Hq, L, D) with L at most 16, float32; k and v (B, Hkv, S, D), float32 or float16; a "
        "bool mask keeps where "
        "true, a float32 mask is added; both broadcast to (B, Hq, L, S); causal: query l sees "
        "the keys up to S - L + l.  Position l gives the bits of a one-position call on the "
        "keys up to it.  length (>= 0): only the first length positions of k and v (S = "
        "length: a KV cache's buffers read in place); merge_heads (L = 1): the output as (B, 1, "
        "Hq x D), the same elements.");
  m.def("isa", [] { return std::string(afm_qmm::kernels().name); },
        "The instruction set of the kernels in use.");
  m.def("available_isas", [] {
    const afm_qmm::KernelSet* sets[8];
    const int n = afm_qmm::available_kernels(sets, 8);
    std::vector<std::string> names;
    for (int i = 0; i < n; ++i) names.emplace_back(sets[i]->name);
    return names;
  }, "Instruction sets this CPU runs, best last.");
  m.def("set_isa", [](const std::string& name) {
    const afm_qmm::KernelSet* sets[8];
    const int n = afm_qmm::available_kernels(sets, 8);
    for (int i = 0; i < n; ++i) {
      if (name == sets[i]->name) {
        afm_qmm::g_kernels.store(sets[i]);
        return true;
      }
    }
    return false;
  }, "name"_a, "Use the kernels of this instruction set (for tests); False if unavailable.");
  m.def("has_sgemm", [] { return afm_qmm::find_sgemm() != nullptr; },
        "Whether products of many rows can go to the process's cblas_sgemm.");
  m.def("set_gemm_rows", [](int n) { afm_qmm::g_gemm_rows.store(n); }, "n"_a,
        "Rows from which products go through sgemm (0: never; -1: the default, "
        "AFM_QMM_GEMM_ROWS or 64 on avx512-vnni, else 32).");
  m.def("gemm_rows", [] { return afm_qmm::gemm_rows(); },
        "Rows from which products go through sgemm now (0: never).");
  m.def("set_activation_bits", [](int bits) { afm_qmm::g_passes.store(bits <= 8 ? 1 : 2); },
        "bits"_a, "8: activations rounded to int8; 16 (default, AFM_QMM_ACT_BITS): the "
        "precision of int8 plus an int8 remainder (one int16 product on the x86 sets, two int8 "
        "products elsewhere).");
  m.def("set_kquant_activation_bits",
        [](int bits) { afm_qmm::g_kquant_passes.store(bits <= 8 ? 1 : 2); }, "bits"_a,
        "Activations of the products with K-quant blocks (group_size 256): 8 (default, "
        "AFM_KQUANT_ACT_BITS) int8 per 256 values, llama.cpp's Q8_K; 16 an int8 remainder "
        "pass as well.");
  m.def("num_threads", [] { return afm_qmm::pool().size(); },
        "Threads of the pool (AFM_QMM_THREADS, default: the physical cores this process may "
        "use, within a cgroup CPU quota, at most 16).");
  m.def("set_thread_limit", [](int n) { afm_qmm::g_thread_limit.store(n); }, "n"_a,
        "Use at most n threads per product (0: all of the pool).");
  m.def("spin_us", [] { return afm_qmm::pool().spin_us(); },
        "Microseconds a worker spins after a job before it sleeps (AFM_QMM_SPIN_US).");
  m.def("set_spin_us", [](int us) { afm_qmm::pool().set_spin_us(us); }, "us"_a,
        "Set how long a worker spins after a job before it sleeps.");
  m.def("in_flight_limit", [] {
        auto& f = afm_cpu::in_flight();
        std::lock_guard<std::mutex> lock(f.mutex);
        return f.limit;
      },
        "Bytes of afm operations' outputs that may be queued and not yet computed before the next "
        "operation waits (AFM_QMM_IN_FLIGHT_MIB, default 16 MiB; see ext/qmm/cpu_task.h).");
  m.def("set_in_flight_limit", [](size_t bytes) {
        auto& f = afm_cpu::in_flight();
        {
          std::lock_guard<std::mutex> lock(f.mutex);
          f.limit = bytes;
        }
        f.done.notify_all();
      }, "bytes"_a, "Set in_flight_limit.");
  m.def("in_flight_stats", [] {
        auto& f = afm_cpu::in_flight();
        std::lock_guard<std::mutex> lock(f.mutex);
        return std::make_pair(f.bytes, f.waits);
      },
        "(bytes in flight now, how many operations have waited so far).");
  {
    const int mib = afm_qmm::env_int("AFM_QMM_IN_FLIGHT_MIB", 16);
    afm_cpu::in_flight().limit = static_cast<size_t>(mib > 0 ? mib : 1) << 20;
  }
  afm_qmm::register_quantized_attention(m);
  afm_qmm::register_prefill_attention(m);
}
