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

struct Store {
  const void* x; int dtype; int64_t m; bool direct; uint32_t seed; int ibits; int64_t* table;
  inline void operator()(int64_t i) const {
    int64_t key = ((int64_t)(mag_bits(x, dtype, i) >> (ibits - 32)) << ibits) | i;
    if (direct) { table[i] = key; return; }  // slot = index: no two writers share a slot
    atomic_max(table + (murmur_index((uint64_t)i, seed) % (uint64_t)m), key);
  }
};

// Scan [lo, hi): blocks of B keys are tested with a vectorisable OR-reduction; only blocks holding a
// selected element are walked again element by element.
template <typename T, int B>
void scan(const T* a, T mask, T thr_key, int64_t lo, int64_t hi, const Store& st) {
  int64_t i = lo;
  for (; i + B <= hi; i += B) {
    int any = 0;
    for (int j = 0; j < B; ++j) any |= (T)(a[i + j] & mask) >= thr_key;
    if (!any) continue;
    for (int j = 0; j < B; ++j)
      if ((T)(a[i + j] & mask) >= thr_key) st(i + j);
  }
  for (; i < hi; ++i)
    if ((T)(a[i] & mask) >= thr_key) st(i);
}

void scan_f64(const double* a, float thr, int64_t lo, int64_t hi, const Store& st) {
  for (int64_t i = lo; i < hi; ++i) {
    double d = a[i];
    float f = (float)(d < 0 ? -d : d);
    if (d != d || (f >= thr && f > 0.0f)) st(i);
  }
}

}  // namespace

extern "C" {

// Largest finite-magnitude sample statistic: the kk-th largest of s sampled magnitudes (non-finite -> 0).
// Positions: stratum j = [j*n/s, (j+1)*n/s), one element at murmur3(j, seed) % stratum length.
float dragonn_sample_kth(const void* x, int dtype, int64_t n, int64_t s, int64_t kk, uint32_t seed,
                         uint32_t* scratch, int nthreads) {
  const int64_t q = n / s, r = n % s;
  parallel_for(s, s < (1 << 15) ? 1 : nthreads, 64, [&](int, int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      int64_t start = j * q + (int64_t)((__int128)j * r / s);
      int64_t end = (j + 1) * q + (int64_t)((__int128)(j + 1) * r / s);
      int64_t pos = start + (int64_t)(murmur_index((uint64_t)j, seed) % (uint64_t)(end - start));
      uint32_t b = mag_bits(x, dtype, pos);
      scratch[j] = b >= kInfBits ? 0u : b;  // non-finite -> 0; finite bits order = value order
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
  Store st{x, dtype, m, m >= n, seed, ibits, table};
  int nt = n < (1 << 16) ? 1 : nthreads;
  uint32_t t32 = thr > 0.0f ? f2bits(thr) : 1u;  // thr <= 0: every nonzero (key >= 1)
  if (dtype == F32) {
    parallel_for(n, nt, 64, [&](int, int64_t lo, int64_t hi) {
      scan<int32_t, 16>((const int32_t*)x, 0x7FFFFFFF, (int32_t)t32, lo, hi, st);
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
      scan<int16_t, 32>((const int16_t*)x, 0x7FFF, (int16_t)lo, a, b, st);
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
    for (int64_t i = lo; i < hi; ++i) {
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
