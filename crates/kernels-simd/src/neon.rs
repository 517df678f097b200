//! aarch64 NEON level lookups for the float kernels of the `wide` backend: the rows of
//! codebook blocks (tables of up to 16 levels: NF4, fitted codebooks of 1 to 4 bits) and FP8
//! blocks decoded 16 codes at a time in registers, where the portable code reads one table
//! entry per code.
//!
//! A table of up to 16 f32 levels is held as four byte planes (plane `j` holds byte `j` of
//! every level, one `ld4`); `tbl` looks 16 codes up in each plane and two rounds of `zip`
//! put the four bytes of each level back together: 12 instructions per 16 levels. FP8 is
//! decoded arithmetically: the sign bit and the magnitude bits `e…e m…m` placed at the top of
//! an f32's exponent and mantissa fields make an f32 whose value, times `2^(127 − bias)`, is
//! the FP8 value, exact for normal and subnormal codes alike; the codes whose exponent is all
//! ones (e5m2's infinities and NaNs, e4m3's NaN) get the f32 exponent of all ones, which the
//! multiplication keeps: about 30 instructions per 16 values. Both give the values of
//! [`Levels::table`] bit for bit (the backend tests compare the dequantized blocks bit for bit
//! with the scalar reference, and every FP8 code, specials included, on every backend).
//!
//! NEON is part of every aarch64 CPU, so there is no run-time check.

use std::arch::aarch64::*;

use kvq_quant_core::fp8::Fp8Format;
use kvq_quant_core::pack::unpack_row;

use crate::block::{Levels, QuantBlock};

/// How the 16 codes of a vector become levels.
#[derive(Clone, Copy)]
enum Lut {
    /// The four byte planes of a table of up to 16 levels (missing levels zero).
    Planes(uint8x16x4_t),
    E4m3,
    E5m2,
}

/// The lookup of `levels`: `None` for tables of more than 16 levels (read one by one).
fn lut(levels: Levels<'_>) -> Option<Lut> {
    match levels {
        Levels::Fp8(Fp8Format::E4M3) => Some(Lut::E4m3),
        Levels::Fp8(Fp8Format::E5M2) => Some(Lut::E5m2),
        Levels::Table(t) if t.len() <= 16 => {
            let mut padded = [0f32; 16];
            padded[..t.len()].copy_from_slice(t);
            // SAFETY: `ld4` reads the 64 bytes of `padded`, which lives through the call;
            // NEON is part of every aarch64 CPU.
            Some(Lut::Planes(unsafe { vld4q_u8(padded.as_ptr().cast()) }))
        }
        _ => None,
    }
}

/// The FP8 values of eight codes (one per u16 lane, below 256), as two vectors of four.
///
/// Every set bit of the f32 pattern described in the module's notes (sign, the magnitude bits
/// under the exponent, the all-ones exponent of the specials) lies in its upper 16 bits, so
/// the pattern is built in u16 lanes and widened by a shift of 16; the multiplication by
/// `2^(127 − bias)` keeps the sign and leaves infinities and NaNs as they are.
#[inline(always)]
fn fp8x8(c: uint16x8_t, e4m3: bool) -> [float32x4_t; 2] {
    // e4m3: 4 exponent bits, bias 7; e5m2: 5 bits, bias 15. The magnitude's top bit lands on
    // f32 bit 26 (bit 10 of the upper half) either way.
    let (factor, special) = if e4m3 { (2f32.powi(120), 0x7f) } else { (2f32.powi(112), 0x7c) };
    // SAFETY: register-only NEON arithmetic (no memory access); NEON is part of every aarch64
    // CPU.
    unsafe {
        let mag = vandq_u16(c, vdupq_n_u16(0x7f));
        let bits = if e4m3 { vshlq_n_u16::<4>(mag) } else { vshlq_n_u16::<5>(mag) };
        // The exponent of all ones: e5m2's infinity (mantissa 0) and NaNs, e4m3's NaN (its
        // only such code, 0x7f, has a mantissa of ones).
        let all_ones = vandq_u16(vcgeq_u16(mag, vdupq_n_u16(special)), vdupq_n_u16(0x7f80));
        let sign = vshlq_n_u16::<8>(vandq_u16(c, vdupq_n_u16(0x80)));
        let hi = vorrq_u16(vorrq_u16(bits, all_ones), sign);
        let widen = |x: uint32x4_t| vmulq_n_f32(vreinterpretq_f32_u32(x), factor);
        [widen(vshll_n_u16::<16>(vget_low_u16(hi))), widen(vshll_high_n_u16::<16>(hi))]
    }
}

