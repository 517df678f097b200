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

use crate::block::{Levels, QuantBlock};
use crate::int8::{self, IntQuery, quantize_query};

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
    ok_dim && b.dim > 0 && matches!(b.levels, Levels::Affine) && cpu_ok()
}

#[derive(Default)]
struct Q8 {
    scale: f32,
    q8: Vec<i8>,
    sum: i32,
}

impl IntQuery for Q8 {
    fn prepare(&mut self, q: &[f32]) {
        self.scale = quantize_query(q, &mut self.q8);
        self.sum = self.q8.iter().map(|&x| i32::from(x)).sum();
    }

    fn scale(&self) -> f32 {
        self.scale
    }
}

/// `acc += sdot(a, b)`.
///
/// # Safety
/// The CPU must support the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
#[inline]
unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` reads two vector registers and accumulates into a third; it touches no
    // memory and no flags, and the CPU supports it (this function's target features).
    unsafe {
        asm!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b, options(pure, nomem, nostack));
    }
    acc
}

/// `Σ q8[d] · code[d]` for one row.
///
/// # Safety
/// The CPU must support dotprod; the row holds `q.q8.len()` codes as [`int8_supported`] requires.
#[target_feature(enable = "neon,dotprod")]
unsafe fn idot(row: &[u8], bits: u8, q: &Q8) -> i32 {
    // SAFETY: every load reads 16 bytes inside `row` or `q.q8`; sdot is enabled.
    unsafe {
        let mut acc = vdupq_n_s32(0);
        if bits == 4 {
            let mask = vdupq_n_u8(0x0f);
            for (c, qs) in row.chunks_exact(16).zip(q.q8.chunks_exact(32)) {
                let v = vld1q_u8(c.as_ptr());
                // Byte j holds code j (low nibble) and code j + 16 (high nibble).
                let lo = vreinterpretq_s8_u8(vandq_u8(v, mask));
                let hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
                acc = sdot(acc, lo, vld1q_s8(qs.as_ptr()));
                acc = sdot(acc, hi, vld1q_s8(qs.as_ptr().add(16)));
            }
            vaddvq_s32(acc)
        } else {
            let shift = vdupq_n_u8(128);
            for (c, qs) in row.chunks_exact(16).zip(q.q8.chunks_exact(16)) {
                let v = vreinterpretq_s8_u8(vsubq_u8(vld1q_u8(c.as_ptr()), shift));
                acc = sdot(acc, v, vld1q_s8(qs.as_ptr()));
            }
            vaddvq_s32(acc) + 128 * q.sum
        }
    }
}

/// Scores through `sdot`; see [`crate::avx2::scores_int8`] for the algebra and error bound.
/// Returns `false`, computing nothing, when [`int8_supported`] is false.
pub fn scores_int8(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &mut [f32]) -> bool {
    if !int8_supported(b) {
        return false;
    }
    // SAFETY: `int8_supported` checked dotprod, the bit width and the row length.
    let dots = |b: &QuantBlock<'_>, q8: &Q8, dots: &mut [i32]| {
        for (r, o) in dots.iter_mut().enumerate() {
            // SAFETY: as above, for every row of the block.
            *o = unsafe { idot(b.row(r), b.bits, q8) };
        }
    };
    thread_local! {
        static SCRATCH: std::cell::RefCell<int8::Scratch<Q8>> = std::cell::RefCell::default();
    }
    SCRATCH.with_borrow_mut(|scratch| int8::scores_by_block(b, q, n_q, out, scratch, dots));
    true
}
