// DRAGONN selection on the CPU: one pass over the buffer. Threads: torch's own OpenMP pool when built with
// -fopenmp (cpu_table.py does so only when the process already holds torch's libgomp.so.1, so the
// dynamic linker binds this library to that same runtime), else std::thread. Built and loaded by
// cpu_table.py (ctypes); plain C ABI, no torch headers, so it compiles in about a second.
//
// Semantics are those of ds_dragonn/compress/reference.py, bit for bit:
//   selected(i)  <=>  mag(i) >= thr and mag(i) > 0,  mag = float32(|x|) with NaN -> +Inf
//   key(i)       =   (float_bits(mag(i)) >> (ibits - 32)) << ibits | i
//   slot(i)      =   i if m >= n else murmur3_x86_32(i as 8-byte LE key, seed) % m
//   table[slot]  =   max over keys hashed there (EMPTY = -1)
// The comparison is done on integer keys: for non-negative floats the order of the bit patterns is the
// order of the values, and NaN patterns sort above +Inf, so "mag >= thr and mag > 0" becomes one integer
// compare "abs_bits >= T" with T = max(1, smallest pattern whose value is >= thr).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <thread>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

enum DType { F32 = 0, F16 = 1, BF16 = 2, F64 = 3 };
constexpr uint32_t kInfBits = 0x7F800000u;

inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }
inline uint32_t mix(uint32_t h, uint32_t k) {
  k *= 0xCC9E2D51u; k = rotl32(k, 15); k *= 0x1B873593u;
  h ^= k; h = rotl32(h, 13); return h * 5u + 0xE6546B64u;
}
inline uint32_t murmur_index(uint64_t i, uint32_t seed) {
  uint32_t h = mix(seed, (uint32_t)i);
  h = mix(h, (uint32_t)(i >> 32));
  h ^= 8u;
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
  return h;
}
inline uint32_t f2bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
inline float bits2f(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

// IEEE half -> float32 bit pattern of its absolute value (exact).
inline uint32_t half_abs_to_f32_bits(uint16_t h) {
  uint32_t a = h & 0x7FFFu, e = a >> 10, mant = a & 0x3FFu;
  if (e == 0x1F) return 0x7F800000u | (mant << 13);               // Inf / NaN
  if (e != 0) return ((e + 112u) << 23) | (mant << 13);           // normal: rebias 15 -> 127
  if (mant == 0) return 0;
  int sh = 0;                                                     // subnormal: normalise
  while (!(mant & 0x400u)) { mant <<= 1; ++sh; }
  return ((uint32_t)(113 - sh) << 23) | ((mant & 0x3FFu) << 13);
}

inline int elem_size(int dtype) { return dtype == F64 ? 8 : (dtype == F32 ? 4 : 2); }

// float32 bits of mag = float32(|x|) with NaN -> +Inf, for element i.
inline uint32_t mag_bits(const void* x, int dtype, int64_t i) {
  switch (dtype) {
    case F32: { uint32_t a = ((const uint32_t*)x)[i] & 0x7FFFFFFFu; return a > kInfBits ? kInfBits : a; }
    case BF16: { uint32_t a = ((const uint16_t*)x)[i] & 0x7FFFu; return a > 0x7F80u ? kInfBits : a << 16; }
    case F16: { uint16_t a = ((const uint16_t*)x)[i] & 0x7FFFu; return a > 0x7C00u ? kInfBits : half_abs_to_f32_bits(a); }
    default: {
      double d = ((const double*)x)[i];
      if (d != d) return kInfBits;
      return f2bits((float)(d < 0 ? -d : d));
    }
  }
}

template <typename F>
void parallel_for(int64_t n, int nthreads, int64_t align, F&& body) {
  if (nthreads < 1) nthreads = 1;
  int64_t chunk = (n + nthreads - 1) / nthreads;
  chunk = (chunk + align - 1) / align * align;
#ifdef _OPENMP
  // torch's pool: right after a torch op its workers are still spin-waiting for work; threads of our
  // own would compete with them for the cores (measured: table phase 11.7 ms instead of 6.3 ms at 2^24
  // on 2 cores). A smaller team than asked for runs the remaining chunks in turn.
  if (nthreads > 1 && chunk < n) {
#pragma omp parallel num_threads(nthreads)
    {
      const int team = omp_get_num_threads();
      for (int t = omp_get_thread_num(); t < nthreads; t += team) {
        const int64_t lo = t * chunk, hi = std::min(n, lo + chunk);
        if (lo < hi) body(t, lo, hi);
      }
    }
    return;
  }
#endif
  std::vector<std::thread> pool;
  for (int t = 1; t < nthreads; ++t) {
    int64_t lo = t * chunk, hi = std::min(n, lo + chunk);
    if (lo < hi) pool.emplace_back([=, &body] { body(t, lo, hi); });
  }
  body(0, 0, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

inline void atomic_max(int64_t* p, int64_t v) {
  int64_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

// Cache-blocked sink: the table is cut into P partitions of psize slots (each fits in L2); a thread appends
// each selected element's (key, slot - p*psize) to its own bucket of partition p, in sequential memory.
// A second phase then applies each partition's buckets with a plain max while that part of the table
// is in cache (no atomics: one thread owns a partition). A full bucket (many more candidates than
// expected: a threshold far below the k-th largest) switches its thread to atomic max stores into the
// table for the rest of its range, after every partition has been filled with EMPTY once (ready()); the
// apply phase then skips those fills and still applies what the buckets hold. No second scan of the buffer.
struct Buckets {
  int P = 0; int64_t psize = 0, cap = 0, m = 0; uint64_t pdiv_c = 0;
  int64_t* keys = nullptr; uint32_t* loc = nullptr; int64_t* count = nullptr;  // [nt][P][cap], [nt][P]
  char* vals = nullptr;      // [nt][P][cap] elements of esize bytes, when the table carries values (vtab)
  int64_t* table = nullptr;
  char* vtab = nullptr;      // [m] elements of esize bytes: the winner's value per slot (or nullptr)
  int esize = 4;
  int* state = nullptr;  // [P]: 0 untouched, 1 being filled, 2 filled with EMPTY (atomics)
  inline int part(uint64_t slot) const {  // slot / psize, exact for slot < 2^32 (Lemire; psize 1: c = 0)
    return pdiv_c ? (int)(((unsigned __int128)pdiv_c * slot) >> 64) : (int)slot;
  }
  void ready(int p) const {  // partition p filled with EMPTY, exactly once across threads
    if (__atomic_load_n(state + p, __ATOMIC_ACQUIRE) == 2) return;
    int expected = 0;
    if (__atomic_compare_exchange_n(state + p, &expected, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      int64_t* tb = table + p * psize;
      std::fill(tb, tb + std::min(psize, m - p * psize), (int64_t)-1);
      __atomic_store_n(state + p, 2, __ATOMIC_RELEASE);
      return;
    }
    while (__atomic_load_n(state + p, __ATOMIC_ACQUIRE) != 2) std::this_thread::yield();
  }
};

// Selected elements are queued; a full queue is hashed, its table lines prefetched, then stored: the
// random read-modify-writes into the table (larger than L2) overlap instead of stalling one by one.
// With buckets bound (bind()), the queue goes to this thread's partition buckets instead.
struct Store {
  static constexpr int Q = 64;
  const void* x; int dtype; int64_t m; bool direct; uint32_t seed; int ibits; int64_t* table;
  uint64_t fastmod_c;  // Lemire's exact 32-bit modulo: h % m = ((c * h) * m) >> 64, for m < 2^32
  const Buckets* bk = nullptr; int64_t* bkeys = nullptr; uint32_t* bloc = nullptr; int64_t* bcount = nullptr;
  char* bvals = nullptr;
  int64_t idx[Q]; uint64_t slot[Q]; uint32_t mb[Q]; bool has_mb = false; int len = 0;
  Store(const void* x_, int dt, int64_t m_, bool d, uint32_t s, int ib, int64_t* t)
      : x(x_), dtype(dt), m(m_), direct(d), seed(s), ibits(ib), table(t),
        fastmod_c(m_ < (int64_t(1) << 32) ? ~uint64_t(0) / (uint64_t)m_ + 1 : 0) {}
  Store bind(const Buckets* b, int t) const {
    Store st = *this;
    st.bk = b;
    st.bkeys = b->keys + (int64_t)t * b->P * b->cap;
    st.bloc = b->loc + (int64_t)t * b->P * b->cap;
    st.bcount = b->count + (int64_t)t * b->P;
    st.bvals = b->vals ? b->vals + (int64_t)t * b->P * b->cap * b->esize : nullptr;
    return st;
  }
  inline uint64_t mod_m(uint32_t h) const {
    if (fastmod_c) return (uint64_t)(((unsigned __int128)(fastmod_c * h) * (uint64_t)m) >> 64);
    return h % (uint64_t)m;
  }
  inline void operator()(int64_t i) {
    idx[len++] = i;
    if (len == Q) flush();
  }
  // i with its magnitude bits (mag_bits(x, dtype, i)) already at hand: x is not read again.
  inline void push(int64_t i, uint32_t bits) {
    mb[len] = bits;
    idx[len++] = i;
    if (len == Q) flush();
  }
  void flush() {
    if (direct) {  // slot = index: no two writers share a slot
      for (int q = 0; q < len; ++q) table[idx[q]] = key(idx[q]);
    } else if (bk) {
      // locals: the bucket stores (int64_t*) could otherwise alias these fields and force reloads
      const int64_t cap = bk->cap, psize = bk->psize;
      int64_t* const keys = bkeys; uint32_t* const loc = bloc; int64_t* const cnt = bcount;
      char* const vals = bvals;
      const int es = bk->esize;
      int64_t kv[Q]; uint32_t lv[Q]; int pv[Q]; uint64_t vv[Q];
      for (int q = 0; q < len; ++q) {
        const uint64_t sl = mod_m(murmur_index((uint64_t)idx[q], seed));
        const int p = bk->part(sl);
        pv[q] = p;
        lv[q] = (uint32_t)(sl - (uint64_t)p * psize);
        kv[q] = has_mb ? key_of(idx[q], mb[q]) : key(idx[q]);
        if (vals) vv[q] = raw_bits(idx[q]);  // just scanned: in cache
      }
      for (int q = 0; q < len; ++q) {
        const int p = pv[q];
        const int64_t c = cnt[p];
        if (c == cap) {  // this thread stores the rest of its range with atomic max
          for (int r = 0; r < bk->P; ++r) bk->ready(r);
          for (int r = q; r < len; ++r) atomic_max(table + pv[r] * psize + lv[r], kv[r]);
          bk = nullptr;
          break;
        }
        keys[(int64_t)p * cap + c] = kv[q];
        loc[(int64_t)p * cap + c] = lv[q];
        if (vals) {
          const int64_t at = (int64_t)p * cap + c;
          if (es == 4) ((uint32_t*)vals)[at] = (uint32_t)vv[q];
          else if (es == 2) ((uint16_t*)vals)[at] = (uint16_t)vv[q];
          else ((uint64_t*)vals)[at] = vv[q];
        }
        cnt[p] = c + 1;
      }
    } else {
      for (int q = 0; q < len; ++q) {
        slot[q] = mod_m(murmur_index((uint64_t)idx[q], seed));
        __builtin_prefetch(table + slot[q], 1);
      }
      for (int q = 0; q < len; ++q) atomic_max(table + slot[q], has_mb ? key_of(idx[q], mb[q]) : key(idx[q]));
    }
    len = 0;
  }
  inline int64_t key(int64_t i) const { return key_of(i, mag_bits(x, dtype, i)); }
  inline uint64_t raw_bits(int64_t i) const {
    switch (dtype) {
      case F32: return ((const uint32_t*)x)[i];
      case F64: return ((const uint64_t*)x)[i];
      default: return ((const uint16_t*)x)[i];
    }
  }
  inline int64_t key_of(int64_t i, uint32_t bits) const { return ((int64_t)(bits >> (ibits - 32)) << ibits) | i; }
};

// Scan [lo, hi) of magnitude keys (sign bit masked off) against thr_key; on x86 16 keys at a time with
// SSE2 compares and a movemask, so only the set bits (the ~density fraction selected) cost a branch.
template <typename T>
inline void scan_tail(const T* a, T mask, T thr_key, int64_t i, int64_t hi, Store& st) {
  for (; i < hi; ++i)
    if ((T)(a[i] & mask) >= thr_key) st(i);
}

#ifndef PF_DIST
#define PF_DIST 2048
#endif
#if defined(__x86_64__)
__attribute__((target("avx2"))) void scan32_avx2(const int32_t* a, int32_t thr_key, int64_t lo, int64_t hi,
                                                 Store st) {
  int64_t i = lo;
  const __m256i msk = _mm256_set1_epi32(0x7FFFFFFF), t = _mm256_set1_epi32(thr_key - 1);
  for (; i + 32 <= hi; i += 32) {
    const __m256i* p = (const __m256i*)(a + i);
    _mm_prefetch((const char*)(a + i) + PF_DIST, _MM_HINT_T0);
    _mm_prefetch((const char*)(a + i) + PF_DIST + 64, _MM_HINT_T0);
    __m256i c0 = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_loadu_si256(p), msk), t);
    __m256i c1 = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_loadu_si256(p + 1), msk), t);
    __m256i c2 = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_loadu_si256(p + 2), msk), t);
    __m256i c3 = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_loadu_si256(p + 3), msk), t);
    __m256i any = _mm256_or_si256(_mm256_or_si256(c0, c1), _mm256_or_si256(c2, c3));
    if (_mm256_testz_si256(any, any)) continue;
    uint32_t bits = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(c0)) |
                    (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(c1)) << 8 |
                    (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(c2)) << 16 |
                    (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(c3)) << 24;
    while (bits) { st(i + __builtin_ctz(bits)); bits &= bits - 1; }
  }
  scan_tail<int32_t>(a, 0x7FFFFFFF, thr_key, i, hi, st);
  st.flush();
}
#endif