/// The levels of the 16 codes of `c` into `out[..16]`.
#[inline(always)]
fn levels16(c: uint8x16_t, lut: &Lut, out: &mut [f32]) {
    let out = &mut out[..16];
    // SAFETY: the stores write `out[..16]`, 64 bytes inside the slice; the rest is
    // register-only NEON arithmetic; NEON is part of every aarch64 CPU. Table lookups of
    // codes past the table's length would give 0 (`tbl`'s rule), and `QuantBlock::new`
    // checked that a table has 2^bits levels, so none are.
    unsafe {
        let v: [float32x4_t; 4] = match *lut {
            Lut::Planes(p) => {
                let (b0, b1) = (vqtbl1q_u8(p.0, c), vqtbl1q_u8(p.1, c));
                let (b2, b3) = (vqtbl1q_u8(p.2, c), vqtbl1q_u8(p.3, c));
                // Bytes 0 and 1, then 2 and 3 of each level as u16 lanes; then the halves.
                let (lo01, hi01) = (vzip1q_u8(b0, b1), vzip2q_u8(b0, b1));
                let (lo23, hi23) = (vzip1q_u8(b2, b3), vzip2q_u8(b2, b3));
                let w = |a: uint8x16_t, b: uint8x16_t, high: bool| {
                    let (a, b) = (vreinterpretq_u16_u8(a), vreinterpretq_u16_u8(b));
                    vreinterpretq_f32_u16(if high { vzip2q_u16(a, b) } else { vzip1q_u16(a, b) })
                };
                [w(lo01, lo23, false), w(lo01, lo23, true), w(hi01, hi23, false), w(hi01, hi23, true)]
            }
            Lut::E4m3 | Lut::E5m2 => {
                let e4m3 = matches!(lut, Lut::E4m3);
                let [a, b] = fp8x8(vmovl_u8(vget_low_u8(c)), e4m3);
                let [x, y] = fp8x8(vmovl_high_u8(c), e4m3);
                [a, b, x, y]
            }
        };
        for (k, x) in v.into_iter().enumerate() {
            vst1q_f32(out.as_mut_ptr().add(4 * k), x);
        }
    }
}

