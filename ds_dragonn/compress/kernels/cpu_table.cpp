// DRAGONN selection on the CPU: one pass over the buffer, threads from std::thread (no second OpenMP
// runtime next to torch's). Built and loaded by cpu_table.py (ctypes); plain C ABI, no torch headers, so
// it compiles in about a second.
//
// Semantics are those of ds_dragonn/compress/dragonn.py, bit for bit:
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
#include <thread>
#include <vector>
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

// Selected elements are queued; a full queue is hashed, its table lines prefetched, then stored: the
// random read-modify-writes into the table (larger than L2) overlap instead of stalling one by one.
struct Store {
  static constexpr int Q = 64;
  const void* x; int dtype; int64_t m; bool direct; uint32_t seed; int ibits; int64_t* table;
  uint64_t fastmod_c;  // Lemire's exact 32-bit modulo: h % m = ((c * h) * m) >> 64, for m < 2^32
  int64_t idx[Q]; uint64_t slot[Q]; int len = 0;
  Store(const void* x_, int dt, int64_t m_, bool d, uint32_t s, int ib, int64_t* t)
      : x(x_), dtype(dt), m(m_), direct(d), seed(s), ibits(ib), table(t),
        fastmod_c(m_ < (int64_t(1) << 32) ? ~uint64_t(0) / (uint64_t)m_ + 1 : 0) {}
  inline uint64_t mod_m(uint32_t h) const {
    if (fastmod_c) return (uint64_t)(((unsigned __int128)(fastmod_c * h) * (uint64_t)m) >> 64);
    return h % (uint64_t)m;
  }
  inline void operator()(int64_t i) {
    idx[len++] = i;
    if (len == Q) flush();
  }
  void flush() {
    if (direct) {  // slot = index: no two writers share a slot
      for (int q = 0; q < len; ++q) table[idx[q]] = key(idx[q]);
    } else {
      for (int q = 0; q < len; ++q) {
        slot[q] = mod_m(murmur_index((uint64_t)idx[q], seed));
        __builtin_prefetch(table + slot[q], 1);
      }
      for (int q = 0; q < len; ++q) atomic_max(table + slot[q], key(idx[q]));
    }
    len = 0;
  }
  inline int64_t key(int64_t i) const {
    return ((int64_t)(mag_bits(x, dtype, i) >> (ibits - 32)) << ibits) | i;
  }
};