#if defined(__x86_64__)
// AVX-512: branch-free. Each 16-key compare mask compresses the matching offsets into a small buffer
// (no data-dependent branch per block, so the streaming loads are never squashed by a mispredict);
// the buffer is handed to the store once per chunk of CH keys.
__attribute__((target("avx512f,popcnt"))) void scan32_avx512(const int32_t* a, int32_t thr_key, int64_t lo,
                                                              int64_t hi, Store st) {
  constexpr int CH = 2048;
  alignas(64) uint32_t off[CH + 16];
  alignas(64) uint32_t mag[CH + 16];
  st.has_mb = true;
  const __m512i inf = _mm512_set1_epi32((int)kInfBits);
  const __m512i msk = _mm512_set1_epi32(0x7FFFFFFF), t = _mm512_set1_epi32(thr_key - 1);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  int64_t i = lo;
  for (; i + CH <= hi; i += CH) {
    const int32_t* b = a + i;
    __m512i id = iota;
    uint32_t cnt = 0;
    for (int j = 0; j < CH; j += 64) {
      _mm_prefetch((const char*)(b + j) + PF_DIST, _MM_HINT_T0);
      _mm_prefetch((const char*)(b + j) + PF_DIST + 64, _MM_HINT_T0);
      _mm_prefetch((const char*)(b + j) + PF_DIST + 128, _MM_HINT_T0);
      _mm_prefetch((const char*)(b + j) + PF_DIST + 192, _MM_HINT_T0);
      for (int u = 0; u < 4; ++u) {
        const __m512i v = _mm512_and_si512(_mm512_loadu_si512(b + j + 16 * u), msk);
        __mmask16 k = _mm512_cmpgt_epi32_mask(v, t);
        _mm512_storeu_si512(off + cnt, _mm512_maskz_compress_epi32(k, id));
        _mm512_storeu_si512(mag + cnt, _mm512_maskz_compress_epi32(k, _mm512_min_epu32(v, inf)));  // NaN -> Inf
        cnt += (uint32_t)__builtin_popcount((unsigned)k);
        id = _mm512_add_epi32(id, step);
      }
    }
    for (uint32_t c = 0; c < cnt; ++c) st.push(i + off[c], mag[c]);
  }
  st.flush();
  st.has_mb = false;
  scan_tail<int32_t>(a, 0x7FFFFFFF, thr_key, i, hi, st);
  st.flush();
}
#endif

// Widest vector path the CPU has (kIsa*); callers may ask for a narrower one (tests of every path).
enum Isa { kIsaAuto = 0, kIsaScalar = 1, kIsaSse2 = 2, kIsaAvx2 = 3, kIsaAvx512 = 4 };
int best_isa() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return kIsaAvx512;
  if (__builtin_cpu_supports("avx2")) return kIsaAvx2;
#endif
#if defined(__SSE2__)
  return kIsaSse2;
#else
  return kIsaScalar;
#endif
}
inline int effective_isa(int isa) { return isa <= kIsaAuto ? best_isa() : std::min(isa, best_isa()); }

void scan32(const int32_t* a, int32_t thr_key, int64_t lo, int64_t hi, Store st, int isa) {
#if defined(__x86_64__)
  if (isa >= kIsaAvx512) return scan32_avx512(a, thr_key, lo, hi, st);
  if (isa >= kIsaAvx2) return scan32_avx2(a, thr_key, lo, hi, st);
#endif
  int64_t i = lo;
#if defined(__SSE2__)
  if (isa >= kIsaSse2) {
    const __m128i msk = _mm_set1_epi32(0x7FFFFFFF), t = _mm_set1_epi32(thr_key - 1);  // v > t-1 <=> v >= t
    for (; i + 16 <= hi; i += 16) {
      const __m128i* p = (const __m128i*)(a + i);
      __m128i c0 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(p), msk), t);
      __m128i c1 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(p + 1), msk), t);
      __m128i c2 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(p + 2), msk), t);
      __m128i c3 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(p + 3), msk), t);
      unsigned bits = (unsigned)_mm_movemask_epi8(_mm_packs_epi16(_mm_packs_epi32(c0, c1), _mm_packs_epi32(c2, c3)));
      while (bits) { st(i + __builtin_ctz(bits)); bits &= bits - 1; }
    }
  }
#endif
  scan_tail<int32_t>(a, 0x7FFFFFFF, thr_key, i, hi, st);
  st.flush();
}

void scan16(const int16_t* a, int16_t thr_key, int64_t lo, int64_t hi, Store st, int isa) {
  int64_t i = lo;
#if defined(__SSE2__)
  if (isa >= kIsaSse2) {
    const __m128i msk = _mm_set1_epi16(0x7FFF), t = _mm_set1_epi16((int16_t)(thr_key - 1));
    for (; i + 16 <= hi; i += 16) {
      const __m128i* p = (const __m128i*)(a + i);
      __m128i c0 = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(p), msk), t);
      __m128i c1 = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(p + 1), msk), t);
      unsigned bits = (unsigned)_mm_movemask_epi8(_mm_packs_epi16(c0, c1));
      while (bits) { st(i + __builtin_ctz(bits)); bits &= bits - 1; }
    }
  }
#endif
  scan_tail<int16_t>(a, 0x7FFF, thr_key, i, hi, st);
  st.flush();
}

void scan_f64(const double* a, float thr, int64_t lo, int64_t hi, Store st) {
  for (int64_t i = lo; i < hi; ++i) {
    double d = a[i];
    float f = (float)(d < 0 ? -d : d);
    if (d != d || (f >= thr && f > 0.0f)) st(i);
  }
  st.flush();
}

}  // namespace