/// The levels of row `r` of a table or FP8 block into `out` (`b.dim` values), through
/// `codes` as scratch where the row is unpacked to bytes first. Returns `false`, writing
/// nothing, for tables of more than 16 levels.
pub(crate) fn table_row(b: &QuantBlock<'_>, r: usize, out: &mut [f32], codes: &mut Vec<u8>) -> bool {
    let Some(lut) = lut(b.levels) else { return false };
    let (row, d) = (b.row(r), b.dim);
    let t = b.levels.table().expect("a table or FP8 block");
    // SAFETY (of the loads below): each reads 16 bytes of a 16-byte chunk of `row`.
    if b.bits == 4 && d.is_multiple_of(32) {
        // Byte j of a 16-byte chunk holds code j (low nibble) and code j + 16 (high nibble).
        for (src, dst) in row.chunks_exact(16).zip(out.chunks_exact_mut(32)) {
            // SAFETY: see above; register-only arithmetic otherwise.
            let v = unsafe { vld1q_u8(src.as_ptr()) };
            let (lo, hi) = unsafe { (vandq_u8(v, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(v)) };
            let (a, b) = dst.split_at_mut(16);
            levels16(lo, &lut, a);
            levels16(hi, &lut, b);
        }
        return true;
    }
    // 8-bit rows are their codes; other widths are unpacked to bytes first.
    let bytes: &[u8] = if b.bits == 8 {
        &row[..d]
    } else {
        codes.resize(d, 0);
        unpack_row(row, b.bits, codes).expect("QuantBlock::new checked the lengths");
        codes
    };
    let mut chunks = bytes.chunks_exact(16);
    let mut outs = out[..d].chunks_exact_mut(16);
    for (src, dst) in (&mut chunks).zip(&mut outs) {
        // SAFETY: see above.
        levels16(unsafe { vld1q_u8(src.as_ptr()) }, &lut, dst);
    }
    for (o, &c) in outs.into_remainder().iter_mut().zip(chunks.remainder()) {
        *o = t[c as usize];
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::Params;
    use kvq_quant_core::pack::{pack, packed_len};

    /// Every layout [`table_row`] reads (4-bit rows of whole chunks in registers, 8-bit rows
    /// as they are, other widths unpacked; 16-code blocks and a scalar tail) against the table
    /// itself, bit for bit; tables of more than 16 levels are left to the caller.
    #[test]
    fn table_rows_equal_the_table_bit_for_bit() {
        for bits in 1..=8u8 {
            let n = 1usize << bits;
            // Levels with every byte of their bits different, negative zero and a subnormal.
            let table: Vec<f32> = (0..n)
                .map(|i| match i {
                    1 => -0.0,
                    2 => f32::from_bits(3),
                    _ => (i as f32 - 4.7) * 1.37e-3 * if i % 3 == 0 { -1.0 } else { 1.0 },
                })
                .collect();
            let fp8 = [Levels::Fp8(Fp8Format::E4M3), Levels::Fp8(Fp8Format::E5M2)];
            let kinds: Vec<Levels<'_>> = std::iter::once(Levels::Table(&table))
                .chain(if bits == 8 { &fp8[..] } else { &[] }.iter().copied())
                .collect();
            for levels in kinds {
                for dim in [1usize, 15, 16, 17, 32, 40, 64, 128, 136, 256] {
                    let raw: Vec<u8> = (0..2 * dim).map(|i| ((i * 37 + 11) % n) as u8).collect();
                    let mut codes = Vec::new();
                    for r in raw.chunks(dim) {
                        codes.extend(pack(r, bits).unwrap());
                    }
                    assert_eq!(codes.len(), 2 * packed_len(dim, bits).unwrap());
                    let scale = [1.0f32; 2];
                    let params = Params::PerRow { scale: &scale, offset: None };
                    let b = QuantBlock::new(&codes, 2, dim, bits, levels, params).unwrap();
                    let t = levels.table().unwrap();
                    let mut scratch = Vec::new();
                    for r in 0..2 {
                        let mut out = vec![f32::NAN; dim];
                        let done = table_row(&b, r, &mut out, &mut scratch);
                        assert_eq!(done, t.len() <= 16 || matches!(levels, Levels::Fp8(_)), "{bits} bits");
                        if !done {
                            continue;
                        }
                        for (k, (&o, &c)) in out.iter().zip(&raw[r * dim..(r + 1) * dim]).enumerate() {
                            let want = t[c as usize];
                            assert!(
                                o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()),
                                "{levels:?} dim {dim} row {r} value {k} code {c:#x}: {o} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every FP8 code, specials included, against the format's decoding.
    #[test]
    fn every_fp8_code_decodes_as_the_format_says() {
        let codes: Vec<u8> = (0..=255).collect();
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let lut = lut(Levels::Fp8(f)).unwrap();
            for chunk in codes.chunks_exact(16) {
                let mut out = [0f32; 16];
                // SAFETY: reads the 16 bytes of `chunk`.
                levels16(unsafe { vld1q_u8(chunk.as_ptr()) }, &lut, &mut out);
                for (&o, &c) in out.iter().zip(chunk) {
                    let want = f.decode(c);
                    assert!(
                        o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()),
                        "{f:?} {c:#x}: {o} vs {want}"
                    );
                }
            }
        }
    }
}
