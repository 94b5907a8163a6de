/* kernels.c -- elementwise reductions (MPI_Reduce_local's job) for every dtype x op. */
#define _GNU_SOURCE
#include "pc_internal.h"
#include <string.h>
#include <math.h>

typedef struct { float re, im; } c64;
typedef struct { double re, im; } c128;

/* class of each dtype: 0 bool, 1 integer, 2 floating, 3 complex */
static const int dt_class[PC_DT_COUNT] = {0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 2, 2};
const size_t pc_dt_size[PC_DT_COUNT] = {1, 1, 2, 4, 8, 1, 2, 4, 8, 4, 8, 8, 16, 2, 2};

/* float16 (IEEE binary16) and bfloat16 <-> float. Each element is widened to float,
 * reduced in float (a product of two halves is exact there, a sum nearly always) and
 * rounded back to nearest-even, as torch's CPU kernels do for a + b. Each partial sum
 * of a reduction is rounded to 16 bits: a sum over P ranks carries up to P - 1 such
 * roundings. Written out in bits so that no compiler half type is needed. */
static inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float bf16_float(uint16_t h) { return bits_float((uint32_t)h << 16); }
static inline uint16_t float_bf16(float f)
{
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float f16_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));       /* inf, NaN */
    if (exp == 0) {                                   /* zero, subnormal: man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}
static inline uint16_t float_f16(float f)
{
    uint32_t u = float_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));   /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);     /* rounds past 65504: inf */
    if (a < 0x38800000u) {                  /* below 2^-14: subnormal half, round to even */
        float m = bits_float(a) * 16777216.0f;      /* in units of 2^-24, exact */
        uint32_t q = (uint32_t)m;
        float r = m - (float)q;
        if (r > 0.5f || (r == 0.5f && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t rounded = a + 0xfffu + ((a >> 13) & 1);            /* to nearest even */
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

/* Floating MIN and MAX commute bit for bit, so that every rank of an allreduce gets the
 * same bits whichever operand order its schedule uses: -0 < +0 (MIN(-0, +0) is -0, MAX
 * is +0, as IEEE 754-2019 minimum/maximum), and a NaN operand gives a NaN. */
#define FMIN(u, v) ((v) < (u) || (v) != (v) || ((v) == (u) && signbit(v)) ? (v) : (u))
#define FMAX(u, v) ((v) > (u) || (v) != (v) || ((v) == (u) && !signbit(v)) ? (v) : (u))

#define HALF(TO_F, FROM_F, EXPR) do { const uint16_t *x = a, *y = b; uint16_t *z = out; \
        for (int64_t i = 0; i < n; i++) { float u = TO_F(x[i]), v = TO_F(y[i]); z[i] = FROM_F(EXPR); } \
        } while (0)

#define HALF_ARITH(TO_F, FROM_F) switch (redop) { \
    case PC_OP_SUM: HALF(TO_F, FROM_F, u + v); return PC_OK; \
    case PC_OP_PROD: HALF(TO_F, FROM_F, u * v); return PC_OK; \
    case PC_OP_MIN: HALF(TO_F, FROM_F, FMIN(u, v)); return PC_OK; \
    case PC_OP_MAX: HALF(TO_F, FROM_F, FMAX(u, v)); return PC_OK; }

int pc_op_valid(int redop, int dtype)
{
    if (dtype < 0 || dtype >= PC_DT_COUNT || redop < 0 || redop >= PC_OP_COUNT) return 0;
    int k = dt_class[dtype];
    switch (redop) {
    case PC_OP_COPY: return 1;
    case PC_OP_SUM: case PC_OP_PROD: return k != 0;          /* MPI: no arithmetic on C_BOOL */
    case PC_OP_MIN: case PC_OP_MAX: return k == 1 || k == 2;
    case PC_OP_LAND: case PC_OP_LOR: case PC_OP_LXOR: return k <= 1;
    default: return k == 1;                                  /* BAND BOR BXOR: integers */
    }
}

#define LOOP(T, EXPR) do { const T *x = (const T *)a, *y = (const T *)b; T *z = (T *)out; \
        for (int64_t i = 0; i < n; i++) { T u = x[i], v = y[i]; z[i] = (T)(EXPR); } } while (0)

#define ARITH(T) switch (redop) { \
    case PC_OP_SUM: LOOP(T, u + v); return PC_OK; \
    case PC_OP_PROD: LOOP(T, u * v); return PC_OK; \
    case PC_OP_MIN: LOOP(T, v < u ? v : u); return PC_OK; \
    case PC_OP_MAX: LOOP(T, v > u ? v : u); return PC_OK; \
    case PC_OP_LAND: LOOP(T, (u != 0) && (v != 0)); return PC_OK; \
    case PC_OP_LOR: LOOP(T, (u != 0) || (v != 0)); return PC_OK; \
    case PC_OP_LXOR: LOOP(T, (u != 0) != (v != 0)); return PC_OK; }

