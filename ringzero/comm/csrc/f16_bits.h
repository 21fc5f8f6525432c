/* f16_bits.h: float16 <-> float32 bit conversions with NumPy's rules (round to nearest even,
 * NaN payloads kept), scalar and exact. The one copy, included by comm/csrc/f16.c (the Ring's
 * casts) and runtime/csrc/adam.c (the fused AdamW's fp16 grads and params). Needs <stdint.h>
 * and <string.h> first. */
#ifndef RINGZERO_F16_BITS_H
#define RINGZERO_F16_BITS_H

static inline float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline uint32_t h2f_bits(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f)                    /* Inf or NaN: keep the payload bits */
        return sign | 0x7f800000u | (m << 13);
    if (e != 0)                       /* normal: rebias 15 -> 127 */
        return sign | ((e + 112u) << 23) | (m << 13);
    if (m == 0)
        return sign;                  /* +-0 */
    /* subnormal m * 2^-24: shift the leading one up to bit 10 */
    uint32_t ef = 113u;
    while (!(m & 0x400u)) { m <<= 1; ef--; }
    return sign | (ef << 23) | ((m & 0x3ffu) << 13);
}

static inline uint16_t f2h_bits(uint32_t f)
{
    uint16_t sign = (uint16_t)((f >> 16) & 0x8000u);
    uint32_t a = f & 0x7fffffffu;
    if (a >= 0x7f800000u) {           /* Inf or NaN */
        if (a == 0x7f800000u) return sign | 0x7c00u;
        uint16_t r = (uint16_t)(0x7c00u | ((a & 0x7fffffu) >> 13));
        if (r == 0x7c00u) r++;        /* payload lost in the cut: stay a NaN */
        return sign | r;
    }
    if (a >= 0x477ff000u)             /* >= 65520 rounds to Inf */
        return sign | 0x7c00u;
    if (a < 0x38800000u) {            /* below 2^-14: float16 subnormal or 0 */
        uint32_t e = a >> 23;
        uint32_t shift = 126u - e;    /* value = mant * 2^(e-150), unit 2^-24 */
        if (shift > 24u) return sign; /* below 2^-25: rounds to 0 */
        uint32_t mant = (a & 0x7fffffu) | 0x800000u;
        uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return sign | (uint16_t)q;
    }
    uint32_t r = a - 0x38000000u;     /* rebias 127 -> 15 */
    uint32_t h = r >> 13, rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return sign | (uint16_t)h;
}

#endif
