//! The exponentials of an online softmax: `x[i] ← exp(x[i] − m)` and their sum, for the
//! scores of one query row against one block.
//!
//! The vector versions evaluate `exp` as `2^k · p(r)` with `k = round(x · log2 e)`,
//! `r = x − k ln 2` (in two parts, Cody–Waite) and a degree-6 polynomial for `e^r` on
//! `|r| ≤ ln 2 / 2` (the Cephes `expf` coefficients): within 2 ulp of `f32::exp` for arguments
//! in `[-87, 0]`. Arguments below −87 (weights under 2^-125 next to the row's maximum of 1)
//! give 0, and so does −∞; a NaN argument gives NaN, as `f32::exp` does, so that a NaN score
//! poisons its softmax instead of vanishing from it. [`exp_sum_scalar`] (through `f32::exp`)
//! is the reference.

use crate::dispatch::{Backend, Kernels};

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];
/// Arguments below this flush to 0.
const LOWEST: f32 = -87.0;

/// `x[i] ← exp(x[i] − m)`, returning `Σ x[i]`, with `backend`'s code (AVX2 for `avx2` and
/// `avx512`, `wide` for `wide` and `dotprod`, the reference for `scalar`).
pub fn exp_sum_with(backend: Kernels, x: &mut [f32], m: f32) -> f32 {
    match backend.backend() {
        Backend::Scalar => exp_sum_scalar(x, m),
        #[cfg(target_arch = "x86_64")]
        _ if backend.cpu().avx2 => {
            // SAFETY: detection found AVX2 and FMA for these kernels (`Kernels::cpu`).
            unsafe { x86::exp_sum(x, m) }
        }
        _ => exp_sum_wide(x, m),
    }
}

/// The reference: `f32::exp` element by element, summed in order.
pub fn exp_sum_scalar(x: &mut [f32], m: f32) -> f32 {
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    sum
}

