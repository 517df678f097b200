//! Matrix products of GGML-quantized weights (blocks of 32: Q4_0, Q4_1, Q8_0, as GGUF files
//! store them) with activations rounded to 8 bits per block of 32, as llama.cpp multiplies
//! them: each block's integer dot product, scaled by the weight's and the activation's scales
//! (plus Q4_1's offset times the activation block's sum).
//!
//! [`matmul_t`] writes `out[r * n + t]`, weight row `r` against activation row `t`: a weight
//! row is dotted with every activation row while it is in L1, so a prefill chunk reads the
//! weights from memory once. The scalar reference and the AVX2 and AVX-512 VNNI kernels
//! (runtime-detected; tiles of two weight rows by four activation rows) compute the same
//! integer sums; only the order of the float accumulation differs. On aarch64 this unpacked
//! product is the scalar reference; the repacked one ([`crate::ggml_packed`], what a model
//! multiplies) has NEON kernels, and [`Activations::quantize_with`] rounds with NEON.

use half::f16;

use crate::block::KernelError;
use crate::dispatch::{Backend, Kernels};

/// Values per block.
pub const QK: usize = 32;

/// The GGML block types these kernels multiply: blocks of 32 values, and the K-quants'
/// super-blocks of 256 (eight blocks of 32, or sixteen of 16 for Q6_K, whose scales are
/// themselves quantized). [`matmul_t`] multiplies the blocks of 32 as stored;
/// [`crate::ggml_packed::PackedWeights`] repacks every type, the K-quants into blocks of 32
/// with f32 scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgmlType {
    /// f16 scale, 32 4-bit codes: `d * (q - 8)`.
    Q4_0,
    /// f16 scale and f16 minimum, 32 4-bit codes: `d * q + m`.
    Q4_1,
    /// f16 scale, 32 signed 8-bit codes: `d * q`.
    Q8_0,
    /// f16 scale, 32 5-bit codes (the fifth bits in a 32-bit word): `d * (q - 16)`.
    Q5_0,
    /// f16 scale and f16 minimum, 32 5-bit codes: `d * q + m`.
    Q5_1,
    /// Super-blocks of 256: f16 `d` and `dmin`, eight 6-bit scales and minimums, 4-bit codes:
    /// `d * sc_j * q - dmin * m_j` in block `j` of 32.
    Q4K,
    /// As [`GgmlType::Q4K`] with a fifth bit per code (codes 0..32).
    Q5K,
    /// Super-blocks of 256: f16 `d`, sixteen signed 8-bit scales, 6-bit codes:
    /// `d * sc_j * (q - 32)` in block `j` of 16.
    Q6K,
}

impl GgmlType {
    /// Values per block: 32, or 256 for the K-quants' super-blocks.
    pub fn block_values(self) -> usize {
        match self {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q5_1 => QK,
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K,
        }
    }

    /// Bytes of one block of [`GgmlType::block_values`] values.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q8_0 => 34,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Bytes of a row of `k` values (`k` a multiple of [`GgmlType::block_values`]).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_values() * self.block_bytes()
    }

    /// Whether this is a K-quant (super-blocks of 256).
    pub fn is_k_quant(self) -> bool {
        self.block_values() == QK_K
    }

    /// Whether [`matmul_t`] multiplies rows of this type as stored (Q4_0, Q4_1, Q8_0); every
    /// type is multiplied repacked ([`crate::ggml_packed`]).
    pub fn multiplied_as_stored(self) -> bool {
        matches!(self, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
    }
}

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

/// Activation rows rounded to 8 bits per block of 32 (a scale `max|x| / 127` per block), with
/// each block's sum of codes.
#[derive(Debug, Clone, Default)]
pub struct Activations {
    codes: Vec<i8>,
    scales: Vec<f32>,
    sums: Vec<i32>,
    /// Block-major copies for the SIMD kernels, rows padded to a multiple of 4 with zeros
    /// (codes too): `[block][row]` scales, and scales times sums.
    bm_scales: Vec<f32>,
    bm_scaled_sums: Vec<f32>,
    k: usize,
    rows: usize,
}

impl Activations {
    /// Empty; [`Activations::quantize`] fills it, reusing its buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The codes (rows padded to a multiple of 4 with zeros), and the block-major scales and
    /// scaled sums (`[block][padded row]`).
    pub(crate) fn parts(&self) -> (&[i8], &[f32], &[f32]) {
        (&self.codes, &self.bm_scales, &self.bm_scaled_sums)
    }