// Scan [lo, hi) of magnitude keys (sign bit masked off) against thr_key; on x86 16 keys at a time with
// SSE2 compares and a movemask, so only the set bits (the ~density fraction selected) cost a branch.
template <typename T>
inline void scan_tail(const T* a, T mask, T thr_key, int64_t i, int64_t hi, Store& st) {
  for (; i < hi; ++i)
    if ((T)(a[i] & mask) >= thr_key) st(i);
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void scan32_avx2(const int32_t* a, int32_t thr_key, int64_t lo, int64_t hi,
                                                 Store st) {
  int64_t i = lo;
  const __m256i msk = _mm256_set1_epi32(0x7FFFFFFF), t = _mm256_set1_epi32(thr_key - 1);
  for (; i + 32 <= hi; i += 32) {
    const __m256i* p = (const __m256i*)(a + i);
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

void scan32(const int32_t* a, int32_t thr_key, int64_t lo, int64_t hi, Store st) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) return scan32_avx2(a, thr_key, lo, hi, st);
#endif
  int64_t i = lo;
#if defined(__SSE2__)
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
#endif
  scan_tail<int32_t>(a, 0x7FFFFFFF, thr_key, i, hi, st);
  st.flush();
}

void scan16(const int16_t* a, int16_t thr_key, int64_t lo, int64_t hi, Store st) {
  int64_t i = lo;
#if defined(__SSE2__)
  const __m128i msk = _mm_set1_epi16(0x7FFF), t = _mm_set1_epi16((int16_t)(thr_key - 1));
  for (; i + 16 <= hi; i += 16) {
    const __m128i* p = (const __m128i*)(a + i);
    __m128i c0 = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(p), msk), t);
    __m128i c1 = _mm_cmpgt_epi16(_mm_and_si128(_mm_loadu_si128(p + 1), msk), t);
    unsigned bits = (unsigned)_mm_movemask_epi8(_mm_packs_epi16(c0, c1));
    while (bits) { st(i + __builtin_ctz(bits)); bits &= bits - 1; }
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

// Largest finite-magnitude sample statistic: the kk-th largest of s sampled magnitudes (non-finite -> 0).
// Positions: stratum j = [j*n/s, (j+1)*n/s), one element at murmur3(j, seed) % stratum length.
float dragonn_sample_kth(const void* x, int dtype, int64_t n, int64_t s, int64_t kk, uint32_t seed,
                         uint32_t* scratch, int nthreads) {
  const int64_t q = n / s, r = n % s;
  parallel_for(s, s < (1 << 15) ? 1 : nthreads, 64, [&](int, int64_t lo, int64_t hi) {
    constexpr int Q = 32;  // positions of a batch first, their lines prefetched, then the reads
    int64_t pos[Q];
    const int esize = dtype == F64 ? 8 : (dtype == F32 ? 4 : 2);
    for (int64_t j0 = lo; j0 < hi; j0 += Q) {
      const int cnt = (int)std::min<int64_t>(Q, hi - j0);
      for (int c = 0; c < cnt; ++c) {
        const int64_t j = j0 + c;
        const int64_t start = j * q + (int64_t)((__int128)j * r / s);
        const int64_t end = (j + 1) * q + (int64_t)((__int128)(j + 1) * r / s);
        pos[c] = start + (int64_t)(murmur_index((uint64_t)j, seed) % (uint64_t)(end - start));
        __builtin_prefetch((const char*)x + pos[c] * esize);
      }
      for (int c = 0; c < cnt; ++c) {
        const uint32_t b = mag_bits(x, dtype, pos[c]);
        scratch[j0 + c] = b >= kInfBits ? 0u : b;  // non-finite -> 0; finite bits order = value order
      }
    }
  });
  std::nth_element(scratch, scratch + (kk - 1), scratch + s, [](uint32_t a, uint32_t b) { return a > b; });
  return bits2f(scratch[kk - 1]);
}

// Fill table[m] with -1, then store the key of every selected element (see the header comment).
// thr must not be NaN (the caller handles that: nothing is selected).
void dragonn_build_table(const void* x, int dtype, int64_t n, float thr, int64_t m, uint32_t seed, int ibits,
                         int64_t* table, int nthreads) {
  parallel_for(m, m < (1 << 16) ? 1 : nthreads, 8, [&](int, int64_t lo, int64_t hi) {
    std::fill(table + lo, table + hi, (int64_t)-1);
  });
  Store st(x, dtype, m, m >= n, seed, ibits, table);
  int nt = n < (1 << 16) ? 1 : nthreads;
  uint32_t t32 = thr > 0.0f ? f2bits(thr) : 1u;  // thr <= 0: every nonzero (key >= 1)
  if (dtype == F32) {
    parallel_for(n, nt, 64, [&](int, int64_t lo, int64_t hi) {
      scan32((const int32_t*)x, (int32_t)t32, lo, hi, st);
    });
  } else if (dtype == BF16 || dtype == F16) {
    // smallest 16-bit magnitude pattern whose float32 value is >= thr (patterns order = value order)
    int32_t lo = 1, hi = dtype == BF16 ? 0x7F80 : 0x7C00;  // +Inf pattern always qualifies
    while (lo < hi) {
      int32_t mid = (lo + hi) / 2;
      uint32_t b = dtype == BF16 ? (uint32_t)mid << 16 : half_abs_to_f32_bits((uint16_t)mid);
      if (b >= t32) hi = mid; else lo = mid + 1;
    }
    parallel_for(n, nt, 64, [&](int, int64_t a, int64_t b) {
      scan16((const int16_t*)x, (int16_t)lo, a, b, st);
    });
  } else {
    parallel_for(n, nt, 64, [&](int, int64_t lo, int64_t hi) { scan_f64((const double*)x, thr, lo, hi, st); });
  }
}

// Valid slots in slot order -> indices (int32 or int64) and values (esize-byte elements). Returns count.
int64_t dragonn_gather(const int64_t* table, int64_t m, int ibits, const void* x, int esize, void* idx_out,
                       int idx64, void* val_out, int nthreads) {
  const int64_t imask = (int64_t)((((uint64_t)1) << ibits) - 1);
  int nt = m < (1 << 16) ? 1 : std::max(1, nthreads);
  std::vector<int64_t> counts(nt + 1, 0);
  int64_t chunk = (m + nt - 1) / nt;
  parallel_for(m, nt, 1, [&](int t, int64_t lo, int64_t hi) {
    int64_t c = 0;
    for (int64_t i = lo; i < hi; ++i) c += table[i] >= 0;
    counts[t + 1] = c;
  });
  for (int t = 0; t < nt; ++t) counts[t + 1] += counts[t];
  parallel_for(m, nt, 1, [&](int t, int64_t lo, int64_t hi) {
    int64_t o = counts[lo / chunk];
    constexpr int D = 16;  // prefetch distance (slots) for the random reads of x[index]
    for (int64_t i = lo; i < hi; ++i) {
      if (i + D < hi && table[i + D] >= 0) __builtin_prefetch((const char*)x + (table[i + D] & imask) * esize);
      int64_t v = table[i];
      if (v < 0) continue;
      int64_t idx = v & imask;
      if (idx64) ((int64_t*)idx_out)[o] = idx; else ((int32_t*)idx_out)[o] = (int32_t)idx;
      std::memcpy((char*)val_out + o * esize, (const char*)x + idx * esize, esize);
      ++o;
    }
  });
  return counts[nt];
}

}  // extern "C"