extern "C" {

// The vector path the scan takes for isa (0: the CPU's best), after clamping to what the CPU has.
int dragonn_isa(int isa) { return effective_isa(isa); }

// Largest finite-magnitude sample statistic: the kk-th largest of s sampled magnitudes (non-finite -> 0).
// Positions: stratum j = [j*n/s, (j+1)*n/s), one element at murmur3(j, seed) % stratum length.
float dragonn_sample_kth(const void* x, int dtype, int64_t n, int64_t s, int64_t kk, uint32_t seed,
                         uint32_t* scratch, int nthreads) {
  const int64_t q = n / s, r = n % s;
  // Stratum bounds advance incrementally: start_{j+1} = start_j + q + [rem_j + r >= s] with
  // rem_j = j*r mod s (one 128-bit division per thread, not two per sample); the stratum length is
  // q or q + 1, reduced with Lemire's exact 32-bit modulo (h < 2^32; a length >= 2^32 leaves h as is).
  const uint64_t c_q = q < (int64_t(1) << 32) ? ~uint64_t(0) / (uint64_t)q + 1 : 0;
  const uint64_t c_q1 = q + 1 < (int64_t(1) << 32) ? ~uint64_t(0) / (uint64_t)(q + 1) + 1 : 0;
  // kk much smaller than s (the usual density): each thread keeps only its kk largest in a min-heap (about
  // kk·ln(s/kk) pushes, otherwise one compare per sample) and the kk-th largest of their union is the
  // kk-th largest of the sample; a full nth_element over s values cost ~7 ns per sample.
  const int nt = s < (1 << 12) ? 1 : std::max(1, nthreads);  // scattered reads: latency-bound, so threads help early
  const bool use_heap = kk * 32 <= s && kk * nt <= s;
  std::vector<std::vector<uint32_t>> heaps(use_heap ? nt : 0);
  parallel_for(s, nt, 64, [&](int t, int64_t lo, int64_t hi) {
    std::vector<uint32_t>* hp = use_heap ? &heaps[t] : nullptr;
    if (hp) hp->reserve((size_t)kk);
    // Software pipeline: the positions of batch b+1 are computed and their lines prefetched before
    // the reads of batch b, so about 2Q scattered reads are in flight.
    constexpr int Q = 64;
    int64_t pos[2][Q];
    const int esize = elem_size(dtype);
    const __int128 jr = (__int128)lo * r;
    int64_t start = lo * q + (int64_t)(jr / s), rem = (int64_t)(jr % s);
    auto positions = [&](int64_t j0, int64_t* out) {
      const int cnt = (int)std::min<int64_t>(Q, hi - j0);
      for (int c = 0; c < cnt; ++c) {
        const uint32_t h = murmur_index((uint64_t)(j0 + c), seed);
        rem += r;
        const bool carry = rem >= s;
        if (carry) rem -= s;
        const uint64_t len = (uint64_t)q + carry, cm = carry ? c_q1 : c_q;
        const uint64_t off = cm ? (uint64_t)(((unsigned __int128)(cm * h) * len) >> 64)
                                : (len > 0xFFFFFFFFull ? (uint64_t)h : h % len);
        out[c] = start + (int64_t)off;
        start += (int64_t)len;
        __builtin_prefetch((const char*)x + out[c] * esize);
      }
    };
    if (lo < hi) positions(lo, pos[0]);
    for (int64_t j0 = lo, b = 0; j0 < hi; j0 += Q, b ^= 1) {
      if (j0 + Q < hi) positions(j0 + Q, pos[b ^ 1]);
      const int cnt = (int)std::min<int64_t>(Q, hi - j0);
      for (int c = 0; c < cnt; ++c) {
        const uint32_t v = mag_bits(x, dtype, pos[b][c]);
        const uint32_t w = v >= kInfBits ? 0u : v;  // non-finite -> 0; finite bits order = value order
        if (!hp) {
          scratch[j0 + c] = w;
        } else if ((int64_t)hp->size() < kk) {
          hp->push_back(w);
          std::push_heap(hp->begin(), hp->end(), std::greater<uint32_t>());
        } else if (w > hp->front()) {
          std::pop_heap(hp->begin(), hp->end(), std::greater<uint32_t>());
          hp->back() = w;
          std::push_heap(hp->begin(), hp->end(), std::greater<uint32_t>());
        }
      }
    }
  });
  int64_t len = s;
  if (use_heap) {  // union of the per-thread top-kk (at most nt·kk <= s values) into scratch
    len = 0;
    for (const auto& h : heaps) {
      std::copy(h.begin(), h.end(), scratch + len);
      len += (int64_t)h.size();
    }
  }
  std::nth_element(scratch, scratch + (kk - 1), scratch + len, [](uint32_t a, uint32_t b) { return a > b; });
  return bits2f(scratch[kk - 1]);
}

}  // extern "C"

namespace {
// One bucket into its partition of the table (plain max) and of the value table (the winner's value).
template <typename V>
inline void apply_with_values(int64_t* tb, V* vt, const int64_t* kk, const uint32_t* ll, const V* vv,
                              int64_t c) {
  for (int64_t i = 0; i < c; ++i) {
    const int64_t v = kk[i];
    const uint32_t l = ll[i];
    if (v > tb[l]) {  // mostly true: few slots see a second candidate
      tb[l] = v;
      vt[l] = vv[i];
    }
  }
}

// One pass over x: every selected element goes to st (per thread: st_for(t)).
template <typename StoreFor>
void scan_all(const void* x, int dtype, int64_t n, float thr, int nt, int isa, StoreFor&& st_for) {
  uint32_t t32 = thr > 0.0f ? f2bits(thr) : 1u;  // thr <= 0: every nonzero (key >= 1)
  if (dtype == F32) {
    parallel_for(n, nt, 64, [&](int t, int64_t lo, int64_t hi) {
      scan32((const int32_t*)x, (int32_t)t32, lo, hi, st_for(t), isa);
    });
  } else if (dtype == BF16 || dtype == F16) {
    // smallest 16-bit magnitude pattern whose float32 value is >= thr (patterns order = value order)
    int32_t lo = 1, hi = dtype == BF16 ? 0x7F80 : 0x7C00;  // +Inf pattern always qualifies
    while (lo < hi) {
      int32_t mid = (lo + hi) / 2;
      uint32_t b = dtype == BF16 ? (uint32_t)mid << 16 : half_abs_to_f32_bits((uint16_t)mid);
      if (b >= t32) hi = mid; else lo = mid + 1;
    }
    parallel_for(n, nt, 64, [&](int t, int64_t a, int64_t b) {
      scan16((const int16_t*)x, (int16_t)lo, a, b, st_for(t), isa);
    });
  } else {
    parallel_for(n, nt, 64, [&](int t, int64_t lo, int64_t hi) {
      scan_f64((const double*)x, thr, lo, hi, st_for(t));
    });
  }
}
}  // namespace