    /// Block `b` of row `t` against a weight block's codes as [`unpack_row`] leaves them: the
    /// integer dot, the activation block's sum of codes and its scale.
    pub(crate) fn block_dot(&self, ty: GgmlType, t: usize, b: usize, w: &[u8]) -> (i32, i32, f32) {
        let ab = t * (self.k / QK) + b;
        (block_dot(ty, w, &self.codes[ab * QK..(ab + 1) * QK]), self.sums[ab], self.scales[ab])
    }

    /// Block `b` of row `t`: its codes and its scale.
    pub(crate) fn block_codes(&self, t: usize, b: usize) -> (&[i8], f32) {
        let ab = t * (self.k / QK) + b;
        (&self.codes[ab * QK..(ab + 1) * QK], self.scales[ab])
    }

    /// Rounds the rows of `x` (`x.len() / k` rows of `k` values), on this process's backend
    /// ([`crate::dispatch::selected`]).
    ///
    /// # Errors
    /// [`KernelError::Shape`] when `k` is not a positive multiple of 32 or does not divide
    /// `x.len()`, or a value is not finite.
    pub fn quantize(&mut self, x: &[f32], k: usize) -> Result<(), KernelError> {
        self.quantize_with(crate::dispatch::selected().unwrap_or_else(|_| crate::dispatch::detect()), x, k)
    }

    /// [`Activations::quantize`] on `backend` (AVX2 where it is available, the scalar
    /// reference otherwise): the same codes, scales and sums to the bit on every backend.
    ///
    /// # Errors
    /// As [`Activations::quantize`]; the activations are then empty.
    pub fn quantize_with(&mut self, backend: Kernels, x: &[f32], k: usize) -> Result<(), KernelError> {
        if k == 0 || !k.is_multiple_of(QK) || !x.len().is_multiple_of(k) {
            return Err(KernelError::Shape(format!("{} values in rows of {k} (a multiple of 32)", x.len())));
        }
        let blocks = x.len() / QK;
        let rows = x.len() / k;
        let padded = rows.next_multiple_of(4);
        self.codes.clear();
        self.codes.resize(padded * k, 0);
        self.scales.resize(blocks, 0.0);
        self.sums.resize(blocks, 0);
        let codes = &mut self.codes[..x.len()];
        let finite = match quantize_implementation(backend) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `quantize_implementation` returns Avx2 only for kernels whose detection found
            // AVX2.
            Backend::Avx2 => unsafe { x86::quantize_blocks(x, codes, &mut self.scales, &mut self.sums) },
            #[cfg(target_arch = "aarch64")]
            Backend::Wide => arm::quantize_blocks(x, codes, &mut self.scales, &mut self.sums),
            _ => scalar_quantize_blocks(x, codes, &mut self.scales, &mut self.sums),
        };
        if !finite {
            (self.k, self.rows) = (0, 0);
            let v = x.iter().find(|v| !v.is_finite()).copied().unwrap_or(f32::NAN);
            return Err(KernelError::Shape(format!("a non-finite activation ({v})")));
        }
        let per_row = k / QK;
        self.bm_scales.clear();
        self.bm_scales.resize(per_row * padded, 0.0);
        self.bm_scaled_sums.clear();
        self.bm_scaled_sums.resize(per_row * padded, 0.0);
        for (i, (&d, &sum)) in self.scales.iter().zip(&self.sums).enumerate() {
            let (t, b) = (i / per_row, i % per_row);
            self.bm_scales[b * padded + t] = d;
            self.bm_scaled_sums[b * padded + t] = d * sum as f32;
        }
        self.k = k;
        self.rows = rows;
        Ok(())
    }
}

/// The code that [`Activations::quantize_with`] runs for `backend`: AVX2's where the CPU
/// has it (the AVX2 and AVX-512 backends), NEON's on aarch64 (the `wide` and dotprod
/// backends), the scalar reference otherwise.
pub fn quantize_implementation(backend: Kernels) -> Backend {
    match backend.backend() {
        Backend::Wide | Backend::Dotprod if cfg!(target_arch = "aarch64") => Backend::Wide,
        _ if backend.cpu().avx2 => Backend::Avx2,
        _ => Backend::Scalar,
    }
}

/// The reference rounding of blocks of 32 values to 8-bit codes: scale `max|x| / 127`, codes
/// `round(x / scale)` (halves away from zero), and each block's sum of codes. Returns whether
/// every value was finite (the codes are meaningless where one was not).
pub fn scalar_quantize_blocks(x: &[f32], codes: &mut [i8], scales: &mut [f32], sums: &mut [i32]) -> bool {
    let mut finite = true;
    for (((xs, cs), scale), total) in
        x.chunks_exact(QK).zip(codes.chunks_exact_mut(QK)).zip(scales.iter_mut()).zip(sums.iter_mut())
    {
        finite &= xs.iter().all(|v| v.is_finite());
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (c, &v) in cs.iter_mut().zip(xs) {
            *c = (v * inv).round().clamp(-127.0, 127.0) as i8;
            sum += i32::from(*c);
        }
        *scale = d;
        *total = sum;
    }
    finite
}