/// One lane of the polynomial, for tails (the same operations as the vector lanes).
#[inline]
fn exp_lane(t: f32) -> f32 {
    if t.is_nan() {
        return t;
    }
    if t < LOWEST {
        return 0.0;
    }
    let t = t.min(88.0);
    let k = (t * LOG2E).round_ties_even();
    let r = (t - k * LN2_HI) - k * LN2_LO;
    let mut p = P[0];
    for c in &P[1..] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    y * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// The `wide` version (SSE2 in default x86-64 builds, NEON on aarch64).
pub fn exp_sum_wide(x: &mut [f32], m: f32) -> f32 {
    use wide::{f32x8, i32x8};
    let n = x.len() / 8 * 8;
    let (mv, lowest, highest) = (f32x8::splat(m), f32x8::splat(LOWEST), f32x8::splat(88.0));
    let mut acc = f32x8::ZERO;
    for c in x[..n].chunks_exact_mut(8) {
        let t0 = f32x8::from(<[f32; 8]>::try_from(&*c).expect("8 lanes")) - mv;
        let keep = t0.simd_ge(lowest);
        let t = t0;
        let t = t.fast_min(highest).fast_max(lowest);
        let k = (t * f32x8::splat(LOG2E)).round();
        let r = (t - k * f32x8::splat(LN2_HI)) - k * f32x8::splat(LN2_LO);
        let mut p = f32x8::splat(P[0]);
        for &coef in &P[1..] {
            p = p * r + f32x8::splat(coef);
        }
        let y = p * (r * r) + r + f32x8::ONE;
        let two_k: f32x8 = bytemuck_cast((k.round_int() + i32x8::splat(127)) << 23);
        let e = t0.is_nan().select(t0, (y * two_k) & keep);
        c.copy_from_slice(&e.to_array());
        acc += e;
    }
    let mut sum = acc.reduce_add();
    for v in &mut x[n..] {
        *v = exp_lane(*v - m);
        sum += *v;
    }
    sum
}

/// Reinterprets the bits of an `i32x8` as an `f32x8`.
#[inline]
fn bytemuck_cast(v: wide::i32x8) -> wide::f32x8 {
    let a = v.to_array();
    wide::f32x8::from(a.map(|b| f32::from_bits(b as u32)))
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::{LN2_HI, LN2_LO, LOG2E, LOWEST, P, exp_lane};

    /// `exp` of 8 arguments `t0` (already less the row's maximum), as the module describes:
    /// 0 below the cut-off and for −∞, NaN for NaN.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) unsafe fn exp8(t0: __m256) -> __m256 {
        let (lowest, highest) = (_mm256_set1_ps(LOWEST), _mm256_set1_ps(88.0));
        let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(t0, lowest);
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(t0, t0);
        let t = _mm256_max_ps(_mm256_min_ps(t0, highest), lowest);
        let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            t,
            _mm256_set1_ps(LOG2E),
        ));
        let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_HI), t));
        let mut p = _mm256_set1_ps(P[0]);
        for &coef in &P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(coef));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        let two_k = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(k),
            _mm256_set1_epi32(127),
        )));
        _mm256_blendv_ps(_mm256_and_ps(_mm256_mul_ps(y, two_k), keep), t0, nan)
    }

    /// [`exp8`] on 16 lanes in 512-bit registers: the same operations lane for lane, so the
    /// same bits.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    pub(crate) unsafe fn exp16(t0: __m512) -> __m512 {
        let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(t0, _mm512_set1_ps(LOWEST));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(t0, t0);
        let t = _mm512_max_ps(_mm512_min_ps(t0, _mm512_set1_ps(88.0)), _mm512_set1_ps(LOWEST));
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            t,
            _mm512_set1_ps(LOG2E),
        ));
        let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_HI), t));
        let mut p = _mm512_set1_ps(P[0]);
        for &coef in &P[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coef));
        }
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
        let two_k = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(k),
            _mm512_set1_epi32(127),
        )));
        _mm512_mask_mov_ps(_mm512_maskz_mul_ps(keep, y, two_k), nan, t0)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum(x: &mut [f32], m: f32) -> f32 {
        let n = x.len() / 8 * 8;
        let mv = _mm256_set1_ps(m);
        let mut acc = _mm256_setzero_ps();
        for c in x[..n].chunks_exact_mut(8) {
            // SAFETY: `c` holds 8 floats; the CPU supports AVX2 and FMA (this function's contract).
            let e = unsafe { exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv)) };
            // SAFETY: `c` holds 8 floats.
            unsafe { _mm256_storeu_ps(c.as_mut_ptr(), e) };
            acc = _mm256_add_ps(acc, e);
        }
        let mut lanes = [0f32; 8];
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        let mut sum: f32 = lanes.iter().sum();
        for v in &mut x[n..] {
            *v = exp_lane(*v - m);
            sum += *v;
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::available;
    use kvq_quant_core::synth::Rng;

    fn check(backend: Kernels, x: &[f32], m: f32) {
        let (mut got, mut want) = (x.to_vec(), x.to_vec());
        let s = exp_sum_with(backend, &mut got, m);
        let w = exp_sum_scalar(&mut want, m);
        for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
            let t = x[i] - m;
            if backend == Backend::Scalar {
                assert_eq!(g.to_bits(), e.to_bits());
            } else if t.is_nan() {
                assert!(g.is_nan(), "{backend} exp({t}) = {g}, the reference gives NaN");
            } else if t < LOWEST {
                assert_eq!(g, 0.0, "{backend} exp({t})");
            } else {
                // 2 ulp of the reference, plus the subnormal range near the cut-off.
                assert!((g - e).abs() <= 2.5 * f32::EPSILON * e + 1e-37, "{backend} exp({t}): {g} vs {e}");
            }
        }
        let total: f32 = want.iter().sum();
        if total.is_nan() {
            assert!(s.is_nan() && w.is_nan(), "{backend} sum {s} of a NaN row");
            return;
        }
        assert!((s - total).abs() <= 1e-5 * total + 1e-30, "{backend} sum {s} vs {total}");
        assert!((w - total).abs() <= 1e-5 * total + 1e-30);
    }

    #[test]
    fn every_backend_matches_libm() {
        let mut rng = Rng::new(21);
        for backend in available() {
            for n in (0..40).chain([63, 64, 65, 100, 1000]) {
                let x: Vec<f32> = (0..n).map(|_| -(rng.uniform() as f32) * 100.0).collect();
                let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max).max(-1.0);
                check(backend, &x, m);
                // Scores around a positive maximum, as a real softmax sees them.
                let y: Vec<f32> = (0..n).map(|_| rng.normal() as f32 * 5.0 + 3.0).collect();
                let my = y.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                check(backend, &y, my);
            }
            // Special values: the maximum itself, the cut-off, far below it, −∞.
            let s = [0.0, -1e-30, -0.5, -0.3465736, -86.99, -87.0, -87.01, -200.0, f32::NEG_INFINITY, -1e30];
            let xs: Vec<f32> = s.iter().cycle().take(37).copied().collect();
            check(backend, &xs, 0.0);
            // NaN arguments, in the vector body and in the tail (the reference gives NaN).
            for n in [1, 7, 8, 9, 17, 33] {
                for at in [0, n / 2, n - 1] {
                    let mut x = vec![-1.0f32; n];
                    x[at] = f32::NAN;
                    check(backend, &x, 0.0);
                }
            }
        }
    }

    #[test]
    fn polynomial_lane_is_accurate_on_a_fine_grid() {
        let mut t = -87.0f32;
        while t <= 0.0 {
            let (g, e) = (exp_lane(t), t.exp());
            assert!((g - e).abs() <= 2.0 * f32::EPSILON * e + 1e-37, "exp({t}): {g} vs {e}");
            t += 0.0137;
        }
    }
}