extern "C" {

// Fill table[m] with -1, then store the key of every selected element (see the header comment).
// thr must not be NaN (the caller handles that: nothing is selected).
// block_bytes: target bytes of table per partition of the cache-blocked path (0: default, 1 MiB; < 0:
// no blocking, atomic stores); bucket_cap: slots per (thread, partition) bucket (0: default). Both only
// tune speed (tests use small values to reach the partition and spill boundaries). isa: widest vector
// path of the scan (0: the CPU's best; 1 scalar, 2 SSE2, 3 AVX2, 4 AVX-512; clamped to what the CPU has).
// vtab: nullptr, or m elements of x's dtype that receive each slot's winning value where the cache-blocked
// path runs without a spill; the return value says whether it did (1: every valid slot's value is in
// vtab, so the gather need not read x; 0: vtab is not filled).
int dragonn_build_table(const void* x, int dtype, int64_t n, float thr, int64_t m, uint32_t seed, int ibits,
                        int64_t* table, int nthreads, int64_t block_bytes, int64_t bucket_cap, int isa,
                        void* vtab) {
  isa = effective_isa(isa);
  int nt = n < (1 << 16) ? 1 : std::max(1, nthreads);
  Store st(x, dtype, m, m >= n, seed, ibits, table);
  if (block_bytes == 0) block_bytes = int64_t(1) << 20;
  const int64_t min_blocked = int64_t(1) << 15;  // below: the table is in L2 anyway
  if (!st.direct && block_bytes > 0 && m < (int64_t(1) << 32) && (m >= min_blocked || bucket_cap > 0)) {
    Buckets bk;
    int64_t P = std::max<int64_t>(1, (m * 8 + block_bytes - 1) / block_bytes);
    P = (P + nt - 1) / nt * nt;                 // whole partitions per thread in the apply phase
    P = std::min<int64_t>(P, m);
    bk.P = (int)P;
    bk.psize = (m + P - 1) / P;
    P = bk.P = (int)((m + bk.psize - 1) / bk.psize);
    bk.pdiv_c = ~uint64_t(0) / (uint64_t)bk.psize + 1;
    // Expected candidates ~ m / table_factor spread evenly over partitions; a bucket holds half a
    // partition, so even one thread holding every candidate (up to ~2x the expected count) fits.
    bk.cap = std::min(bucket_cap > 0 ? bucket_cap : bk.psize / 2 + 64, 2 * bk.psize + 64);
    const int64_t nb = (int64_t)nt * P;
    // not initialised: only the pages that receive candidates are touched
    std::unique_ptr<int64_t[]> keys(new (std::nothrow) int64_t[nb * bk.cap]);
    std::unique_ptr<uint32_t[]> loc(new (std::nothrow) uint32_t[nb * bk.cap]);
    const int esize = elem_size(dtype);
    std::unique_ptr<char[]> vals(vtab ? new (std::nothrow) char[nb * bk.cap * esize] : nullptr);
    std::vector<int64_t> count(nb, 0);
    std::vector<int> state(P, 0);
    if (!keys || !loc) goto atomic;  // no memory for the buckets: the atomic path needs none
    bk.keys = keys.get(); bk.loc = loc.get(); bk.count = count.data();
    bk.vals = vals.get(); bk.vtab = (char*)vtab; bk.esize = esize;
    bk.table = table; bk.m = m; bk.state = state.data();
    scan_all(x, dtype, n, thr, nt, isa, [&](int t) { return st.bind(&bk, t); });
    // a spill stored keys without values: then the gather reads x
    const bool with_values = bk.vals && std::all_of(state.begin(), state.end(), [](int v) { return v == 0; });
    {
      parallel_for(P, nt, 1, [&](int, int64_t plo, int64_t phi) {
        for (int64_t p = plo; p < phi; ++p) {
          int64_t* tb = table + p * bk.psize;
          const int64_t len = std::min(bk.psize, m - p * bk.psize);
          if (state[p] != 2) std::fill(tb, tb + len, (int64_t)-1);  // else: filled before a spill
          // sequential first touch: the random stores below then hit cache (measured 1.5 ms less at 2^24)
          if (with_values) std::memset(bk.vtab + p * bk.psize * bk.esize, 0, len * bk.esize);
          for (int t = 0; t < nt; ++t) {
            const int64_t b = (int64_t)t * P + p, c = count[b];
            const int64_t* kk = bk.keys + b * bk.cap;
            const uint32_t* ll = bk.loc + b * bk.cap;
            if (with_values) {
              const char* vv = bk.vals + b * bk.cap * bk.esize;
              char* vt = bk.vtab + p * bk.psize * bk.esize;
              if (bk.esize == 4) apply_with_values<uint32_t>(tb, (uint32_t*)vt, kk, ll, (const uint32_t*)vv, c);
              else if (bk.esize == 2) apply_with_values<uint16_t>(tb, (uint16_t*)vt, kk, ll, (const uint16_t*)vv, c);
              else apply_with_values<uint64_t>(tb, (uint64_t*)vt, kk, ll, (const uint64_t*)vv, c);
            } else {
              for (int64_t i = 0; i < c; ++i) {
                const int64_t v = kk[i];
                int64_t& cell = tb[ll[i]];
                cell = v > cell ? v : cell;
              }
            }
          }
        }
      });
      return with_values ? 1 : 0;
    }
  }
atomic:
  parallel_for(m, m < (1 << 16) ? 1 : nt, 8, [&](int, int64_t lo, int64_t hi) {
    std::fill(table + lo, table + hi, (int64_t)-1);
  });
  scan_all(x, dtype, n, thr, nt, isa, [&](int) { return st; });
  return 0;
}

}  // extern "C"

namespace {
// Valid slots of table[lo, hi) with their values from vt, compacted to positions lo.. of the outputs.
// Branch-free (about a quarter of the slots are valid, at random): every slot is written at the
// current end and the end advances only for a valid one. Returns the end.
template <typename V, typename I>
int64_t compact_slots(const int64_t* table, const void* vtab, int64_t lo, int64_t hi, int64_t imask,
                      void* idx_out, void* val_out) {
  const V* vt = (const V*)vtab;
  I* io = (I*)idx_out;
  V* vo = (V*)val_out;
  int64_t w = lo;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t v = table[i];
    io[w] = (I)(v & imask);
    vo[w] = vt[i];
    w += (int64_t)(v >= 0);
  }
  return w;
}
}  // namespace