/// The code that [`matmul_t`] runs for `backend`: AVX-512 VNNI's (`vpdpbusd` on 256-bit
/// registers) where the CPU has it, AVX2's for the AVX2 backend (and an AVX-512 CPU without
/// VNNI), the scalar reference otherwise.
pub fn implementation(backend: Kernels) -> Backend {
    let cpu = backend.cpu();
    if cpu.vnni {
        Backend::Avx512
    } else if cpu.avx2 {
        Backend::Avx2
    } else {
        Backend::Scalar
    }
}

/// `out[r * n + t]` = weight row `r` of `weights` · activation row `t` of `act`, for every
/// row of `weights` (rows of `act.k()` values of type `ty`) and the `n = act.rows()`
/// activation rows.
///
/// # Errors
/// [`KernelError::Shape`] when `weights` is not whole rows or `out` is not `rows * n` long.
pub fn matmul_t(
    backend: Kernels,
    ty: GgmlType,
    weights: &[u8],
    act: &Activations,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if !ty.multiplied_as_stored() {
        return Err(KernelError::Shape(format!(
            "{ty:?} rows are multiplied repacked (ggml_packed::PackedWeights), not as stored"
        )));
    }
    let row_bytes = ty.row_bytes(act.k);
    if act.k == 0 || row_bytes == 0 || !weights.len().is_multiple_of(row_bytes) {
        return Err(KernelError::Shape(format!(
            "{} bytes of weights in rows of {row_bytes} ({} values of {ty:?})",
            weights.len(),
            act.k
        )));
    }
    let rows = weights.len() / row_bytes;
    if out.len() != rows * act.rows {
        return Err(KernelError::Shape(format!("out has {} values, not {rows} × {}", out.len(), act.rows)));
    }
    match implementation(backend) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `implementation` returns Avx2 only where AVX2, FMA and F16C are available.
        Backend::Avx2 => unsafe { x86::matmul_t_avx2(ty, weights, act, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `implementation` returns Avx512 only where AVX-512 (F, BW, VL), VNNI, AVX2,
        // FMA and F16C are available.
        Backend::Avx512 => unsafe { x86::matmul_t_vnni(ty, weights, act, out) },
        _ => scalar_matmul_t(ty, weights, act, out),
    }
    Ok(())
}

/// One weight row's codes, a byte each in the order of the values (Q4 codes as stored, 0..16;
/// Q8 codes as signed bytes), and its scales and minimums as f32.
fn unpack_row(ty: GgmlType, row: &[u8], codes: &mut [u8], d: &mut [f32], m: &mut [f32]) {
    for (b, block) in row.chunks_exact(ty.block_bytes()).enumerate() {
        d[b] = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let (quants, min) = match ty {
            GgmlType::Q4_1 => (&block[4..], f16::from_le_bytes([block[2], block[3]]).to_f32()),
            _ => (&block[2..], 0.0),
        };
        m[b] = min;
        let out = &mut codes[b * QK..(b + 1) * QK];
        match ty {
            GgmlType::Q8_0 => out.copy_from_slice(quants),
            _ => {
                for j in 0..QK / 2 {
                    out[j] = quants[j] & 0x0F;
                    out[j + QK / 2] = quants[j] >> 4;
                }
            }
        }
    }
}

/// The integer dot product of one block (or part of one): weight codes as [`unpack_row`]
/// leaves them, against activation codes.
pub(crate) fn block_dot(ty: GgmlType, w: &[u8], a: &[i8]) -> i32 {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q6K => {
            w.iter().zip(a).map(|(&w, &a)| i32::from(w as i8) * i32::from(a)).sum()
        }
        _ => w.iter().zip(a).map(|(&w, &a)| i32::from(w) * i32::from(a)).sum(),
    }
}

/// The float epilogue of one block: the integer dot scaled, Q4_0's centre and Q4_1's minimum.
#[inline]
pub(crate) fn block_value(ty: GgmlType, dot: i32, sum: i32, dw: f32, mw: f32, da: f32) -> f32 {
    match ty {
        GgmlType::Q4_0 => dw * da * (dot - 8 * sum) as f32,
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => {
            dw * da * dot as f32 + mw * da * sum as f32
        }
        GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::Q6K => dw * da * dot as f32,
    }
}

