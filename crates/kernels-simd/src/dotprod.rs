//! aarch64 integer score path with the dot-product extension: `sdot` multiplies 16 signed bytes
//! by 16 signed bytes into 4 i32 lanes. `vdotq_s32` is still unstable in Rust, so the
//! instruction is issued with `asm!` inside a `#[target_feature(enable = "dotprod")]` function,
//! chosen at run time with `is_aarch64_feature_detected!("dotprod")`.
//!
//! Covered: affine 4-bit rows of a multiple of 32 codes and 8-bit rows of a multiple of 16.
//! 4-bit codes (0..=15) are valid signed bytes; 8-bit codes are shifted by −128 and the shift
//! is added back as `128 · Σ q8`. Same query rounding and error bound as the AVX2 path.

use std::arch::aarch64::*;
use std::arch::asm;
use std::ops::Range;

use crate::block::{Levels, QuantBlock};
use crate::int8;

fn cpu_ok() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// Whether [`scores_int8`] has a kernel for this block on this CPU.
pub fn int8_supported(b: &QuantBlock<'_>) -> bool {
    let ok_dim = match b.bits {
        4 => b.dim.is_multiple_of(32),
        8 => b.dim.is_multiple_of(16),
        _ => false,
    };
    ok_dim && b.dim > 0 && matches!(b.levels, Levels::Affine) && crate::scalar::integer_params(b) && cpu_ok()
}

/// `acc += sdot(a, b)`.
///
/// # Safety
/// The CPU must support the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
#[inline]
pub(crate) unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` reads two vector registers and accumulates into a third; it touches no
    // memory and no flags, and the CPU supports it (this function's target features).
    unsafe {
        asm!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b, options(pure, nomem, nostack));
    }
    acc
}

/// `dots[r − rows.start] = Σ_d q[d] · code[r][d]` for rows `rows` of `b` (the loop over rows
/// inside the target-feature code, so that the row's kernel inlines into it).
///
/// # Safety
/// The CPU must support dotprod; `q` holds `b.dim` int8 values (as bytes) (natural order, which is the
/// order the nibble planes of 16-byte chunks produce); the block is one [`int8_supported`]
/// accepts; `dots` holds `rows.len()` values.
#[target_feature(enable = "neon,dotprod")]
unsafe fn idot_rows(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], dots: &mut [i32]) {
    // The 8-bit codes are shifted into i8 by −128; the shift comes back as 128 · Σ q.
    let shift_back: i32 =
        if b.bits == 8 { 128 * q.iter().map(|&x| i32::from(x as i8)).sum::<i32>() } else { 0 };
    for (o, r) in dots.iter_mut().zip(rows) {
        let row = b.row(r);
        // SAFETY: every load reads 16 bytes inside `row` or `q`; sdot is enabled.
        *o = unsafe {
            let mut acc = vdupq_n_s32(0);
            if b.bits == 4 {
                let mask = vdupq_n_u8(0x0f);
                for (c, qs) in row.chunks_exact(16).zip(q.chunks_exact(32)) {
                    let v = vld1q_u8(c.as_ptr());
                    // Byte j holds code j (low nibble) and code j + 16 (high nibble).
                    let lo = vreinterpretq_s8_u8(vandq_u8(v, mask));
                    let hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
                    acc = sdot(acc, lo, vld1q_s8(qs.as_ptr().cast()));
                    acc = sdot(acc, hi, vld1q_s8(qs.as_ptr().add(16).cast()));
                }
            } else {
                let shift = vdupq_n_u8(128);
                for (c, qs) in row.chunks_exact(16).zip(q.chunks_exact(16)) {
                    let v = vreinterpretq_s8_u8(vsubq_u8(vld1q_u8(c.as_ptr()), shift));
                    acc = sdot(acc, v, vld1q_s8(qs.as_ptr().cast()));
                }
            }
            vaddvq_s32(acc) + shift_back
        };
    }
}

pub(crate) struct Sdot;

impl int8::IntKernel for Sdot {
    fn arrange(_: &QuantBlock<'_>, q8: &[i8], out: &mut Vec<u8>) {
        int8::arrange_natural(q8, out);
    }

    fn dots(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], n: usize, dots: &mut [i32]) {
        let (d, m) = (b.dim, rows.len());
        for (i, qi) in q.chunks_exact(d).take(n).enumerate() {
            // SAFETY: `int8_supported(b)` (checked by `scores_int8`, the only caller) covers
            // the CPU, the bit width and the row length; `qi` holds `d` values.
            unsafe { idot_rows(b, rows.clone(), &qi, &mut dots[i * m..(i + 1) * m]) };
        }
    }
}

/// Scores through `sdot`; see [`crate::scores_int8_with`] for the algebra and error bound
/// (the scores equal [`crate::scalar::scores_int8`] bit for bit). Returns `false`, computing
/// nothing, when [`int8_supported`] is false.
pub fn scores_int8(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &mut [f32]) -> bool {
    crate::with_scratch(|w| scores_int8_in(b, q, n_q, out, &mut w.int8))
}

/// [`scores_int8`] with the caller's scratch.
pub(crate) fn scores_int8_in(
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
    scratch: &mut int8::Scratch,
) -> bool {
    if !int8_supported(b) {
        return false;
    }
    int8::scores_by_block::<Sdot>(b, q, n_q, out, scratch);
    true
}