extern "C" {

// Valid slots in slot order -> indices (int32 or int64) and values (esize-byte elements). Returns count.
// vtab: nullptr (values read from x at the kept indices: scattered reads), or the per-slot values that
// dragonn_build_table filled (read in slot order, next to the table).
int64_t dragonn_gather(const int64_t* table, int64_t m, int ibits, const void* x, int esize, void* idx_out,
                       int idx64, void* val_out, int nthreads, const void* vtab) {
  const int64_t imask = (int64_t)((((uint64_t)1) << ibits) - 1);
  int nt = m < (1 << 16) ? 1 : std::max(1, nthreads);
  // One pass over the table: thread t compacts its slots [lo, hi) to output positions [lo, lo + c_t)
  // (c_t <= hi - lo, so the threads' outputs never overlap); the parts then slide down in order.
  std::vector<int64_t> counts(nt + 1, 0), starts(nt, 0);
  parallel_for(m, nt, 1, [&](int t, int64_t lo, int64_t hi) {
    // Software pipeline over blocks of B slots: compact block b (indices out, their lines of x
    // prefetched), then copy the values of block b-1, whose reads have had a block's time to arrive.
    constexpr int B = 512;
    if (vtab) {
      int64_t w;
      if (esize == 4) w = idx64 ? compact_slots<uint32_t, int64_t>(table, vtab, lo, hi, imask, idx_out, val_out)
                                : compact_slots<uint32_t, int32_t>(table, vtab, lo, hi, imask, idx_out, val_out);
      else if (esize == 2) w = idx64 ? compact_slots<uint16_t, int64_t>(table, vtab, lo, hi, imask, idx_out, val_out)
                                     : compact_slots<uint16_t, int32_t>(table, vtab, lo, hi, imask, idx_out, val_out);
      else w = idx64 ? compact_slots<uint64_t, int64_t>(table, vtab, lo, hi, imask, idx_out, val_out)
                     : compact_slots<uint64_t, int32_t>(table, vtab, lo, hi, imask, idx_out, val_out);
      starts[t] = lo;
      counts[t + 1] = w - lo;
      return;
    }
    int64_t buf[2][B];
    int cnt[2] = {0, 0};
    int64_t o = lo;  // output position of the pending block's first value
    auto values = [&](const int64_t* ix, int c, int64_t at) {
      for (int q = 0; q < c; ++q)
        std::memcpy((char*)val_out + (at + q) * esize, (const char*)x + ix[q] * esize, esize);
    };
    int cur = 0;
    int64_t w = o;  // output position for indices
    for (int64_t b0 = lo; b0 < hi; b0 += B) {
      const int64_t b1 = std::min(hi, b0 + B);
      int c = 0;
      for (int64_t i = b0; i < b1; ++i) {
        const int64_t v = table[i];
        if (v < 0) continue;
        const int64_t idx = v & imask;
        __builtin_prefetch((const char*)x + idx * esize);
        buf[cur][c++] = idx;
      }
      if (idx64) {
        std::memcpy((int64_t*)idx_out + w, buf[cur], c * sizeof(int64_t));
      } else {
        int32_t* out = (int32_t*)idx_out + w;
        for (int q = 0; q < c; ++q) out[q] = (int32_t)buf[cur][q];
      }
      w += c;
      cnt[cur] = c;
      cur ^= 1;
      if (cnt[cur]) { values(buf[cur], cnt[cur], o); o += cnt[cur]; cnt[cur] = 0; }
    }
    cur ^= 1;
    if (cnt[cur]) values(buf[cur], cnt[cur], o);
    starts[t] = lo;
    counts[t + 1] = w - lo;
  });
  const int isz = idx64 ? 8 : 4;
  for (int t = 0; t < nt; ++t) {
    counts[t + 1] += counts[t];
    const int64_t c = counts[t + 1] - counts[t];
    if (c && starts[t] != counts[t]) {  // destination below the source: memmove, in thread order
      std::memmove((char*)idx_out + counts[t] * isz, (char*)idx_out + starts[t] * isz, c * isz);
      std::memmove((char*)val_out + counts[t] * esize, (char*)val_out + starts[t] * esize, c * esize);
    }
  }
  return counts[nt];
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------------------
// Sparse updates of a dense buffer at ~k scattered positions: the decode (clear the previous step's
// positions, add every rank's pairs, scale the sums) and the error-feedback commit (residual at the sent
// positions). torch's index ops stall on one cache miss after another (~25 ns a position for 2^24
// elements); here the lines are prefetched PF positions ahead, so the misses overlap.
// dst dtype: F32, BF16 or F64 (bf16: float32 arithmetic, rounded to nearest even, NaN kept quiet: what
// torch's CPU index_add_ does element by element). src has dst's dtype. Positions within one call must be
// distinct for mode ADD with threads (each rank's pairs are); SET/ZERO tolerate duplicates only with
// equal values, which the callers guarantee.
namespace {
constexpr int kPf = 16;
inline float bf16_to_f(uint16_t h) { return bits2f((uint32_t)h << 16); }
inline uint16_t f_to_bf16(float f) {
  uint32_t b = f2bits(f);
  if ((b & 0x7FFFFFFFu) > kInfBits) return (uint16_t)((b >> 16) | 0x40u);  // quiet NaN
  b += 0x7FFFu + ((b >> 16) & 1u);
  return (uint16_t)(b >> 16);
}
// Calls op(j, element pointer) for the c positions idx[j] of dst, prefetching kPf positions ahead.
template <typename I, typename Op>
void sparse_loop(const I* idx, int64_t c, int nthreads, char* dst, int esize, Op&& op) {
  const int nt = c < (1 << 15) ? 1 : std::max(1, nthreads);
  parallel_for(c, nt, 64, [&](int, int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      if (j + kPf < hi) __builtin_prefetch(dst + (int64_t)idx[j + kPf] * esize, 1);
      op(j, dst + (int64_t)idx[j] * esize);
    }
  });
}
// The typed update, written once for every way of reaching the elements: loop(op) calls op(j, element
// pointer) for each of the positions. mode 0: *e = src[j]; 1: *e += src[j]; 2: *e = 0;
// 3: tmp[j] = *e * scale. Returns -1 for an unsupported dtype or mode.
template <typename Loop>
int update_elements(int dtype, int mode, const void* src, double scale, void* tmp, Loop&& loop) {
  if (mode < 0 || mode > 3) return -1;
  if (dtype == F32 || dtype == F64) {
    auto run = [&](auto zero) {
      using T = decltype(zero);
      const T* s = (const T*)src; T* t = (T*)tmp; const T sc = (T)scale;
      if (mode == 0) loop([&](int64_t j, char* e) { *(T*)e = s[j]; });
      else if (mode == 1) loop([&](int64_t j, char* e) { *(T*)e += s[j]; });
      else if (mode == 2) loop([&](int64_t, char* e) { *(T*)e = zero; });
      else loop([&](int64_t j, char* e) { t[j] = *(const T*)e * sc; });
    };
    if (dtype == F32) run(0.0f); else run(0.0);
    return 0;
  }
  if (dtype == BF16) {
    const uint16_t* s = (const uint16_t*)src; uint16_t* t = (uint16_t*)tmp;
    // torch multiplies a bf16 tensor by a Python scalar in float32 (the scalar rounded to float32)
    const float sc = (float)scale;
    if (mode == 0) loop([&](int64_t j, char* e) { *(uint16_t*)e = s[j]; });
    else if (mode == 1) loop([&](int64_t j, char* e) { *(uint16_t*)e = f_to_bf16(bf16_to_f(*(uint16_t*)e) + bf16_to_f(s[j])); });
    else if (mode == 2) loop([&](int64_t, char* e) { *(uint16_t*)e = 0; });
    else loop([&](int64_t j, char* e) { t[j] = f_to_bf16(bf16_to_f(*(const uint16_t*)e) * sc); });
    return 0;
  }
  return -1;
}
}  // namespace

extern "C" {
// See the block comment above. Returns 0, or -1 for a dtype this path does not handle (F16).
int dragonn_sparse_update(void* dst, int dtype, const void* idx, int idx64, int64_t count, const void* src,
                          int mode, double scale, void* tmp, int nthreads) {
  if (count <= 0) return (dtype == F32 || dtype == F64 || dtype == BF16) ? 0 : -1;
  const int es = elem_size(dtype);
  char* d = (char*)dst;
  return update_elements(dtype, mode, src, scale, tmp, [&](auto&& op) {
    if (idx64) sparse_loop((const int64_t*)idx, count, nthreads, d, es, op);
    else sparse_loop((const int32_t*)idx, count, nthreads, d, es, op);
  });
}
}  // extern "C"

// ---------------------------------------------------------------------------------------------------------
// Error-feedback compensation: res[seg] += alpha * g_s for every gradient segment s of the bucket, in
// place (res is the persistent residual, float32 or float64; g_s float32, bfloat16 or float64). One pass,
// no flattened copy of the bucket; torch's mixed-dtype in-place add (fp32 += bf16) costs ~3x this.
// alpha == 1: one rounding (res + g), as torch's add_; else res + (g * alpha) rounded twice.
namespace {
template <typename R, typename G, typename Conv>
void compensate_seg(R* res, const R* src, G* g, int64_t len, R alpha, bool scaled, bool zero, int nthreads,
                    Conv conv) {
  const int nt = len < (1 << 16) ? 1 : std::max(1, nthreads);
  parallel_for(len, nt, 64, [&](int, int64_t lo, int64_t hi) {
    constexpr int64_t B = 2048;  // zero each block of g right after reading it, while it is in L1
    for (int64_t b0 = lo; b0 < hi; b0 += B) {
      const int64_t b1 = std::min(hi, b0 + B);
      if (scaled) {
        for (int64_t i = b0; i < b1; ++i) res[i] = src[i] + conv(g[i]) * alpha;
      } else {
        for (int64_t i = b0; i < b1; ++i) res[i] = src[i] + conv(g[i]);
      }
      if (zero) std::memset((void*)(g + b0), 0, (size_t)(b1 - b0) * sizeof(G));
    }
  });
}
}  // namespace

extern "C" {
// Returns 0, or -1 for a dtype pair this path does not handle (the caller uses torch).
// zero: also set every gradient to 0 in the same pass (the decode then adds the reduced pairs into them).
// res = src + alpha * g; src may be res (in place) or another buffer of the same length and dtype (the
// step's working residual written from the last applied one: a skipped step leaves src untouched).
int dragonn_compensate(void* res, const void* src, int rdt, int nseg, void* const* gptrs, const int64_t* lens,
                       int gdt, double alpha, int zero, int nthreads) {
  const bool scaled = alpha != 1.0;
  int64_t off = 0;
  if (rdt == F32 && (gdt == F32 || gdt == BF16)) {
    float* r = (float*)res;
    const float* b = (const float*)src;
    for (int s = 0; s < nseg; off += lens[s], ++s) {
      if (gdt == F32)
        compensate_seg(r + off, b + off, (float*)gptrs[s], lens[s], (float)alpha, scaled, zero, nthreads,
                       [](float v) { return v; });
      else
        compensate_seg(r + off, b + off, (uint16_t*)gptrs[s], lens[s], (float)alpha, scaled, zero, nthreads,
                       [](uint16_t v) { return bits2f((uint32_t)v << 16); });
    }
    return 0;
  }
  if (rdt == F64 && gdt == F64) {
    double* r = (double*)res;
    const double* b = (const double*)src;
    for (int s = 0; s < nseg; off += lens[s], ++s)
      compensate_seg(r + off, b + off, (double*)gptrs[s], lens[s], alpha, scaled, zero, nthreads,
                     [](double v) { return v; });
    return 0;
  }
  return -1;
}
}  // extern "C"

// ---------------------------------------------------------------------------------------------------------
// The same sparse updates addressed through a bucket's separate gradient tensors (segments), so the
// decode can write straight into the gradients: positions are first turned into byte addresses (one
// search of the segment offsets per position), then the update runs over the addresses with prefetch.
namespace {
template <typename I>
void addresses_t(int nseg, const int64_t* ptrs, const int64_t* offsets, int esize, const I* idx, int64_t c,
                 int64_t* out, int nthreads) {
  const int nt = c < (1 << 15) ? 1 : std::max(1, nthreads);
  parallel_for(c, nt, 64, [&](int, int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t i = (int64_t)idx[j];
      // last s with offsets[s] <= i (offsets ascending, offsets[0] = 0, offsets[nseg] = n; empty segments
      // share an offset with the next one and are skipped by taking the last match)
      int64_t a = 0, b = nseg;  // invariant: offsets[a] <= i < offsets[b]
      while (b - a > 1) {
        const int64_t m = (a + b) >> 1;
        if (offsets[m] <= i) a = m; else b = m;
      }
      out[j] = ptrs[a] + (i - offsets[a]) * esize;
    }
  });
}
template <typename Op>
void addr_loop(const int64_t* addr, int64_t c, int nthreads, Op&& op) {
  const int nt = c < (1 << 15) ? 1 : std::max(1, nthreads);
  parallel_for(c, nt, 64, [&](int, int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      if (j + kPf < hi) __builtin_prefetch((const void*)addr[j + kPf], 1);
      op(j, (char*)addr[j]);
    }
  });
}
}  // namespace