#define FARITH(T) switch (redop) { \
    case PC_OP_SUM: LOOP(T, u + v); return PC_OK; \
    case PC_OP_PROD: LOOP(T, u * v); return PC_OK; \
    case PC_OP_MIN: LOOP(T, FMIN(u, v)); return PC_OK; \
    case PC_OP_MAX: LOOP(T, FMAX(u, v)); return PC_OK; }

#define BITS(T) switch (redop) { \
    case PC_OP_BAND: LOOP(T, u & v); return PC_OK; \
    case PC_OP_BOR: LOOP(T, u | v); return PC_OK; \
    case PC_OP_BXOR: LOOP(T, u ^ v); return PC_OK; }

#define COMPLEX(T) switch (redop) { \
    case PC_OP_SUM: { const T *x = a, *y = b; T *z = out; for (int64_t i = 0; i < n; i++) { \
        T r = {x[i].re + y[i].re, x[i].im + y[i].im}; z[i] = r; } return PC_OK; } \
    case PC_OP_PROD: { const T *x = a, *y = b; T *z = out; for (int64_t i = 0; i < n; i++) { \
        T r = {x[i].re * y[i].re - x[i].im * y[i].im, x[i].re * y[i].im + x[i].im * y[i].re}; \
        z[i] = r; } return PC_OK; } }

/* out = a (op) b, elementwise; out may alias a or b. */
int pc_reduce_local(int redop, int dtype, const void *a, const void *b, void *out, int64_t n)
{
    if (!pc_op_valid(redop, dtype))
        return fail(PC_ERR_DTYPE_OP, "reduction op %d is not defined for dtype %d", redop, dtype);
    if (n <= 0) return PC_OK;
    if (redop == PC_OP_COPY) {
        if (out != a) memmove(out, a, (size_t)n * pc_dt_size[dtype]);
        return PC_OK;
    }
    switch (dtype) {
    case PC_DT_BOOL: { const uint8_t *x = a, *y = b; uint8_t *z = out;
        for (int64_t i = 0; i < n; i++) {
            int u = x[i] != 0, v = y[i] != 0;
            z[i] = (uint8_t)(redop == PC_OP_LAND ? (u && v) : redop == PC_OP_LOR ? (u || v) : (u != v));
        }
        return PC_OK; }
    case PC_DT_INT8: ARITH(int8_t) BITS(int8_t) break;
    case PC_DT_INT16: ARITH(int16_t) BITS(int16_t) break;
    case PC_DT_INT32: ARITH(int32_t) BITS(int32_t) break;
    case PC_DT_INT64: ARITH(int64_t) BITS(int64_t) break;
    case PC_DT_UINT8: ARITH(uint8_t) BITS(uint8_t) break;
    case PC_DT_UINT16: ARITH(uint16_t) BITS(uint16_t) break;
    case PC_DT_UINT32: ARITH(uint32_t) BITS(uint32_t) break;
    case PC_DT_UINT64: ARITH(uint64_t) BITS(uint64_t) break;
    case PC_DT_FLOAT32: FARITH(float) break;
    case PC_DT_FLOAT64: FARITH(double) break;
    case PC_DT_COMPLEX64: COMPLEX(c64) break;
    case PC_DT_COMPLEX128: COMPLEX(c128) break;
    case PC_DT_FLOAT16: HALF_ARITH(f16_float, float_f16) break;
    case PC_DT_BFLOAT16: HALF_ARITH(bf16_float, float_bf16) break;
    }
    return fail(PC_ERR_DTYPE_OP, "reduction op %d is not defined for dtype %d", redop, dtype);
}

