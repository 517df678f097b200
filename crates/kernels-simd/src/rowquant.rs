//! Row quantization kernels for streaming caches: the range scan, linear encoding and packing
//! of [`RowKernels`], with AVX2 versions on x86-64.
//!
//! `kvq-quant-core` defines the contract (bit-identical results to its portable `wide`
//! kernels) and the cache takes a [`RowKernels`] through its configuration, so neither of
//! those crates needs `unsafe` or knows which CPU it runs on. [`row_kernels`] picks the best
//! set for the selected [`Kernels`].
//!
//! The AVX2 encoder performs the portable arithmetic in the same order
//! (`((x − offset) · inv).max(lo).min(hi) + add`, each step an IEEE f32 operation) and rounds
//! with `vcvtps2dq` under the default round-to-nearest-even mode, which for values in
//! `[0, 255]` is exactly what the portable `1.5 · 2^23` trick computes. Minimum and maximum
//! do not depend on the order of a reduction (zeros are returned as `+0.0`), and packing is
//! integer work, so every result is bit-exact.

use kvq_quant_core::RowKernels;

use crate::dispatch::{DispatchError, Kernels};

/// The row kernels for `backend`: AVX2 for `avx2` and `avx512` (which has none of its own),
/// the portable `wide` ones for every other backend.
///
pub fn row_kernels_for(backend: Kernels) -> RowKernels {
    #[cfg(target_arch = "x86_64")]
    if backend.cpu().avx2 {
        return x86::AVX2;
    }
    let _ = backend;
    RowKernels::PORTABLE
}