extern "C" {
// out[j] = byte address of bucket position idx[j] in the segment that holds it.
void dragonn_segment_addresses(int nseg, const int64_t* ptrs, const int64_t* offsets, int esize, const void* idx,
                               int idx64, int64_t count, int64_t* out, int nthreads) {
  if (count <= 0) return;
  if (idx64) addresses_t(nseg, ptrs, offsets, esize, (const int64_t*)idx, count, out, nthreads);
  else addresses_t(nseg, ptrs, offsets, esize, (const int32_t*)idx, count, out, nthreads);
}

// dragonn_sparse_update's modes over addresses (add: distinct addresses). Returns 0, or -1 for an
// unsupported dtype or mode.
int dragonn_addr_update(int dtype, const int64_t* addr, int64_t count, const void* src, int mode, double scale,
                        void* tmp, int nthreads) {
  if (count <= 0) return 0;
  return update_elements(dtype, mode, src, scale, tmp,
                         [&](auto&& op) { addr_loop(addr, count, nthreads, op); });
}
}  // extern "C"

// ---------------------------------------------------------------------------------------------------------
// Per-tensor selection (compress/segments.py): DRAGONN on each segment [off[s], off[s+1]) of the bucket with
// its own threshold sample, k and table, in one call (no per-tensor loop in Python). Segment s is exactly
// the global selection of the slice x[off[s]:off[s+1]] with the segment's seed (base.segment_seed): local
// index bits, sample of ns[s] positions (0: threshold 0, every nonzero element), the kk[s]-th largest
// sampled magnitude, a table of m[s] slots (0: nothing). Indices come out as bucket positions, segments in
// order, each in its slot order. table: sum m slots; vtab: as many elements of x's dtype; scratch: max ns
// uint32; idx_out / val_out: sum m entries; thr_out: nseg floats. Returns the pair count.
namespace {
inline uint64_t seg_seed(uint64_t seed, int s) { return (seed + (uint64_t)(s + 1) * 0x9E3779B97F4A7C15ull) & 0xFFFFFFFFFFFFull; }
inline uint32_t hash_seed_of(uint64_t v) { return (uint32_t)(v * 0x9E3779B1ull + 0x7F4A7C15ull); }
inline uint32_t sample_seed_of(uint64_t v) { return (uint32_t)(v * 0x85EBCA77ull + 0x165667B1ull); }
inline int local_ibits(int64_t n) {
  int b = 0;
  for (uint64_t v = (uint64_t)(n > 1 ? n - 1 : 0); v; v >>= 1) ++b;
  return b < 32 ? 32 : b;
}
}  // namespace