/* The ops a divisor may follow: SUM (an average) and COPY, on a real floating dtype. */
int pc_div_valid(int redop, int dtype)
{
    return (redop == PC_OP_SUM || redop == PC_OP_COPY) && dt_class[dtype < 0 || dtype >= PC_DT_COUNT ? 0 : dtype] == 2;
}

#define DIV_LOOP(T, EXPR) do { const T *x = (const T *)a, *y = (const T *)b; T *z = (T *)out; \
        for (int64_t i = 0; i < n; i++) { T u = x[i], v = y[i]; (void)v; z[i] = (T)(EXPR); } } while (0)
#define HALF_DIV(TO_F, FROM_F) do { const uint16_t *x = a, *y = b; uint16_t *z = out; float q = (float)d; \
        if (sum) for (int64_t i = 0; i < n; i++) z[i] = FROM_F((TO_F(x[i]) + TO_F(y[i])) / q); \
        else for (int64_t i = 0; i < n; i++) z[i] = FROM_F(TO_F(x[i]) / q); } while (0)

/* out = (a + b) / d (SUM) or a / d (COPY), in one pass: the sum rounded to the dtype, then
 * divided, as a sum followed by a division of the result would give it (float16 and
 * bfloat16: computed in float and rounded once). out may alias a or b. */
int pc_reduce_div(int redop, int dtype, const void *a, const void *b, void *out, int64_t n, double d)
{
    if (!pc_div_valid(redop, dtype))
        return fail(PC_ERR_DTYPE_OP, "a divisor needs SUM or COPY of a real floating dtype, not op %d on dtype %d",
                    redop, dtype);
    if (n <= 0) return PC_OK;
    int sum = redop == PC_OP_SUM;
    switch (dtype) {
    case PC_DT_FLOAT32: { float q = (float)d;
        if (sum) DIV_LOOP(float, (float)(u + v) / q); else DIV_LOOP(float, u / q);
        return PC_OK; }
    case PC_DT_FLOAT64:
        if (sum) DIV_LOOP(double, (u + v) / d); else DIV_LOOP(double, u / d);
        return PC_OK;
    case PC_DT_FLOAT16: HALF_DIV(f16_float, float_f16); return PC_OK;
    case PC_DT_BFLOAT16: HALF_DIV(bf16_float, float_bf16); return PC_OK;
    }
    return fail(PC_ERR_DTYPE_OP, "a divisor needs a real floating dtype, not dtype %d", dtype);
}

/* out = the mean of the k vectors v[0..k-1] of n elements, elementwise, accumulated wide:
 * real floating types (float16 and bfloat16 too) and the parts of complex numbers in
 * double, signed integers in int64 and unsigned ones in uint64; then divided by k and
 * rounded once to the dtype (integers: the quotient truncated toward zero, as C and
 * MPI's integer division do). Not defined for bool. out may alias one of v. */
#define MEAN_LOOP(T, ACC, LOAD_, STORE_) do { \
        for (int64_t i = 0; i < n; i++) { ACC s = 0; \
            for (int j = 0; j < k; j++) s += (ACC)LOAD_(((const T *)v[j])[i]); \
            ((T *)out)[i] = STORE_(s / (ACC)k); } } while (0)