/// The row kernels of the selected backend ([`crate::dispatch::selected`]: the best this CPU
/// has, or the one `KVQ_FORCE_BACKEND` names).
///
/// # Errors
/// As [`crate::dispatch::selected`]: an unknown or unavailable forced backend.
pub fn row_kernels() -> Result<RowKernels, DispatchError> {
    Ok(row_kernels_for(crate::dispatch::selected()?))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use kvq_quant_core::{Linear, RowKernels};

    /// Only handed out by [`super::row_kernels_for`] after checking that the CPU has AVX2 and
    /// FMA; the field functions are private to `RowKernels`, so no caller can reach them on a
    /// CPU without them.
    pub(super) const AVX2: RowKernels =
        RowKernels::new("avx2", stats, encode, pack).with_encode_pack(encode_pack);

    fn stats(x: &[f32]) -> (f32, f32, bool) {
        // SAFETY: reachable only through `AVX2`, which exists only on CPUs with AVX2 (above).
        unsafe { stats_avx2(x) }
    }

    fn encode(x: &[f32], l: &Linear, out: &mut [u8]) {
        // SAFETY: as for `stats`.
        unsafe { encode_avx2(x, l, out) }
    }

    fn encode_pack(x: &[f32], l: &Linear, bits: u8, out: &mut [u8]) -> bool {
        let n = x.len();
        let fits = match bits {
            8 => n.is_multiple_of(32) && out.len() == n,
            4 => n.is_multiple_of(32) && out.len() == n / 2,
            2 => n.is_multiple_of(64) && out.len() == n / 4,
            _ => false,
        };
        if fits {
            // SAFETY: as for `stats`; whole chunks and the exact output length checked above.
            unsafe { encode_pack_avx2(x, l, bits, out) };
        }
        fits
    }

    fn pack(codes: &[u8], bits: u8, out: &mut [u8]) {
        let n = codes.len();
        match bits {
            8 if out.len() == n => out.copy_from_slice(codes),
            // SAFETY: as for `stats`; lengths checked here (whole chunks, exact output).
            4 if n.is_multiple_of(32) && out.len() == n / 2 => unsafe { pack4_avx2(codes, out) },
            // SAFETY: likewise.
            2 if n.is_multiple_of(64) && out.len() == n / 4 => unsafe { pack2_avx2(codes, out) },
            // Other widths and ragged rows: the portable packer (lengths are the caller's
            // contract; a mismatch leaves `out` unchanged).
            _ => {
                let _ = kvq_quant_core::pack::pack_row(codes, bits, out);
            }
        }
    }

    /// Horizontal minimum and maximum of 8 lanes, by halving (the order does not matter for
    /// min/max of non-NaN values, and zeros are made `+0.0` by the caller).
    #[target_feature(enable = "avx2")]
    fn reduce_min_max(lo: __m256, hi: __m256) -> (f32, f32) {
        let lo = _mm_min_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps::<1>(lo));
        let hi = _mm_max_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps::<1>(hi));
        let lo = _mm_min_ps(lo, _mm_movehl_ps(lo, lo));
        let hi = _mm_max_ps(hi, _mm_movehl_ps(hi, hi));
        let lo = _mm_min_ss(lo, _mm_shuffle_ps::<1>(lo, lo));
        let hi = _mm_max_ss(hi, _mm_shuffle_ps::<1>(hi, hi));
        (_mm_cvtss_f32(lo), _mm_cvtss_f32(hi))
    }

    #[target_feature(enable = "avx2")]
    fn stats_avx2(x: &[f32]) -> (f32, f32, bool) {
        // Four independent accumulators, so the min/max chains overlap.
        let mut lo = [_mm256_set1_ps(f32::INFINITY); 4];
        let mut hi = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
        let mut nan = _mm256_setzero_ps();
        let mut chunks = x.chunks_exact(32);
        for c in &mut chunks {
            let p = c.as_ptr();
            // SAFETY: `c` holds 32 floats.
            let v = unsafe {
                [
                    _mm256_loadu_ps(p),
                    _mm256_loadu_ps(p.add(8)),
                    _mm256_loadu_ps(p.add(16)),
                    _mm256_loadu_ps(p.add(24)),
                ]
            };
            for k in 0..4 {
                lo[k] = _mm256_min_ps(lo[k], v[k]);
                hi[k] = _mm256_max_ps(hi[k], v[k]);
            }
            // Unordered: true where either operand is NaN.
            nan = _mm256_or_ps(
                nan,
                _mm256_or_ps(
                    _mm256_cmp_ps::<_CMP_UNORD_Q>(v[0], v[1]),
                    _mm256_cmp_ps::<_CMP_UNORD_Q>(v[2], v[3]),
                ),
            );
        }
        let mut rest = chunks.remainder().chunks_exact(8);
        for c in &mut rest {
            // SAFETY: `c` holds 8 floats.
            let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
            lo[0] = _mm256_min_ps(lo[0], v);
            hi[0] = _mm256_max_ps(hi[0], v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        }
        let (mut min, mut max) = reduce_min_max(
            _mm256_min_ps(_mm256_min_ps(lo[0], lo[1]), _mm256_min_ps(lo[2], lo[3])),
            _mm256_max_ps(_mm256_max_ps(hi[0], hi[1]), _mm256_max_ps(hi[2], hi[3])),
        );
        let mut any_nan = _mm256_movemask_ps(nan) != 0;
        for &v in rest.remainder() {
            any_nan |= v.is_nan();
            min = if v < min { v } else { min };
            max = if v > max { v } else { max };
        }
        let finite = !any_nan && min.is_finite() && max.is_finite() || x.is_empty();
        (min + 0.0, max + 0.0, finite)
    }

    /// Codes of 8 values as i32 lanes: `round(min(max((x − offset) · inv, lo), hi) + add)`,
    /// the portable operations in the portable order (operand order included, which decides
    /// what `max`/`min` return for a NaN from an overflowing `x − offset`).
    ///
    /// `AFFINE` (`lo = add = 0`) computes `round(min(hi, t))` instead, with the same result
    /// for every `t`: adding +0 changes no rounded value; a negative `t` converts to a negative
    /// integer (or `i32::MIN`) that the saturating packs turn into code 0, as clamping at 0
    /// would; and with `hi` as the first operand `min` passes a NaN `t` through, which converts
    /// to `i32::MIN` and so to code 0, the code the portable `max(NaN, 0) = 0` gives.
    #[target_feature(enable = "avx2")]
    fn codes8<const AFFINE: bool>(v: __m256, k: &[__m256; 5]) -> __m256i {
        let [off, inv, lo, hi, add] = *k;
        let t = _mm256_mul_ps(_mm256_sub_ps(v, off), inv);
        let t = if AFFINE {
            _mm256_min_ps(hi, t)
        } else {
            _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(t, lo), hi), add)
        };
        // Round to nearest even (the default MXCSR mode) and convert.
        _mm256_cvtps_epi32(t)
    }

    /// 32 codes from `p[0..32]`, in order, one per byte.
    ///
    /// # Safety
    /// `p` must point to 32 readable floats.
    #[target_feature(enable = "avx2")]
    unsafe fn codes32<const AFFINE: bool>(p: *const f32, k: &[__m256; 5]) -> __m256i {
        // SAFETY: the caller guarantees 32 floats at `p`.
        let (a, b, c, d) = unsafe {
            (
                codes8::<AFFINE>(_mm256_loadu_ps(p), k),
                codes8::<AFFINE>(_mm256_loadu_ps(p.add(8)), k),
                codes8::<AFFINE>(_mm256_loadu_ps(p.add(16)), k),
                codes8::<AFFINE>(_mm256_loadu_ps(p.add(24)), k),
            )
        };
        // Codes are in [0, 255] after the clamp, so the saturating packs are exact.
        // packs/packus work within 128-bit lanes; the permutation puts the bytes in order.
        let bytes = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    #[target_feature(enable = "avx2")]
    fn consts(l: &Linear) -> [__m256; 5] {
        [
            _mm256_set1_ps(l.offset),
            _mm256_set1_ps(l.inv),
            _mm256_set1_ps(l.lo),
            _mm256_set1_ps(l.hi),
            _mm256_set1_ps(l.add),
        ]
    }

    /// Encodes and packs whole chunks (8 bits: 32 values; 4 bits: 32; 2 bits: 64) straight
    /// into `out`, in the layout of `kvq_quant_core::pack`.
    #[target_feature(enable = "avx2")]
    fn encode_pack_avx2(x: &[f32], l: &Linear, bits: u8, out: &mut [u8]) {
        if l.lo == 0.0 && l.add == 0.0 {
            encode_pack_impl::<true>(x, l, bits, out)
        } else {
            encode_pack_impl::<false>(x, l, bits, out)
        }
    }

    #[target_feature(enable = "avx2")]
    fn encode_pack_impl<const AFFINE: bool>(x: &[f32], l: &Linear, bits: u8, out: &mut [u8]) {
        let k = consts(l);
        match bits {
            8 => {
                for (xs, os) in x.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
                    // SAFETY: 32 floats in, 32 bytes out.
                    unsafe {
                        _mm256_storeu_si256(os.as_mut_ptr().cast(), codes32::<AFFINE>(xs.as_ptr(), &k))
                    };
                }
            }
            4 => {
                for (xs, os) in x.chunks_exact(32).zip(out.chunks_exact_mut(16)) {
                    // SAFETY: 32 floats in, 16 bytes out.
                    unsafe {
                        _mm_storeu_si128(os.as_mut_ptr().cast(), plane4(codes32::<AFFINE>(xs.as_ptr(), &k)))
                    };
                }
            }
            _ => {
                debug_assert_eq!(bits, 2);
                for (xs, os) in x.chunks_exact(64).zip(out.chunks_exact_mut(16)) {
                    // SAFETY: 64 floats in (two runs of 32), 16 bytes out.
                    unsafe {
                        let (a, b) =
                            (codes32::<AFFINE>(xs.as_ptr(), &k), codes32::<AFFINE>(xs.as_ptr().add(32), &k));
                        _mm_storeu_si128(os.as_mut_ptr().cast(), plane2(a, b));
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx2")]
    fn encode_avx2(x: &[f32], l: &Linear, out: &mut [u8]) {
        if l.lo == 0.0 && l.add == 0.0 {
            encode_impl::<true>(x, l, out)
        } else {
            encode_impl::<false>(x, l, out)
        }
    }

    #[target_feature(enable = "avx2")]
    fn encode_impl<const AFFINE: bool>(x: &[f32], l: &Linear, out: &mut [u8]) {
        let n = x.len().min(out.len());
        let full = n / 32 * 32;
        let k = consts(l);
        for (xs, os) in x[..full].chunks_exact(32).zip(out[..full].chunks_exact_mut(32)) {
            // SAFETY: `xs` holds 32 floats and `os` 32 bytes.
            unsafe { _mm256_storeu_si256(os.as_mut_ptr().cast(), codes32::<AFFINE>(xs.as_ptr(), &k)) };
        }
        for (o, &v) in out[full..n].iter_mut().zip(&x[full..n]) {
            // The vector path's max/min semantics: a NaN becomes `lo`.
            let t = (v - l.offset) * l.inv;
            let t = if t > l.lo { t } else { l.lo };
            let t = if t < l.hi { t } else { l.hi };
            // The same ties-to-even rounding as the vector path.
            *o = (t + l.add).round_ties_even() as u8;
        }
    }

    /// One 16-byte chunk of a 4-bit plane from 32 codes in order (one per byte): byte j holds
    /// code j (low nibble) and code j + 16 (high nibble). Bits above the width are dropped.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn plane4(c: __m256i) -> __m128i {
        let mask = _mm_set1_epi8(0x0f);
        let low = _mm_and_si128(_mm256_castsi256_si128(c), mask);
        let high = _mm_and_si128(_mm256_extracti128_si256::<1>(c), mask);
        _mm_or_si128(low, _mm_slli_epi16::<4>(high))
    }

    /// One 16-byte chunk of a 2-bit plane from 64 codes in order (`a`: codes 0..32, `b`:
    /// 32..64): byte j holds codes j, j + 16, j + 32 and j + 48 in bits 0-1, 2-3, 4-5, 6-7.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn plane2(a: __m256i, b: __m256i) -> __m128i {
        let mask = _mm_set1_epi8(0x03);
        let q0 = _mm_and_si128(_mm256_castsi256_si128(a), mask);
        let q1 = _mm_and_si128(_mm256_extracti128_si256::<1>(a), mask);
        let q2 = _mm_and_si128(_mm256_castsi256_si128(b), mask);
        let q3 = _mm_and_si128(_mm256_extracti128_si256::<1>(b), mask);
        _mm_or_si128(
            _mm_or_si128(q0, _mm_slli_epi16::<2>(q1)),
            _mm_or_si128(_mm_slli_epi16::<4>(q2), _mm_slli_epi16::<6>(q3)),
        )
    }

    #[target_feature(enable = "avx2")]
    fn pack4_avx2(codes: &[u8], out: &mut [u8]) {
        for (c, o) in codes.chunks_exact(32).zip(out.chunks_exact_mut(16)) {
            // SAFETY: `c` holds 32 bytes, `o` 16.
            unsafe { _mm_storeu_si128(o.as_mut_ptr().cast(), plane4(_mm256_loadu_si256(c.as_ptr().cast()))) };
        }
    }

    #[target_feature(enable = "avx2")]
    fn pack2_avx2(codes: &[u8], out: &mut [u8]) {
        for (c, o) in codes.chunks_exact(64).zip(out.chunks_exact_mut(16)) {
            // SAFETY: `c` holds 64 bytes (two 32-byte loads), `o` 16.
            unsafe {
                let p = c.as_ptr();
                let v = plane2(_mm256_loadu_si256(p.cast()), _mm256_loadu_si256(p.add(32).cast()));
                _mm_storeu_si128(o.as_mut_ptr().cast(), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::available;
    use kvq_quant_core::pack::packed_len;
    use kvq_quant_core::synth::Rng;
    use kvq_quant_core::{Codec, GroupParams, Linear, QuantSpec, quantize_row_with};

    /// Every available set of row kernels against the portable one, bit for bit.
    fn each_kernel_set(mut check: impl FnMut(&RowKernels)) {
        for b in available() {
            check(&row_kernels_for(b));
        }
    }

    fn random_row(rng: &mut Rng, n: usize, special: usize) -> Vec<f32> {
        let scale = [1.0f32, 1e-30, 3e4, 1e-3][special % 4];
        let mut x: Vec<f32> = (0..n).map(|_| rng.normal() as f32 * scale).collect();
        match special {
            4 => x.iter_mut().for_each(|v| *v = 0.0),
            5 => x.iter_mut().enumerate().for_each(|(i, v)| *v = if i % 2 == 0 { -0.0 } else { 0.0 }),
            6 => x.iter_mut().for_each(|v| *v = 1.5),
            7 if n > 0 => x[n / 2] = f32::NAN,
            8 if n > 0 => x[n - 1] = f32::INFINITY,
            9 => x.iter_mut().for_each(|v| *v = (*v * 4.0).round() * 0.5), // many ties
            // Near f32::MAX: `x − offset` overflows to ±Inf for far offsets.
            10 => x
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = if i % 3 == 0 { 3e38 } else { -3e38 * (i % 2) as f32 }),
            _ => {}
        }
        x
    }

    #[test]
    fn stats_match_portable() {
        let mut rng = Rng::new(11);
        each_kernel_set(|k| {
            for n in (0..80).chain([127, 128, 129, 255, 256, 1000]) {
                for special in 0..10 {
                    let x = random_row(&mut rng, n, special);
                    let (a, b) = (k.stats(&x), RowKernels::PORTABLE.stats(&x));
                    assert_eq!(a.2, b.2, "{} n={n} special={special}", k.name());
                    if b.2 {
                        assert_eq!((a.0.to_bits(), a.1.to_bits()), (b.0.to_bits(), b.1.to_bits()), "{n}");
                    }
                }
            }
        });
    }

    #[test]
    fn encode_matches_portable_on_ties_and_extremes() {
        let mut rng = Rng::new(12);
        each_kernel_set(|k| {
            for n in (0..70).chain([96, 127, 128, 129, 200]) {
                for special in [0, 1, 2, 3, 4, 5, 6, 9, 10] {
                    let x = random_row(&mut rng, n, special);
                    let (lo, hi, _) = RowKernels::PORTABLE.stats(&x);
                    for l in [
                        Linear { offset: lo, inv: 15.0 / (hi - lo).max(1e-30), lo: 0.0, hi: 15.0, add: 0.0 },
                        Linear { offset: 0.0, inv: 2.0, lo: -7.0, hi: 7.0, add: 8.0 },
                        Linear { offset: -0.3, inv: 0.0, lo: 0.0, hi: 255.0, add: 0.0 },
                        Linear { offset: 0.0, inv: 1e30, lo: -127.0, hi: 127.0, add: 128.0 },
                        Linear { offset: 0.25, inv: 1.0, lo: 0.0, hi: 3.0, add: 0.0 },
                        Linear { offset: 0.0, inv: 1.0, lo: -1.0, hi: 1.0, add: 2.0 },
                        // Inf · 0 = NaN lanes, and ±Inf lanes.
                        Linear { offset: -3e38, inv: 0.0, lo: 0.0, hi: 15.0, add: 0.0 },
                        Linear { offset: 3e38, inv: 0.0, lo: -7.0, hi: 7.0, add: 8.0 },
                        Linear { offset: -3e38, inv: 2.0, lo: 0.0, hi: 255.0, add: 0.0 },
                    ] {
                        let (mut a, mut b) = (vec![0u8; n], vec![7u8; n]);
                        k.encode(&x, &l, &mut a);
                        RowKernels::PORTABLE.encode(&x, &l, &mut b);
                        assert_eq!(a, b, "{} n={n} special={special} {l:?}", k.name());
                        // The fused path, where the kernels have one, packs the same codes.
                        for bits in [2u8, 4, 8] {
                            if l.hi + l.add >= (1u32 << bits) as f32 {
                                continue;
                            }
                            let len = packed_len(n, bits).unwrap();
                            let (mut fused, mut plain) = (vec![0u8; len], vec![0u8; len]);
                            RowKernels::PORTABLE.pack(&b, bits, &mut plain).unwrap();
                            if k.encode_pack(&x, &l, bits, &mut fused).unwrap() {
                                assert_eq!(fused, plain, "{} fused n={n} bits={bits} {l:?}", k.name());
                            } else {
                                assert!(fused.iter().all(|&c| c == 0), "declined but wrote");
                            }
                        }
                    }
                }
            }
            // A shorter output encodes only its length.
            let mut short = [9u8; 3];
            k.encode(&[1.0; 40], &Linear { offset: 0.0, inv: 1.0, lo: 0.0, hi: 255.0, add: 0.0 }, &mut short);
            assert_eq!(short, [1, 1, 1]);
        });
    }

    #[test]
    fn pack_matches_portable_for_every_width() {
        let mut rng = Rng::new(13);
        each_kernel_set(|k| {
            for bits in 1..=8u8 {
                for n in [1, 7, 16, 31, 32, 33, 64, 96, 127, 128, 256, 320] {
                    // Codes with stray high bits, which packing must ignore.
                    let codes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                    let len = packed_len(n, bits).unwrap();
                    let (mut a, mut b) = (vec![0u8; len], vec![0u8; len]);
                    k.pack(&codes, bits, &mut a).unwrap();
                    RowKernels::PORTABLE.pack(&codes, bits, &mut b).unwrap();
                    assert_eq!(a, b, "{} bits={bits} n={n}", k.name());
                }
            }
            assert!(k.pack(&[0; 32], 4, &mut [0; 15]).is_err());
            assert!(k.pack(&[0; 32], 9, &mut [0; 32]).is_err());
        });
    }

    #[test]
    fn quantized_rows_match_portable() {
        let mut rng = Rng::new(14);
        each_kernel_set(|k| {
            for spec in
                ["int4-token", "int8-token", "int2-token", "int3-token", "sym4-token", "int4-g32", "sym8-g64"]
            {
                let spec: QuantSpec = spec.parse().unwrap();
                let codec = Codec::new(&spec, None);
                for special in [0, 1, 2, 3, 4, 5, 6, 7, 9] {
                    let x = random_row(&mut rng, 128, special);
                    let seg = match spec.granularity() {
                        kvq_quant_core::Granularity::Group(g) => g,
                        _ => 128,
                    };
                    let run = |k: &RowKernels| {
                        let mut p = vec![GroupParams::default(); 128 / seg];
                        let mut scratch = vec![0u8; 128];
                        let mut packed = vec![0u8; packed_len(128, spec.bits()).unwrap()];
                        let r = quantize_row_with(
                            k,
                            &codec,
                            spec.bits(),
                            &x,
                            seg,
                            &mut p,
                            &mut scratch,
                            &mut packed,
                        );
                        (
                            r.map_err(|e| e.to_string()),
                            p.iter().map(|p| (p.scale.to_bits(), p.offset.to_bits())).collect::<Vec<_>>(),
                            packed,
                        )
                    };
                    assert_eq!(run(k), run(&RowKernels::PORTABLE), "{} {spec} special={special}", k.name());
                }
            }
        });
    }

    #[test]
    fn the_portable_kernels_are_wides() {
        assert_eq!(row_kernels_for(Kernels::WIDE), RowKernels::PORTABLE);
        assert_eq!(row_kernels_for(Kernels::SCALAR), RowKernels::PORTABLE);
    }
}