extern "C" {
// float32 bit pattern of |v| for a value of dtype, NaN -> +Inf (base.magnitude's order).
inline uint32_t value_mag_bits(const char* v, int dtype) {
  uint32_t b;
  if (dtype == F32) { std::memcpy(&b, v, 4); b &= 0x7FFFFFFFu; }
  else if (dtype == F16) { uint16_t h; std::memcpy(&h, v, 2); b = half_abs_to_f32_bits(h); }
  else if (dtype == BF16) { uint16_t h; std::memcpy(&h, v, 2); b = (uint32_t)(h & 0x7FFFu) << 16; }
  else { double d; std::memcpy(&d, v, 8); b = f2bits((float)(d < 0 ? -d : d)) & 0x7FFFFFFFu; }
  return std::min(b, kInfBits);
}

// Keeps the cap largest-magnitude pairs of the c at (idx, val), in their order; ties to the earlier pair
// (base.trim's keys: magnitude bits above the complemented position). Returns the new count.
int64_t cap_pairs(char* idx, int isz, char* val, int es, int dtype, int64_t c, int64_t cap,
                  std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp) {
  if (cap <= 0 || c <= cap) return c;
  keys.resize(c);
  for (int64_t j = 0; j < c; ++j)
    keys[j] = ((uint64_t)value_mag_bits(val + j * es, dtype) << 32) | (0xFFFFFFFFull - (uint64_t)j);
  tmp.assign(keys.begin(), keys.end());
  std::nth_element(tmp.begin(), tmp.begin() + (cap - 1), tmp.end(), std::greater<uint64_t>());
  const uint64_t kth = tmp[cap - 1];
  int64_t w = 0;
  for (int64_t j = 0; j < c; ++j) {
    if (keys[j] < kth) continue;
    if (w != j) { std::memmove(idx + w * isz, idx + j * isz, isz); std::memmove(val + w * es, val + j * es, es); }
    ++w;
  }
  return w;
}

// caps: null, or per segment the most pairs it keeps (0: no cap), the largest by cap_pairs.
int64_t dragonn_select_segments(const void* x, int dtype, int nseg, const int64_t* off, const int64_t* ns,
                                const int64_t* kk, const int64_t* ms, uint64_t seed, int64_t* table, void* vtab,
                                uint32_t* scratch, void* idx_out, int idx64, void* val_out, float* thr_out,
                                int nthreads, int isa, const int64_t* caps) {
  const int es = elem_size(dtype), isz = idx64 ? 8 : 4;
  int64_t w = 0, toff = 0;
  std::vector<uint64_t> keys, tmp;
  for (int s = 0; s < nseg; ++s) {
    const int64_t n = off[s + 1] - off[s], m = ms[s];
    thr_out[s] = 0.0f;
    if (n <= 0 || m <= 0) continue;
    const char* xs = (const char*)x + off[s] * es;
    const uint64_t sd = seg_seed(seed, s);
    const float thr = ns[s] > 0 ? dragonn_sample_kth(xs, dtype, n, ns[s], kk[s], sample_seed_of(sd), scratch, nthreads)
                                : 0.0f;
    thr_out[s] = thr;
    const int ib = local_ibits(n);
    int64_t* tb = table + toff;
    char* vt = (char*)vtab + toff * es;
    const int filled = dragonn_build_table(xs, dtype, n, thr, m, hash_seed_of(sd), ib, tb, nthreads, 0, 0, isa, vt);
    int64_t c = dragonn_gather(tb, m, ib, xs, es, (char*)idx_out + w * isz, idx64, (char*)val_out + w * es,
                               nthreads, filled ? vt : nullptr);
    if (caps) c = cap_pairs((char*)idx_out + w * isz, isz, (char*)val_out + w * es, es, dtype, c, caps[s], keys, tmp);
    if (idx64) { int64_t* io = (int64_t*)idx_out + w; for (int64_t j = 0; j < c; ++j) io[j] += off[s]; }
    else { int32_t* io = (int32_t*)idx_out + w; for (int64_t j = 0; j < c; ++j) io[j] += (int32_t)off[s]; }
    w += c;
    toff += m;
  }
  return w;
}
}  // extern "C"