#define SAME(x) (x)
#define F16_D(h) ((double)f16_float(h))
#define BF16_D(h) ((double)bf16_float(h))
#define D_F16(d) float_f16((float)(d))
#define D_BF16(d) float_bf16((float)(d))

int pc_mean_local(int dtype, const void *const *v, int k, void *out, int64_t n)
{
    if (dtype < 0 || dtype >= PC_DT_COUNT || dt_class[dtype] == 0)
        return fail(PC_ERR_DTYPE_OP, "a mean is not defined for dtype %d (bool)", dtype);
    if (k <= 0) return fail(PC_ERR_ARG, "a mean of %d vectors", k);
    if (n <= 0) return PC_OK;
    switch (dtype) {
    case PC_DT_INT8: MEAN_LOOP(int8_t, int64_t, SAME, (int8_t)); break;
    case PC_DT_INT16: MEAN_LOOP(int16_t, int64_t, SAME, (int16_t)); break;
    case PC_DT_INT32: MEAN_LOOP(int32_t, int64_t, SAME, (int32_t)); break;
    case PC_DT_INT64: MEAN_LOOP(int64_t, int64_t, SAME, (int64_t)); break;
    case PC_DT_UINT8: MEAN_LOOP(uint8_t, uint64_t, SAME, (uint8_t)); break;
    case PC_DT_UINT16: MEAN_LOOP(uint16_t, uint64_t, SAME, (uint16_t)); break;
    case PC_DT_UINT32: MEAN_LOOP(uint32_t, uint64_t, SAME, (uint32_t)); break;
    case PC_DT_UINT64: MEAN_LOOP(uint64_t, uint64_t, SAME, (uint64_t)); break;
    case PC_DT_FLOAT32: MEAN_LOOP(float, double, SAME, (float)); break;
    case PC_DT_FLOAT64: MEAN_LOOP(double, double, SAME, (double)); break;
    case PC_DT_COMPLEX64: n *= 2; MEAN_LOOP(float, double, SAME, (float)); break;     /* re, im */
    case PC_DT_COMPLEX128: n *= 2; MEAN_LOOP(double, double, SAME, (double)); break;
    case PC_DT_FLOAT16: MEAN_LOOP(uint16_t, double, F16_D, D_F16); break;
    case PC_DT_BFLOAT16: MEAN_LOOP(uint16_t, double, BF16_D, D_BF16); break;
    }
    return PC_OK;
}

/* out = a + w * b, elementwise, for a real floating dtype (float16 and bfloat16 in float,
 * rounded once): RNA's weighted accumulation. out may alias a or b. */
int pc_axpy(int dtype, const void *a, const void *b, void *out, int64_t n, double w)
{
    if (!pc_div_valid(PC_OP_SUM, dtype))
        return fail(PC_ERR_DTYPE_OP, "a weighted sum needs a real floating dtype, not dtype %d", dtype);
    switch (dtype) {
    case PC_DT_FLOAT32: { float q = (float)w; DIV_LOOP(float, u + q * v); return PC_OK; }
    case PC_DT_FLOAT64: DIV_LOOP(double, u + w * v); return PC_OK;
    case PC_DT_FLOAT16: { const uint16_t *x = a, *y = b; uint16_t *z = out; float q = (float)w;
        for (int64_t i = 0; i < n; i++) z[i] = float_f16(f16_float(x[i]) + q * f16_float(y[i]));
        return PC_OK; }
    case PC_DT_BFLOAT16: { const uint16_t *x = a, *y = b; uint16_t *z = out; float q = (float)w;
        for (int64_t i = 0; i < n; i++) z[i] = float_bf16(bf16_float(x[i]) + q * bf16_float(y[i]));
        return PC_OK; }
    }
    return fail(PC_ERR_DTYPE_OP, "a weighted sum needs a real floating dtype, not dtype %d", dtype);
}