/// The reference: one block at a time, in order.
/// Each block's integer dot is scaled by both scales, plus Q4_0's centre (`-8 d`) or Q4_1's
/// minimum times the activation block's scaled sum; the AVX2 kernel folds both into one term.
pub fn scalar_matmul_t(ty: GgmlType, weights: &[u8], act: &Activations, out: &mut [f32]) {
    let (k, n) = (act.k, act.rows);
    let blocks = k / QK;
    let mut codes = vec![0u8; k];
    let (mut d, mut m) = (vec![0f32; blocks], vec![0f32; blocks]);
    for (r, row) in weights.chunks_exact(ty.row_bytes(k)).enumerate() {
        unpack_row(ty, row, &mut codes, &mut d, &mut m);
        for t in 0..n {
            let mut acc = 0f32;
            for b in 0..blocks {
                let ab = t * blocks + b;
                let dot = block_dot(ty, &codes[b * QK..(b + 1) * QK], &act.codes[ab * QK..(ab + 1) * QK]);
                acc += block_value(ty, dot, act.sums[ab], d[b], m[b], act.scales[ab]);
            }
            out[r * n + t] = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Activations, GgmlType, QK};

    /// [`super::scalar_quantize_blocks`] with AVX2, to the bit: the same maximum, scale and
    /// reciprocal, and `roundf`'s halves away from zero (truncate, then step away where the
    /// dropped fraction is at least a half; both steps exact).
    ///
    /// # Safety
    /// AVX2 is available; `codes` holds `x.len()` values, `scales` and `sums` a block each.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_blocks(
        x: &[f32],
        codes: &mut [i8],
        scales: &mut [f32],
        sums: &mut [i32],
    ) -> bool {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let inf = _mm256_set1_ps(f32::INFINITY);
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let mut finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for (((xs, cs), scale), total) in
            x.chunks_exact(QK).zip(codes.chunks_exact_mut(QK)).zip(scales.iter_mut()).zip(sums.iter_mut())
        {
            // SAFETY: a chunk holds 32 values, four loads of eight.
            let v = unsafe { [0, 8, 16, 24].map(|i| _mm256_loadu_ps(xs.as_ptr().add(i))) };
            let a = v.map(|v| _mm256_and_ps(v, abs_mask));
            for a in a {
                // NaN compares false, as does ±∞.
                finite = _mm256_and_ps(finite, _mm256_cmp_ps::<_CMP_LT_OQ>(a, inf));
            }
            // The maximum of |x| (exact in any order; NaNs only where the block is refused).
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
            let d = _mm_cvtss_f32(m) / 127.0;
            let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let q = v.map(|v| {
                let y = _mm256_mul_ps(v, inv);
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                let frac = _mm256_and_ps(_mm256_sub_ps(y, t), abs_mask);
                let step = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), one);
                let r = _mm256_add_ps(t, _mm256_or_ps(step, _mm256_and_ps(y, sign_mask)));
                _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
            });
            let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let sum = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            let sum = _mm_add_epi32(sum, _mm_shuffle_epi32::<0b01_00_11_10>(sum));
            let sum = _mm_add_epi32(sum, _mm_shuffle_epi32::<0b10_11_00_01>(sum));
            // Four lanes of i32 to i8 (saturation cannot bite: |q| <= 127); packs interleave
            // the 128-bit halves, the permute puts them back in order.
            let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(q[0], q[1]));
            let z = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(q[2], q[3]));
            let b = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi16(w, z));
            // SAFETY: a chunk of codes holds 32 bytes.
            unsafe { _mm256_storeu_si256(cs.as_mut_ptr().cast(), b) };
            *scale = d;
            *total = _mm_cvtsi128_si32(sum);
        }
        _mm256_movemask_ps(finite) == 0xFF
    }

    /// f16 bits to f32 with F16C.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn half(lo: u8, hi: u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes([lo, hi])))))
    }

    /// One weight block widened to a code per byte: the codes as `vpmaddubsw`/`vpdpbusd` take
    /// them (unsigned: Q4's 0..16, or |q| for Q8_0), the signs to give the activations (Q8_0),
    /// the scale, and the factor of the activation block's scaled sum (Q4_0's `-8 d`, Q4_1's
    /// minimum, 0 for Q8_0).
    ///
    /// # Safety
    /// `block` is one whole block of `ty`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(ty: GgmlType, block: &[u8]) -> (__m256i, __m256i, f32, f32) {
        let dw = half(block[0], block[1]);
        match ty {
            GgmlType::Q8_0 => {
                // SAFETY: a Q8_0 block is 34 bytes: 32 codes after the scale.
                let w = unsafe { _mm256_loadu_si256(block.as_ptr().add(2).cast()) };
                (_mm256_sign_epi8(w, w), w, dw, 0.0)
            }
            // The other types never come here (`matmul_t` refuses them); their blocks are at
            // least the 20 bytes this arm reads.
            _ => {
                let at = if ty == GgmlType::Q4_1 { 4 } else { 2 };
                // SAFETY: a Q4 block is 16 code bytes after 2 (Q4_0) or 4 (Q4_1) bytes.
                let bytes = unsafe { _mm_loadu_si128(block.as_ptr().add(at).cast()) };
                let low = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(bytes, low);
                let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
                let c = if ty == GgmlType::Q4_1 { half(block[2], block[3]) } else { -8.0 * dw };
                (_mm256_set_m128i(hi, lo), _mm256_setzero_si256(), dw, c)
            }
        }
    }

    /// The four rows' 8-lane dot products summed across lanes: `[Σd0, Σd1, Σd2, Σd3]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn sum4(d: &[__m256i; 4]) -> __m128 {
        let y = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
        _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1)))
    }

    /// The integer dot of a block's codes with activation codes `a`, eight lanes of partial
    /// sums: `vpmaddubsw` + `vpmaddwd` (|w| <= 128 and |a| <= 127 cannot saturate the pair
    /// sums).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_avx2(wu: __m256i, a: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(wu, a), _mm256_set1_epi16(1))
    }

    /// [`dot_avx2`] in one `vpdpbusd`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni,avx512vl,avx2")]
    fn dot_vnni(wu: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, a)
    }

    /// The kernel for one instruction set: tiles of two weight rows by four activation rows.
    /// Per block, each pair's dot is summed across lanes with its row's three others
    /// (`vphaddd`), and the four sums are scaled and accumulated together, the activation
    /// scales read four rows at a time from [`Activations`]' block-major copies.
    macro_rules! kernel {
        ($matmul:ident, $tile:ident, $features:literal, $dot:ident) => {
            /// [`super::scalar_matmul_t`] with this module's tiles.
            ///
            /// # Safety
            /// The CPU must have the function's target features; the slices must have the
            /// lengths [`super::matmul_t`] checks.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $matmul(ty: GgmlType, weights: &[u8], act: &Activations, out: &mut [f32]) {
                let (n, rb) = (act.rows, ty.row_bytes(act.k));
                let rows = weights.len() / rb;
                // Four activation rows (a few KiB, in L1) against every weight row of the
                // call, two at a time.
                let mut t = 0;
                while t < n {
                    let tn = (n - t).min(4);
                    let mut r = 0;
                    while r < rows {
                        let two = r + 1 < rows;
                        let row0 = &weights[r * rb..(r + 1) * rb];
                        let row1 = if two { &weights[(r + 1) * rb..(r + 2) * rb] } else { row0 };
                        // SAFETY: the same contract, passed on; `t + tn <= n`.
                        let [s0, s1] = unsafe {
                            match tn {
                                1 => $tile::<1>(ty, row0, row1, act, t),
                                2 => $tile::<2>(ty, row0, row1, act, t),
                                3 => $tile::<3>(ty, row0, row1, act, t),
                                _ => $tile::<4>(ty, row0, row1, act, t),
                            }
                        };
                        out[r * n + t..r * n + t + tn].copy_from_slice(&s0[..tn]);
                        if two {
                            out[(r + 1) * n + t..(r + 1) * n + t + tn].copy_from_slice(&s1[..tn]);
                        }
                        r += 2;
                    }
                    t += 4;
                }
            }

            /// Weight rows `row0` and `row1` against activation rows `t0..t0 + TN`.
            ///
            /// # Safety
            /// As the kernel, `t0` a multiple of 4, `t0 + TN <= act.rows`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $tile<const TN: usize>(
                ty: GgmlType,
                row0: &[u8],
                row1: &[u8],
                act: &Activations,
                t0: usize,
            ) -> [[f32; 4]; 2] {
                let blocks = act.k / QK;
                let padded = act.rows.next_multiple_of(4);
                let bb = ty.block_bytes();
                let mut acc = [_mm_setzero_ps(); 2];
                for b in 0..blocks {
                    // SAFETY: block `b` of each row lies inside it.
                    let (w0, s0, dw0, c0) = unsafe { unpack(ty, &row0[b * bb..(b + 1) * bb]) };
                    // SAFETY: as above.
                    let (w1, s1, dw1, c1) = unsafe { unpack(ty, &row1[b * bb..(b + 1) * bb]) };
                    let (mut d0, mut d1) = ([_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]);
                    for j in 0..TN {
                        let ab = (t0 + j) * blocks + b;
                        // SAFETY: activation block `ab` lies inside `act.codes` (`t0 + j < rows`).
                        let a = unsafe { _mm256_loadu_si256(act.codes.as_ptr().add(ab * QK).cast()) };
                        if ty == GgmlType::Q8_0 {
                            d0[j] = $dot(w0, _mm256_sign_epi8(a, s0));
                            d1[j] = $dot(w1, _mm256_sign_epi8(a, s1));
                        } else {
                            d0[j] = $dot(w0, a);
                            d1[j] = $dot(w1, a);
                        }
                    }
                    let at = b * padded + t0;
                    // SAFETY: the block-major copies hold `padded` rows per block, and
                    // `t0 + 4 <= padded`.
                    let (da, sa) = unsafe {
                        (
                            _mm_loadu_ps(act.bm_scales.as_ptr().add(at)),
                            _mm_loadu_ps(act.bm_scaled_sums.as_ptr().add(at)),
                        )
                    };
                    acc[0] = _mm_fmadd_ps(sum4(&d0), _mm_mul_ps(_mm_set1_ps(dw0), da), acc[0]);
                    acc[1] = _mm_fmadd_ps(sum4(&d1), _mm_mul_ps(_mm_set1_ps(dw1), da), acc[1]);
                    if ty != GgmlType::Q8_0 {
                        acc[0] = _mm_fmadd_ps(_mm_set1_ps(c0), sa, acc[0]);
                        acc[1] = _mm_fmadd_ps(_mm_set1_ps(c1), sa, acc[1]);
                    }
                }
                let mut out = [[0f32; 4]; 2];
                // SAFETY: each array holds four f32.
                unsafe {
                    _mm_storeu_ps(out[0].as_mut_ptr(), acc[0]);
                    _mm_storeu_ps(out[1].as_mut_ptr(), acc[1]);
                }
                out
            }
        };
    }

    kernel!(matmul_t_avx2, tile_avx2, "avx2,fma,f16c", dot_avx2);
    kernel!(matmul_t_vnni, tile_vnni, "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma,f16c", dot_vnni);
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::QK;

    /// [`super::scalar_quantize_blocks`] with NEON, to the bit: the same f32 scale and
    /// reciprocal, the same products, and `fcvtas`, which rounds halves away from zero as
    /// `roundf` does (out-of-range values saturate, then the clamp to ±127 agrees).
    pub(super) fn quantize_blocks(x: &[f32], codes: &mut [i8], scales: &mut [f32], sums: &mut [i32]) -> bool {
        let mut finite = true;
        for (((xs, cs), scale), total) in
            x.chunks_exact(QK).zip(codes.chunks_exact_mut(QK)).zip(scales.iter_mut()).zip(sums.iter_mut())
        {
            // SAFETY: NEON is part of every aarch64 CPU; `xs` holds 32 f32 and `cs` 32 bytes,
            // read and written four and eight at a time.
            unsafe {
                let v: [float32x4_t; 8] = std::array::from_fn(|i| vld1q_f32(xs.as_ptr().add(4 * i)));
                let inf = vdupq_n_f32(f32::INFINITY);
                let (mut ok, mut amax) = (vdupq_n_u32(u32::MAX), vdupq_n_f32(0.0));
                for &vi in &v {
                    let a = vabsq_f32(vi);
                    // False for NaN and the infinities.
                    ok = vandq_u32(ok, vcltq_f32(a, inf));
                    amax = vmaxq_f32(amax, a);
                }
                finite &= vminvq_u32(ok) != 0;
                let d = vmaxvq_f32(amax) / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                let (lo, hi) = (vdupq_n_s32(-127), vdupq_n_s32(127));
                let mut sum = vdupq_n_s32(0);
                for (pair, out) in v.chunks_exact(2).zip(cs.chunks_exact_mut(8)) {
                    let q0 = vmaxq_s32(vminq_s32(vcvtaq_s32_f32(vmulq_n_f32(pair[0], inv)), hi), lo);
                    let q1 = vmaxq_s32(vminq_s32(vcvtaq_s32_f32(vmulq_n_f32(pair[1], inv)), hi), lo);
                    sum = vaddq_s32(sum, vaddq_s32(q0, q1));
                    let narrow = vmovn_s16(vcombine_s16(vmovn_s32(q0), vmovn_s32(q1)));
                    vst1_s8(out.as_mut_ptr(), narrow);
                }
                *scale = d;
                *total = vaddvq_s32(sum);
            }
        }
        finite
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A fixed xorshift generator, so that the tests' inputs are the same on every machine.
    pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// Random weight rows of `ty` in GGML's layout, from a fixed generator (also the packed
    /// layout's tests' input).
    pub(crate) fn weights(ty: GgmlType, rows: usize, k: usize, seed: u64, extreme: bool) -> Vec<u8> {
        let mut next = xorshift(seed);
        let mut out = Vec::new();
        for _ in 0..rows * k / QK {
            let d = f16::from_f32((next() % 1000) as f32 / 50_000.0 + 1e-4);
            out.extend_from_slice(&d.to_le_bytes());
            let minimum = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
            if minimum {
                out.extend_from_slice(&f16::from_f32(-((next() % 100) as f32) / 1000.0).to_le_bytes());
            }
            // The codes (and the 5-bit types' word of fifth bits).
            let n = ty.block_bytes() - if minimum { 4 } else { 2 };
            for i in 0..n {
                let byte = if extreme {
                    // The codes that could saturate or overflow: -128/127 and 0xFF nibbles.
                    if ty == GgmlType::Q8_0 { [0x80u8, 0x7F][i % 2] } else { 0xFF }
                } else {
                    next() as u8
                };
                out.push(byte);
            }
        }
        out
    }

    /// Random activation rows (also the packed layout's tests' input).
    pub(crate) fn activations(n: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut next = xorshift(seed);
        (0..n * k)
            .map(|i| {
                let v = (next() % 20_001) as f32 / 10_000.0 - 1.0;
                // A few outliers, and all-zero blocks, as real activations have.
                if i % 97 == 0 {
                    v * 40.0
                } else if (i / QK) % 11 == 5 {
                    0.0
                } else {
                    v
                }
            })
            .collect()
    }

    /// A Q5_0 or Q5_1 block dequantized as ggml's `dequantize_row_q5_0`/`_q5_1` do, in f64.
    pub(crate) fn dequantize_q5(ty: GgmlType, block: &[u8]) -> Vec<f64> {
        let h = |at: usize| f64::from(f16::from_le_bytes([block[at], block[at + 1]]).to_f32());
        let (d, m, at) = if ty == GgmlType::Q5_1 { (h(0), h(2), 4) } else { (h(0), 0.0, 2) };
        let qh = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
        let qs = &block[at + 4..];
        let mut y = vec![0f64; QK];
        for j in 0..QK / 2 {
            let xh0 = (((qh >> j) << 4) & 0x10) as u8;
            let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
            let (x0, x1) = (f64::from((qs[j] & 0x0F) | xh0), f64::from((qs[j] >> 4) | xh1));
            (y[j], y[j + QK / 2]) = if ty == GgmlType::Q5_1 {
                (x0 * d + m, x1 * d + m)
            } else {
                ((x0 - 16.0) * d, (x1 - 16.0) * d)
            };
        }
        y
    }

    /// The dequantize-then-multiply product in f64: what the integer path approximates.
    fn dequantized(ty: GgmlType, w: &[u8], k: usize, x: &[f32]) -> Vec<f64> {
        let rows = w.len() / ty.row_bytes(k);
        let n = x.len() / k;
        let blocks = k / QK;
        let mut codes = vec![0u8; k];
        let (mut d, mut m) = (vec![0f32; blocks], vec![0f32; blocks]);
        let mut out = vec![0f64; rows * n];
        for r in 0..rows {
            unpack_row(ty, &w[r * ty.row_bytes(k)..(r + 1) * ty.row_bytes(k)], &mut codes, &mut d, &mut m);
            let row: Vec<f64> = (0..k)
                .map(|i| {
                    let (b, c) = (i / QK, codes[i]);
                    let (d, m) = (f64::from(d[b]), f64::from(m[b]));
                    match ty {
                        GgmlType::Q4_0 => d * (f64::from(c) - 8.0),
                        GgmlType::Q4_1 => d * f64::from(c) + m,
                        GgmlType::Q8_0 => d * f64::from(c as i8),
                        _ => unreachable!("blocks of 32 only"),
                    }
                })
                .collect();
            for t in 0..n {
                out[r * n + t] = row.iter().zip(&x[t * k..(t + 1) * k]).map(|(a, &b)| a * f64::from(b)).sum();
            }
        }
        out
    }

    #[test]
    fn every_backend_matches_the_reference_and_the_reference_the_dequantized_product() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let shapes = [
                (1, 32, 1),
                (3, 64, 2),
                (4, 64, 4),
                (5, 576, 7),
                (6, 128, 8),
                (7, 96, 5),
                (17, 1536, 3),
                (2, 4096, 1),
            ];
            for (rows, k, n) in shapes {
                for extreme in [false, true] {
                    let w = weights(ty, rows, k, (rows * k + n) as u64, extreme);
                    let x = activations(n, k, k as u64 + 3);
                    let mut act = Activations::new();
                    act.quantize(&x, k).unwrap();
                    let mut want = vec![0f32; rows * n];
                    scalar_matmul_t(ty, &w, &act, &mut want);
                    // The reference is the exact product of the weights and the rounded
                    // activations, to f32's rounding.
                    let rounded: Vec<f32> =
                        (0..n * k).map(|i| f32::from(act.codes[i]) * act.scales[i / QK]).collect();
                    let exact = dequantized(ty, &w, k, &rounded);
                    let norm = exact.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-12);
                    let err =
                        want.iter().zip(&exact).map(|(&a, b)| (f64::from(a) - b).powi(2)).sum::<f64>().sqrt();
                    assert!(err / norm < 1e-5, "{ty:?} {rows}x{k} n {n}: {}", err / norm);
                    // And rounding the activations to 8 bits costs a few percent at most, even
                    // with outliers of 40x in some blocks.
                    let exact = dequantized(ty, &w, k, &x);
                    let norm = exact.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-12);
                    let err =
                        want.iter().zip(&exact).map(|(&a, b)| (f64::from(a) - b).powi(2)).sum::<f64>().sqrt();
                    assert!(err / norm < 5e-2, "{ty:?} {rows}x{k} n {n}: {}", err / norm);
                    for backend in crate::dispatch::available() {
                        let mut got = vec![f32::NAN; rows * n];
                        matmul_t(backend, ty, &w, &act, &mut got).unwrap();
                        // Float sums in another order: within 1e-5 of the outputs' scale
                        // (single outputs can cancel down to far less than their terms).
                        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
                        for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
                            let tol = 1e-5 * scale;
                            assert!(
                                (g - e).abs() <= tol,
                                "{ty:?} {backend} {rows}x{k} n {n} [{i}]: {g} vs {e}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_quantizer_matches_the_reference_to_the_bit() {
        // Blocks whose maximum is 127 have a scale of exactly 1: their halves are real ties.
        let mut special = vec![127.0f32, -127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 0.0, -0.0];
        special.extend([0.49999997, -0.49999997, 63.5, -63.5]);
        special.resize(32, 7.25);
        special.extend([3.4e38, -1e-30, 1e-30, f32::MIN_POSITIVE, -3.4e38, 1.0]);
        special.resize(64, -2.0e37);
        let mut inputs = vec![special, vec![0.0; 32], vec![-0.0; 64], vec![3.4e38; 32], vec![-1e-38; 32]];
        for blocks in [1, 2, 3, 7, 18, 48] {
            inputs.push(activations(1, blocks * QK, blocks as u64 * 11));
        }
        for x in &inputs {
            let n = x.len() / QK;
            let mut want = (vec![0i8; x.len()], vec![0f32; n], vec![0i32; n]);
            assert!(scalar_quantize_blocks(x, &mut want.0, &mut want.1, &mut want.2));
            for backend in crate::dispatch::available() {
                let mut act = Activations::new();
                act.quantize_with(backend, x, QK).unwrap();
                let name = quantize_implementation(backend);
                assert_eq!(act.codes[..x.len()], want.0[..], "{name} {x:?}");
                assert_eq!(
                    act.scales.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.1.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                assert_eq!(act.sums, want.2, "{name}");
            }
        }
        // The ties round away from zero.
        let mut act = Activations::new();
        act.quantize_with(Kernels::SCALAR, &inputs[0], QK).unwrap();
        assert_eq!(act.codes[2..10], [1, -1, 2, -2, 3, -3, 127, -127]);
        // Every non-finite value, anywhere in a block, is refused by every backend.
        for backend in crate::dispatch::available() {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in [0, 5, 31, 32, 63, 95] {
                    let mut x = activations(1, 96, at as u64);
                    x[at] = bad;
                    let mut act = Activations::new();
                    assert!(act.quantize_with(backend, &x, 96).is_err(), "{backend} {bad} at {at}");
                    assert_eq!(act.rows(), 0);
                }
            }
        }
    }

    #[test]
    fn bad_shapes_and_values_are_errors() {
        let mut act = Activations::new();
        assert!(act.quantize(&[0.0; 40], 40).is_err());
        assert!(act.quantize(&[0.0; 48], 32).is_err());
        assert!(act.quantize(&[f32::NAN; 32], 32).is_err());
        act.quantize(&[1.0; 64], 32).unwrap();
        assert_eq!((act.rows(), act.k()), (2, 32));
        let mut out = vec![0f32; 2];
        assert!(matmul_t(Kernels::SCALAR, GgmlType::Q4_1, &[0; 19], &act, &mut out).is_err());
        assert!(matmul_t(Kernels::SCALAR, GgmlType::Q4_1, &[0; 20], &act, &mut [0f32; 3]).is_err());
        matmul_t(Kernels::SCALAR, GgmlType::Q4_1, &[0; 20], &act, &mut out).unwrap();
        assert_eq!(out, [0.0, 0.0]);
    }
}
