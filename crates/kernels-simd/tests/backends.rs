//! Every backend this machine has, against the scalar reference, on random blocks of many
//! shapes (row lengths around every vector width, ragged tails), every bit width, every level
//! kind and parameter placement, and special values: zero scales, extreme codes, huge and
//! tiny scales.
//!
//! Tolerance: float results agree with the f64-accumulated reference within
//! `1e-5 · Σ|terms| + 1e-30` (sums are reordered into lanes; FMA may fuse).

use kvq_kernels_simd::Kernels;
use kvq_kernels_simd::dispatch::available;
use kvq_kernels_simd::{
    Backend, Levels, Params, QuantBlock, axpy_with, dequantize_with, int8_implementation, scalar, scores_with,
};
use kvq_quant_core::Fp8Format;
use kvq_quant_core::pack::{pack, packed_len};
use kvq_quant_core::synth::Rng;

#[cfg(not(miri))]
const DIMS: &[usize] = &[1, 7, 8, 16, 24, 31, 32, 48, 64, 72, 128, 136, 192];
#[cfg(not(miri))]
const ROWS: &[usize] = &[1, 3, 16, 33, 130];
// An interpreter runs these a thousand times slower: a tail, a full vector and one past it.
#[cfg(miri)]
const DIMS: &[usize] = &[1, 8, 33];
#[cfg(miri)]
const ROWS: &[usize] = &[1, 5];

#[derive(Clone)]
struct Case {
    /// One code per value, before packing: what the naive oracle decodes.
    raw: Vec<u8>,
    codes: Vec<u8>,
    rows: usize,
    dim: usize,
    bits: u8,
    table: Vec<f32>,
    scale: Vec<f32>,
    offset: Vec<f32>,
    /// 0 affine, 1 symmetric, 2 table, 3 FP8 for 8-bit codes (`fp8`), a table otherwise.
    levels_kind: u8,
    fp8: Option<Fp8Format>,
    per_channel: bool,
    /// Per-group parameters (`gN`), groups of this many values of a row; `per_channel` is
    /// then false.
    group: Option<usize>,
    with_offset: bool,
}

impl Case {
    /// A case with per-row or per-channel parameters (what the integer paths take).
    fn random(rng: &mut Rng, rows: usize, dim: usize, bits: u8, special: u8) -> Self {
        Self::random_with(rng, rows, dim, bits, special, false)
    }

    /// A case whose parameters may also be per group (`with_groups`), in groups of any of 1,
    /// 2, 8, 16, 32 and 64 values that divides the row.
    fn random_with(rng: &mut Rng, rows: usize, dim: usize, bits: u8, special: u8, with_groups: bool) -> Self {
        let max = (1u16 << bits) - 1;
        let mut raw: Vec<u8> = (0..rows * dim).map(|_| rng.below(u64::from(max) + 1) as u8).collect();
        match special {
            1 => raw.iter_mut().for_each(|c| *c = 0),
            2 => raw.iter_mut().for_each(|c| *c = max as u8),
            _ => {}
        }
        let mut codes = Vec::with_capacity(rows * packed_len(dim, bits).unwrap());
        for r in raw.chunks(dim) {
            codes.extend(pack(r, bits).unwrap());
        }
        let sizes: Vec<usize> =
            [1, 2, 8, 16, 32, 64].into_iter().filter(|g| dim.is_multiple_of(*g)).collect();
        let group = (with_groups && rng.below(3) == 0).then(|| sizes[rng.below(sizes.len() as u64) as usize]);
        let per_channel = group.is_none() && rng.below(2) == 0;
        let groups = match group {
            Some(g) => rows * (dim / g),
            None if per_channel => dim,
            None => rows,
        };
        let magnitude = match special {
            3 => 1e-30,
            4 => 1e20,
            _ => 1.0,
        };
        let scale: Vec<f32> = (0..groups)
            .map(|g| if special == 5 && g % 2 == 0 { 0.0 } else { (rng.uniform() as f32 + 0.01) * magnitude })
            .collect();
        let offset: Vec<f32> = (0..groups).map(|_| (rng.normal() as f32) * magnitude).collect();
        let table: Vec<f32> = (0..1usize << bits).map(|_| rng.normal() as f32).collect();
        let (levels_kind, with_offset) = (rng.below(4) as u8, rng.below(4) != 0);
        let fp8 = (levels_kind == 3 && bits == 8)
            .then(|| if rng.below(2) == 0 { Fp8Format::E4M3 } else { Fp8Format::E5M2 });
        if let Some(f) = fp8 {
            // Quantizers write finite codes only (special codes have a test of their own).
            for c in &mut raw {
                if !f.decode(*c).is_finite() {
                    *c &= 0xf0;
                }
            }
            codes = raw.clone();
        }
        Case {
            raw,
            codes,
            rows,
            dim,
            bits,
            table,
            scale,
            offset,
            levels_kind,
            fp8,
            per_channel,
            group,
            with_offset,
        }
    }

    fn block(&self) -> QuantBlock<'_> {
        let levels = match (self.levels_kind, self.fp8) {
            (0, _) => Levels::Affine,
            (1, _) => Levels::Symmetric { zero: (1u32 << (self.bits - 1)) as f32 },
            (_, Some(f)) => Levels::Fp8(f),
            _ => Levels::Table(&self.table),
        };
        let offset = self.with_offset.then_some(self.offset.as_slice());
        let params = match self.group {
            Some(group) => Params::PerGroup { group, scale: &self.scale, offset },
            None if self.per_channel => Params::PerChannel { scale: &self.scale, offset },
            None => Params::PerRow { scale: &self.scale, offset },
        };
        QuantBlock::new(&self.codes, self.rows, self.dim, self.bits, levels, params).unwrap()
    }
}

impl Case {
    /// The case with parameters per group of `group` values (which divides the row): its
    /// scales and offsets repeated to the new count, so that special cases keep their kind.
    fn grouped(mut self, group: usize) -> Self {
        let n = self.rows * (self.dim / group);
        self.scale = self.scale.iter().copied().cycle().take(n).collect();
        self.offset = self.offset.iter().copied().cycle().take(n).collect();
        (self.group, self.per_channel) = (Some(group), false);
        self
    }

    /// The index of the scale and offset of value `k` of row `r`.
    fn param(&self, r: usize, k: usize) -> usize {
        match self.group {
            Some(g) => r * (self.dim / g) + k / g,
            None if self.per_channel => k,
            None => r,
        }
    }

    /// The value at `(r, k)` decoded the obvious way, in f64: level of the code times the
    /// group's scale, plus its offset; and the magnitude of those two terms.
    fn naive(&self, r: usize, k: usize) -> (f64, f64) {
        let code = self.raw[r * self.dim + k];
        let level = match self.levels_kind {
            0 => f64::from(code),
            1 => f64::from(code) - f64::from(1u32 << (self.bits - 1)),
            _ => match self.fp8 {
                Some(f) => f64::from(f.decode(code)),
                None => f64::from(self.table[usize::from(code)]),
            },
        };
        let g = self.param(r, k);
        let offset = if self.with_offset { f64::from(self.offset[g]) } else { 0.0 };
        let term = level * f64::from(self.scale[g]);
        (term + offset, term.abs() + offset.abs())
    }
}

/// Magnitude of the terms of each output, for the tolerance: the kernels factor
/// `Σ q (L·s + o)` into `s · Σ q L + o · Σ q`, so both parts count, `Σ |q| (|x̂ − o| + |o|)`.
fn magnitudes_scores(case: &Case, b: &QuantBlock<'_>, q: &[f32], n_q: usize) -> Vec<f64> {
    let mut x = vec![0f32; b.rows() * b.dim()];
    scalar::dequantize(b, &mut x);
    let d = b.dim();
    let offset =
        |r: usize, k: usize| -> f32 { if case.with_offset { case.offset[case.param(r, k)] } else { 0.0 } };
    let mut out = Vec::new();
    for i in 0..n_q {
        for r in 0..b.rows() {
            out.push(
                (0..d)
                    .map(|k| {
                        let (qv, xv, o) = (q[i * d + k], x[r * d + k], offset(r, k));
                        f64::from(qv.abs()) * (f64::from((xv - o).abs()) + f64::from(o.abs()))
                    })
                    .sum(),
            );
        }
    }
    out
}

#[track_caller]
fn close(what: &str, got: &[f32], want: &[f32], mags: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mags).enumerate() {
        let tol = 1e-5 * m + 1e-30 + 1e-6 * f64::from(w.abs());
        assert!((f64::from(g) - f64::from(w)).abs() <= tol, "{what}[{i}]: {g} vs {w} (tolerance {tol})");
    }
}

/// One random case (special values drawn too) for every bit width, row length and row count,
/// handed to `f` with the generator and a description.
fn for_each_case(seed: u64, mut f: impl FnMut(&mut Rng, &Case, &str)) {
    let mut rng = Rng::new(seed);
    for bits in 1..=8u8 {
        for &dim in DIMS {
            for &rows in ROWS {
                let special = rng.below(8) as u8;
                let case = Case::random_with(&mut rng, rows, dim, bits, special, true);
                let what = format!(
                    "bits {bits} dim {dim} rows {rows} special {special} kind {} per-channel {} group {:?}",
                    case.levels_kind, case.per_channel, case.group
                );
                f(&mut rng, &case, &what);
            }
        }
    }
}

fn check_backend(backend: Kernels) {
    for_each_case(0x6b7671 + backend.backend() as u64, |rng, case, what| {
        let (rows, dim) = (case.rows, case.dim);
        let b = case.block();
        let what = format!("{backend} {what}");

        // Dequantize: the same arithmetic per element, so bit-exact.
        let (mut got, mut want) = (vec![0f32; rows * dim], vec![0f32; rows * dim]);
        dequantize_with(backend, &b, &mut got).unwrap();
        scalar::dequantize(&b, &mut want);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: dequantize");

        for n_q in [1usize, 2, 3, 4, 5, 8] {
            let q: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
            let (mut got, mut want) = (vec![0f32; n_q * rows], vec![0f32; n_q * rows]);
            scores_with(backend, &b, &q, n_q, &mut got).unwrap();
            scalar::scores(&b, &q, n_q, &mut want);
            close(&format!("{what}: scores"), &got, &want, &magnitudes_scores(case, &b, &q, n_q));

            let p: Vec<f32> = (0..n_q * rows).map(|_| rng.uniform() as f32).collect();
            let start: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
            let (mut got, mut want) = (start.clone(), start.clone());
            axpy_with(backend, &b, &p, n_q, &mut got).unwrap();
            scalar::axpy(&b, &p, n_q, &mut want);
            let mut x = vec![0f32; rows * dim];
            scalar::dequantize(&b, &mut x);
            let mags: Vec<f64> = (0..n_q * dim)
                .map(|k| {
                    let (i, d) = (k / dim, k % dim);
                    f64::from(start[k].abs())
                        + (0..rows)
                            .map(|r| {
                                // Kernels factor x = L·s + o into its two terms, so the
                                // magnitude is that of both, not of their sum.
                                let off = if case.with_offset { case.offset[case.param(r, d)] } else { 0.0 };
                                let pr = f64::from(p[i * rows + r].abs());
                                pr * (f64::from((x[r * dim + d] - off).abs()) + f64::from(off.abs()))
                            })
                            .sum::<f64>()
                })
                .collect();
            close(&format!("{what}: axpy"), &got, &want, &mags);
        }
    });
}

macro_rules! backend_tests {
    ($($name:ident => $backend:expr),* $(,)?) => {$(
        #[test]
        fn $name() {
            match Kernels::new($backend) {
                Ok(kernels) => check_backend(kernels),
                Err(e) => eprintln!("{e}"),
            }
        }
    )*};
}

/// The reference itself against the naive decoding of the unpacked codes, so that a bug
/// shared by the reference and a kernel cannot hide.
#[test]
fn scalar_matches_the_naive_decoding() {
    for_each_case(0x6e61, |rng, case, what| {
        let (rows, dim) = (case.rows, case.dim);
        let b = case.block();
        let mut x = vec![0f32; rows * dim];
        scalar::dequantize(&b, &mut x);
        for r in 0..rows {
            for k in 0..dim {
                let (got, (want, mag)) = (f64::from(x[r * dim + k]), case.naive(r, k));
                // f32 arithmetic (with FMA or not) on terms of magnitude `mag`.
                let tol = 2.0 * f64::from(f32::EPSILON) * mag + 1e-37;
                assert!((got - want).abs() <= tol, "{what}: ({r}, {k}) {got} vs {want}");
            }
        }
        let q: Vec<f32> = (0..dim).map(|_| rng.normal() as f32).collect();
        let mut s = vec![0f32; rows];
        scalar::scores(&b, &q, 1, &mut s);
        for (r, &got) in s.iter().enumerate() {
            let want: f64 = (0..dim).map(|k| f64::from(q[k]) * case.naive(r, k).0).sum();
            let mag: f64 = (0..dim).map(|k| f64::from(q[k].abs()) * case.naive(r, k).1).sum();
            assert!((f64::from(got) - want).abs() <= 1e-5 * mag + 1e-30, "{what}: score {r} {got} vs {want}");
        }
    });
}

backend_tests! {
    wide_matches_scalar => Backend::Wide,
    avx2_matches_scalar => Backend::Avx2,
    avx512_matches_scalar => Backend::Avx512,
    dotprod_matches_scalar => Backend::Dotprod,
}

/// FP8's special codes (e4m3's NaN, e5m2's infinities and NaNs), which no quantizer writes but
/// a crafted block may hold, decode as the format says on every backend, not as a number.
#[test]
fn fp8_special_codes_decode_as_the_format_says() {
    for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
        // Every code, 16 rows of 16: a row of each high nibble.
        let codes: Vec<u8> = (0..=255u8).collect();
        let scale = [0.5f32; 16];
        let b = QuantBlock::new(
            &codes,
            16,
            16,
            8,
            Levels::Fp8(f),
            Params::PerRow { scale: &scale, offset: None },
        )
        .unwrap();
        for backend in available() {
            let mut x = vec![0f32; 256];
            dequantize_with(backend, &b, &mut x).unwrap();
            for (c, &v) in x.iter().enumerate() {
                let want = 0.5 * f.decode(c as u8);
                assert!(
                    v == want || (v.is_nan() && want.is_nan()),
                    "{backend} {f:?} code {c:#x}: {v} vs {want}"
                );
            }
            let q = vec![1.0f32; 16];
            let mut s = vec![0f32; 16];
            scores_with(backend, &b, &q, 1, &mut s).unwrap();
            assert!(s[7].is_nan(), "{backend} {f:?}: a row with a NaN code scores NaN");
            assert!(s[3].is_finite(), "{backend} {f:?}");
        }
    }
}

/// One e4m3 NaN code anywhere in a block (in a 32-byte stretch of its codes or in the bytes
/// after the last one), per row, per channel and per group, makes its row's scores and its
/// channel's values NaN on every backend, and nothing else. (The AVX2 kernels look for the
/// NaN code once per block and skip the check per code where there is none.)
#[test]
fn an_e4m3_nan_code_anywhere_reaches_the_results() {
    for (rows, dim) in [(3usize, 16usize), (5, 48), (2, 64)] {
        let finite: Vec<u8> =
            (0..rows * dim).map(|i| ((i * 37) % 0x7e) as u8 | ((i % 3 == 0) as u8) << 7).collect();
        let (row_scale, channel_scale, group_scale) =
            (vec![0.5f32; rows], vec![0.25f32; dim], vec![2.0f32; rows * dim / 16]);
        let (row_offset, group_offset) = (vec![0.125f32; rows], vec![-1.0f32; rows * dim / 16]);
        let params = [
            Params::PerRow { scale: &row_scale, offset: Some(&row_offset) },
            Params::PerChannel { scale: &channel_scale, offset: None },
            Params::PerGroup { group: 16, scale: &group_scale, offset: Some(&group_offset) },
        ];
        for (at, nan) in (0..rows * dim).flat_map(|at| [(at, 0x7fu8), (at, 0xff)]) {
            let mut codes = finite.clone();
            codes[at] = nan;
            let (row, channel) = (at / dim, at % dim);
            for params in params {
                let b = QuantBlock::new(&codes, rows, dim, 8, Levels::Fp8(Fp8Format::E4M3), params).unwrap();
                for backend in available() {
                    let mut s = vec![0f32; rows];
                    scores_with(backend, &b, &vec![1.0f32; dim], 1, &mut s).unwrap();
                    for (r, x) in s.iter().enumerate() {
                        assert_eq!(
                            x.is_nan(),
                            r == row,
                            "{backend} {rows}x{dim} code {at} ({nan:#x}) {params:?}: score {r} = {x}"
                        );
                    }
                    let mut o = vec![0f32; dim];
                    axpy_with(backend, &b, &vec![0.25f32; rows], 1, &mut o).unwrap();
                    for (c, x) in o.iter().enumerate() {
                        assert_eq!(
                            x.is_nan(),
                            c == channel,
                            "{backend} {rows}x{dim} code {at} ({nan:#x}) {params:?}: value {c} = {x}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    let codes = vec![0u8; 64];
    let scale = [1.0f32; 2];
    let params = Params::PerRow { scale: &scale, offset: None };
    assert!(QuantBlock::new(&codes[..10], 2, 32, 4, Levels::Affine, params).is_err());
    assert!(QuantBlock::new(&codes, 2, 32, 9, Levels::Affine, params).is_err());
    assert!(QuantBlock::new(&codes, 2, 32, 4, Levels::Table(&[0.0; 15]), params).is_err());
    assert!(QuantBlock::new(&codes, 3, 8, 4, Levels::Affine, params).is_err());
    let b = QuantBlock::new(&codes, 2, 32, 4, Levels::Affine, params).unwrap();
    let mut out = [0f32; 2];
    assert!(scores_with(Kernels::WIDE, &b, &[0.0; 31], 1, &mut out).is_err());
    assert!(axpy_with(Kernels::WIDE, &b, &[0.0; 3], 1, &mut [0.0; 32]).is_err());
    assert!(dequantize_with(Kernels::WIDE, &b, &mut [0.0; 63]).is_err());
}

/// The integer score kernels at the largest sums their lanes can hold: every code at its
/// maximum and every query value at ±127 after rounding, long rows. A kernel that sums more
/// 16-bit products before widening than the bound allows wraps here (random cases rarely
/// line the extremes up).
#[test]
fn integer_scores_hold_extreme_rows_bit_for_bit() {
    use kvq_kernels_simd::scores_int8_with;
    for backend in available() {
        for bits in [4u8, 8] {
            for dim in [64usize, 128, 256, 320, 512, 4096] {
                let rows = 3;
                let row_bytes = packed_len(dim, bits).unwrap();
                let codes = vec![0xffu8; rows * row_bytes];
                let (scale, offset) = (vec![1.0f32; rows], vec![0.0f32; rows]);
                let params = Params::PerRow { scale: &scale, offset: Some(&offset) };
                // 4-bit rows also as a 16-level table whose last level (every code here) is the
                // largest in size: int8 level −127 against a query at ±127.
                let mut table = [0.25f32; 16];
                table[15] = -3.0;
                let levels: &[Levels<'_>] =
                    if bits == 4 { &[Levels::Affine, Levels::Table(&table)] } else { &[Levels::Affine] };
                for (&levels, sign) in levels.iter().flat_map(|l| [(l, 1.0f32), (l, -1.0)]) {
                    let b = QuantBlock::new(&codes, rows, dim, bits, levels, params).unwrap();
                    let q = vec![sign; 2 * dim];
                    let (mut got, mut want) = (vec![0f32; 2 * rows], vec![0f32; 2 * rows]);
                    if !scores_int8_with(backend, &b, &q, 2, &mut got).unwrap() {
                        continue;
                    }
                    assert!(scalar::scores_int8(&b, &q, 2, &mut want));
                    let level =
                        if matches!(levels, Levels::Table(_)) { -3.0 } else { ((1u32 << bits) - 1) as f32 };
                    let exact = sign * level * dim as f32;
                    for (g, w) in got.iter().zip(&want) {
                        assert_eq!(g.to_bits(), w.to_bits(), "{backend} bits {bits} dim {dim} sign {sign}");
                        assert!(
                            (g - exact).abs() <= 1e-5 * exact.abs(),
                            "{backend} {bits} {dim}: {g} vs {exact}"
                        );
                    }
                }
            }
        }
    }
}

/// The integer score path against the f64 reference, within its stated bound: the query's
/// int8 rounding, `max|q| / 254 · Σ_d |level_d| · scale` per score (plus float slack).
#[test]
fn integer_scores_stay_within_the_query_rounding_bound() {
    use kvq_kernels_simd::scores_int8_with;
    let mut rng = Rng::new(77);
    let mut ran = 0;
    for backend in available() {
        for bits in [4u8, 8] {
            for dim in [64usize, 128, 192, 16, 48] {
                for rows in [1usize, 5, 32] {
                    let special = rng.below(6) as u8;
                    let mut case = Case::random_with(&mut rng, rows, dim, bits, special, true);
                    // Affine codes, or (4-bit) a 16-level table, whose levels the integer path
                    // rounds to int8: half a step of `max|T| / 127` more a level.
                    // (Symmetric 4-bit levels are exact in int8.)
                    case.levels_kind = if bits == 4 { rng.below(3) as u8 } else { 0 };
                    let table = case.levels_kind == 2;
                    let step =
                        if table { case.table.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0 } else { 0.0 };
                    let b = case.block();
                    let q: Vec<f32> = (0..2 * dim).map(|_| rng.normal() as f32).collect();
                    let (mut got, mut want) = (vec![0f32; 2 * rows], vec![0f32; 2 * rows]);
                    let integer = scores_int8_with(backend, &b, &q, 2, &mut got).unwrap();
                    ran += usize::from(integer);
                    scalar::scores(&b, &q, 2, &mut want);
                    let mags = magnitudes_scores(&case, &b, &q, 2);
                    let mut x = vec![0f32; rows * dim];
                    scalar::dequantize(&b, &mut x);
                    for i in 0..2 {
                        let qi = &q[i * dim..(i + 1) * dim];
                        for r in 0..rows {
                            let (idx, row) = (i * rows + r, r * dim..(r + 1) * dim);
                            // The rounding acts on q (per row) or on q ∘ scale (per channel);
                            // bound both by the decoded values' size over the offset.
                            let qw: Vec<f32> = match (case.per_channel, integer) {
                                (true, true) => qi.iter().zip(&case.scale).map(|(a, s)| a * s).collect(),
                                _ => qi.to_vec(),
                            };
                            let qmax = qw.iter().fold(0f32, |m, v| m.max(v.abs()));
                            let codes_mag: f64 = x[row.clone()]
                                .iter()
                                .enumerate()
                                .map(|(d, &v)| {
                                    let k = case.param(r, d);
                                    let (s, o) =
                                        (case.scale[k], if case.with_offset { case.offset[k] } else { 0.0 });
                                    let level = if s > 0.0 { ((v - o) / s).abs() } else { 0.0 };
                                    f64::from(level + step / 2.0)
                                        * if case.per_channel && integer { 1.0 } else { f64::from(s) }
                                })
                                .sum();
                            // The table's own rounding: half a step a level, times |q · scale|.
                            let table_err: f64 = (0..dim)
                                .map(|d| f64::from((qi[d] * case.scale[case.param(r, d)]).abs() * step / 2.0))
                                .sum();
                            let bound = if integer {
                                (f64::from(qmax) / 254.0 * codes_mag + table_err) * 1.001
                            } else {
                                0.0
                            };
                            let tol = bound + 1e-5 * mags[idx] + 1e-30 + 1e-6 * f64::from(want[idx].abs());
                            assert!(
                                (f64::from(got[idx]) - f64::from(want[idx])).abs() <= tol,
                                "{backend} bits {bits} dim {dim} rows {rows}: {} vs {} (bound {tol})",
                                got[idx],
                                want[idx]
                            );
                        }
                    }
                }
            }
        }
    }
    if available().iter().any(|b| matches!(b.backend(), Backend::Avx2 | Backend::Dotprod)) {
        assert!(ran > 0, "the integer path never ran on a machine that has one");
    }
}

/// Every integer kernel against the integer reference, bit for bit: the query rounding and the
/// float epilogue are shared code and the integer dots are exact, so nothing may differ. Rows
/// past one kernel call (256), group remainders, extreme codes and queries, and rows long
/// enough that a 16-bit intermediate would overflow.
#[test]
fn integer_kernels_equal_the_integer_reference_bit_for_bit() {
    use kvq_kernels_simd::scores_int8_with;
    let mut rng = Rng::new(0x1d07);
    let mut ran = std::collections::BTreeMap::new();
    let mut tables = std::collections::BTreeMap::new();
    let mut widths = std::collections::BTreeSet::new();
    for backend in available() {
        for bits in 1..=8u8 {
            for (dim, rows) in [
                (64, 1),
                (128, 33),
                (128, 300),
                (192, 7),
                (256, 5),
                (384, 17),
                (4096, 3),
                (32, 9),
                (48, 5),
                (16, 3),
                (80, 4),
            ] {
                let layouts = [None, Some(32), Some(64), Some(128)]
                    .into_iter()
                    .flat_map(|g| [(g, 0u8), (g, 1), (g, 2)]);
                for (special, (group, levels)) in (0..6u8).flat_map(|s| layouts.clone().map(move |l| (s, l)))
                {
                    // Other widths than 4 and 8: affine codes per row or per channel (the VNNI
                    // kernel takes rows of a multiple of 128 of them).
                    let other = bits != 4 && bits != 8;
                    if (levels > 0 && bits != 4) || (other && (group.is_some() || special > 3)) {
                        continue;
                    }
                    let mut case = Case::random(&mut rng, rows, dim, bits, special);
                    // Affine codes, symmetric ones, or a 16-level table (rounded to int8 by the
                    // integer path).
                    case.levels_kind = levels;
                    if let Some(g) = group.filter(|g| dim.is_multiple_of(*g)) {
                        case = case.grouped(g);
                    } else if group.is_some() {
                        continue;
                    }
                    let b = case.block();
                    for n_q in [1usize, 2, 3, 4, 5, 8] {
                        let mut q: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
                        match special {
                            // Every query value at the int8 extremes: the largest dots there are.
                            2 => q
                                .iter_mut()
                                .enumerate()
                                .for_each(|(k, x)| *x = if k % 3 == 0 { 1.0 } else { -1.0 }),
                            3 => q.iter_mut().for_each(|x| *x *= 1e-30),
                            4 => q[..dim].iter_mut().for_each(|x| *x = 0.0),
                            _ => {}
                        }
                        let (mut got, mut want) = (vec![0f32; n_q * rows], vec![0f32; n_q * rows]);
                        let integer = scores_int8_with(backend, &b, &q, n_q, &mut got).unwrap();
                        if !integer {
                            continue;
                        }
                        *ran.entry((backend.backend(), group.is_some())).or_insert(0) += 1;
                        if other {
                            widths.insert((backend.backend(), bits, case.per_channel));
                        }
                        if levels > 0 {
                            *tables.entry((backend.backend(), levels)).or_insert(0) += 1;
                        }
                        assert!(scalar::scores_int8(&b, &q, n_q, &mut want));
                        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "{backend} bits {bits} dim {dim} rows {rows} n_q {n_q} special {special} [{k}]: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
    for b in available() {
        if matches!(b.backend(), Backend::Avx2 | Backend::Avx512 | Backend::Dotprod) {
            assert!(
                ran.get(&(b.backend(), false)).copied().unwrap_or(0) > 0,
                "{b}: the integer path never ran"
            );
        }
        if matches!(b.backend(), Backend::Avx2 | Backend::Dotprod) {
            // 4-bit per-group blocks (groups of whole 32-code runs) and 16-level tables have an
            // AVX2 and a dotprod integer kernel.
            assert!(
                ran.get(&(b.backend(), true)).copied().unwrap_or(0) > 0,
                "{b}: no per-group block took it"
            );
            for levels in [1, 2] {
                assert!(
                    tables.get(&(b.backend(), levels)).copied().unwrap_or(0) > 0,
                    "{b}: no block of levels {levels}"
                );
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512vnni") && Backend::Avx512.is_available() {
        // The VNNI kernel took every other width, per row and per channel.
        for bits in [1u8, 2, 3, 5, 6, 7] {
            for per_channel in [false, true] {
                assert!(
                    widths.contains(&(Backend::Avx512, bits, per_channel)),
                    "{bits} bits, per channel {per_channel}"
                );
            }
        }
    }
    let _ = &widths;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512vnni") && Backend::Avx512.is_available() {
        // The VNNI kernel itself (not its AVX2 fallback) takes INT4 rows of 128.
        let case = Case::random(&mut rng, 4, 128, 4, 0);
        let mut case = case;
        case.levels_kind = 0;
        let vnni = Kernels::new(Backend::Avx512).unwrap();
        assert_eq!(int8_implementation(vnni, &case.block()), Some(Backend::Avx512));
        // And 16-level tables and symmetric levels of 4 bits, per row or per channel (their
        // results: above, bit for bit).
        for (levels, per_channel) in [(1u8, false), (2, false), (2, true)] {
            let mut case = Case::random(&mut rng, 4, 128, 4, 0);
            (case.levels_kind, case.per_channel) = (levels, per_channel);
            case.scale = (0..if per_channel { 128 } else { 4 }).map(|_| 1.0).collect();
            case.offset = case.scale.clone();
            assert_eq!(int8_implementation(vnni, &case.block()), Some(Backend::Avx512), "levels {levels}");
        }
    }
}

/// One scratch across blocks of different layouts and query rows, as decode uses it: a kernel
/// reuses the query it rounded for the last block only where the rounding serves the next
/// (the same rows, width, length and parameter layout; at most one group of query rows), so
/// every result equals a fresh scratch's, bit for bit.
#[test]
fn integer_scores_reuse_a_rounded_query_only_where_it_fits() {
    use kvq_kernels_simd::{Scratch, scores_int8_in};
    let mut rng = Rng::new(0x5c7a);
    let dim = 128;
    let queries: Vec<Vec<f32>> =
        (0..2).map(|_| (0..8 * dim).map(|_| rng.normal() as f32).collect()).collect();
    let mut cases = Vec::new();
    for bits in [4u8, 8] {
        for (group, offset) in
            [(None, true), (None, false), (Some(32), true), (Some(64), true), (Some(32), false)]
        {
            let mut case = Case::random(&mut rng, 9, dim, bits, 0);
            (case.levels_kind, case.with_offset, case.per_channel) = (0, offset, false);
            case.scale = (0..9).map(|_| rng.uniform() as f32 + 0.1).collect();
            case.offset = (0..9).map(|_| rng.normal() as f32).collect();
            cases.push(group.map_or(case.clone(), |g| case.grouped(g)));
        }
        let mut channel = Case::random(&mut rng, 9, dim, bits, 0);
        (channel.levels_kind, channel.per_channel) = (0, true);
        channel.scale = (0..dim).map(|_| rng.uniform() as f32 + 0.1).collect();
        channel.offset = (0..dim).map(|_| rng.normal() as f32).collect();
        cases.push(channel);
    }
    let calls: Vec<(usize, usize, usize)> =
        (0..cases.len()).flat_map(|c| [(c, 0, 1), (c, 0, 4), (c, 1, 4), (c, 0, 8)]).collect();
    let run = |backend, scratch: &mut Scratch, &(c, q, n_q): &(usize, usize, usize)| {
        let mut out = vec![0f32; n_q * 9];
        scores_int8_in(backend, scratch, &cases[c].block(), &queries[q][..n_q * dim], n_q, &mut out).unwrap();
        out
    };
    for backend in available() {
        // Every ordered pair of calls, the second against a fresh scratch's result.
        for first in &calls {
            for second in &calls {
                let mut scratch = Scratch::default();
                run(backend, &mut scratch, first);
                let got = run(backend, &mut scratch, second);
                let want = run(backend, &mut Scratch::default(), second);
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(g.to_bits(), w.to_bits(), "{backend} {first:?} then {second:?}: {g} vs {w}");
                }
            }
        }
    }
}

/// The integer reference computes what its algebra says: the int8-rounded query (per channel,
/// times the scales) dotted with the codes, scaled back, plus the offsets' exact term.
#[test]
fn the_integer_reference_follows_its_algebra() {
    let mut rng = Rng::new(31);
    // Per row, per channel, per group of 8 values (5 a row) and of 4 (10 a row: more groups
    // than the epilogue's repeated sums hold).
    for (per_channel, group) in [(false, None), (true, None), (false, Some(8)), (false, Some(4))] {
        let mut case = Case::random(&mut rng, 6, 40, 4, 0);
        case.levels_kind = 0;
        case.with_offset = true;
        case.per_channel = per_channel;
        case.group = group;
        let n = match group {
            Some(g) => 6 * 40 / g,
            None if per_channel => 40,
            None => 6,
        };
        case.scale = (0..n).map(|_| rng.uniform() as f32 + 0.1).collect();
        case.offset = (0..n).map(|_| rng.normal() as f32).collect();
        let b = case.block();
        let q: Vec<f32> = (0..40).map(|_| rng.normal() as f32).collect();
        let mut got = vec![0f32; 6];
        assert!(scalar::scores_int8(&b, &q, 1, &mut got));
        let mut x = vec![0f32; 6 * 40];
        scalar::dequantize(&b, &mut x);
        for r in 0..6 {
            let qw: Vec<f64> = (0..40)
                .map(|d| f64::from(q[d]) * if per_channel { f64::from(case.scale[d]) } else { 1.0 })
                .collect();
            let sq = qw.iter().fold(0f64, |m, v| m.max(v.abs())) / 127.0;
            let mut want = 0f64;
            for d in 0..40 {
                let (s, o) = (case.scale[case.param(r, d)], case.offset[case.param(r, d)]);
                let level = ((f64::from(x[r * 40 + d]) - f64::from(o)) / f64::from(s)).round();
                let q8 = (qw[d] / sq).round_ties_even();
                want += q8 * sq * level * if per_channel { 1.0 } else { f64::from(s) }
                    + f64::from(q[d]) * f64::from(o);
            }
            assert!(
                (f64::from(got[r]) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "{r}: {} vs {want}",
                got[r]
            );
        }
    }
    // A 16-level table: its levels rounded to int8 with the scale max|T| / 127 (ties to even)
    // in place of the codes.
    let mut case = Case::random(&mut rng, 6, 64, 4, 0);
    (case.levels_kind, case.with_offset, case.per_channel, case.group) = (2, true, false, None);
    case.scale = (0..6).map(|_| rng.uniform() as f32 + 0.1).collect();
    case.offset = (0..6).map(|_| rng.normal() as f32).collect();
    case.table[3] = 0.0;
    let q: Vec<f32> = (0..64).map(|_| rng.normal() as f32).collect();
    let mut got = vec![0f32; 6];
    assert!(scalar::scores_int8(&case.block(), &q, 1, &mut got));
    let st = case.table.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs())) / 127.0;
    let sq = q.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs())) / 127.0;
    for (r, &got) in got.iter().enumerate() {
        let want: f64 = (0..64)
            .map(|d| {
                let level = (f64::from(case.table[usize::from(case.raw[r * 64 + d])]) / st).round_ties_even();
                let q8 = (f64::from(q[d]) / sq).round_ties_even();
                q8 * sq * level * st * f64::from(case.scale[r]) + f64::from(q[d]) * f64::from(case.offset[r])
            })
            .sum();
        assert!((f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()), "table {r}: {got} vs {want}");
    }
    // Symmetric 4-bit levels are exact int8 levels (`c − 8`); wider symmetric codes and 8-bit
    // tables are not: the reference declines them.
    let mut case = Case::random(&mut rng, 3, 64, 4, 0);
    (case.levels_kind, case.per_channel, case.group, case.with_offset) = (1, false, None, false);
    case.scale = vec![0.5, 1.0, 2.0];
    let q: Vec<f32> = (0..64).map(|_| rng.normal() as f32).collect();
    let mut got = vec![0f32; 3];
    assert!(scalar::scores_int8(&case.block(), &q, 1, &mut got));
    let sq = q.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs())) / 127.0;
    for (r, &got) in got.iter().enumerate() {
        let want: f64 = (0..64)
            .map(|d| {
                let level = f64::from(case.raw[r * 64 + d]) - 8.0;
                (f64::from(q[d]) / sq).round_ties_even() * sq * level * f64::from(case.scale[r])
            })
            .sum();
        assert!((f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()), "symmetric {r}: {got} vs {want}");
    }
    let mut case = Case::random(&mut rng, 2, 16, 8, 0);
    (case.levels_kind, case.fp8) = (1, None);
    assert!(!scalar::scores_int8(&case.block(), &[0.5; 16], 1, &mut [0.0; 2]));
    let mut case = Case::random(&mut rng, 2, 16, 8, 0);
    (case.levels_kind, case.fp8) = (2, None);
    assert!(!scalar::scores_int8(&case.block(), &[0.5; 16], 1, &mut [0.0; 2]));
}

/// The integer value path: every kernel equals the integer reference bit for bit (the weight
/// rounding and the epilogue are shared, the sums exact), and the result stays within the
/// stated bound of the exact accumulation: `sw / 2 · Σ_r |level_r[c] − 2^(bits − 1)|` (per channel, times
/// `|scale_c|`), `sw = max_r |w_r| / W_max` (255 for 4-bit codes, 32767 for 8-bit), plus float
/// slack. Blocks past one kernel call (4096 INT4 rows, 257 INT8 rows), row counts that are not
/// a multiple of the kernels' 2 or 4 rows, group remainders, and a negative weight (4-bit
/// blocks then leave the unsigned-byte kernel).
#[test]
fn integer_values_equal_their_reference_and_stay_within_their_bound() {
    use kvq_kernels_simd::axpy_int_with;
    use kvq_quant_core::pack::unpack_row;
    let mut rng = Rng::new(0x7a1);
    let mut ran = 0;
    for backend in available() {
        for (bits, dim, rows) in [
            (4u8, 128, 32),
            (4, 128, 1),
            (4, 128, 33),
            (4, 256, 7),
            (4, 384, 130),
            (4, 128, 5000),
            (4, 64, 3),
            (8, 64, 9),
            (8, 128, 32),
            (8, 192, 300),
        ] {
            for special in 0..6u8 {
                let mut case = Case::random(&mut rng, rows, dim, bits, special);
                case.levels_kind = 0;
                let b = case.block();
                let mut codes = vec![0u8; rows * dim];
                for (r, c) in codes.chunks_exact_mut(dim).enumerate() {
                    let rb = dim * usize::from(bits) / 8;
                    unpack_row(&case.codes[r * rb..(r + 1) * rb], bits, c).unwrap();
                }
                for n_q in [1usize, 2, 3, 4, 5, 8] {
                    let mut p: Vec<f32> = (0..n_q * rows).map(|_| rng.uniform() as f32).collect();
                    if special == 3 {
                        p[..rows].iter_mut().for_each(|x| *x = 0.0);
                    }
                    if special == 5 {
                        p[rows / 2] = -p[rows / 2];
                    }
                    let start: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
                    let mut got = start.clone();
                    if !axpy_int_with(backend, &b, &p, n_q, &mut got).unwrap() {
                        continue;
                    }
                    ran += 1;
                    let mut want = start.clone();
                    assert!(scalar::axpy_int(&b, &p, n_q, &mut want));
                    let what =
                        format!("{backend} bits {bits} dim {dim} rows {rows} special {special} n_q {n_q}");
                    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "{what} [{k}]: {g} vs {w}");
                    }
                    let mut exact = start.clone();
                    scalar::axpy(&b, &p, n_q, &mut exact);
                    let mut x = vec![0f32; rows * dim];
                    scalar::dequantize(&b, &mut x);
                    for i in 0..n_q {
                        let w: Vec<f64> = (0..rows)
                            .map(|r| {
                                let pr = f64::from(p[i * rows + r]);
                                if case.per_channel { pr } else { pr * f64::from(case.scale[r]) }
                            })
                            .collect();
                        // Rows are rounded in calls of at most 4369 rows, each with its own scale;
                        // the largest scale bounds them all.
                        let limit = if bits <= 4 { 255.0 } else { 32767.0 };
                        let sw = w.iter().fold(0f64, |m, v| m.max(v.abs())) / limit;
                        for c in 0..dim {
                            // The kernels sum codes centred on 2^(bits − 1).
                            let z = f64::from(1u32 << (bits - 1));
                            let levels: f64 =
                                (0..rows).map(|r| (f64::from(codes[r * dim + c]) - z).abs()).sum();
                            let s = if case.per_channel { f64::from(case.scale[c]).abs() } else { 1.0 };
                            let mag: f64 = f64::from(start[i * dim + c].abs())
                                + (0..rows)
                                    .map(|r| {
                                        let off = match (case.with_offset, case.per_channel) {
                                            (false, _) => 0.0,
                                            (true, true) => case.offset[c],
                                            (true, false) => case.offset[r],
                                        };
                                        f64::from(p[i * rows + r].abs())
                                            * (f64::from((x[r * dim + c] - off).abs()) + f64::from(off.abs()))
                                    })
                                    .sum::<f64>();
                            let k = i * dim + c;
                            let tol = sw / 2.0 * levels * s * 1.001 + 1e-5 * mag + 1e-30;
                            let err = (f64::from(got[k]) - f64::from(exact[k])).abs();
                            assert!(
                                err <= tol,
                                "{what} [{k}]: {} vs exact {} (bound {tol})",
                                got[k],
                                exact[k]
                            );
                        }
                    }
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if available().iter().any(|k| *k == Backend::Avx512) && std::arch::is_x86_feature_detected!("avx512vnni")
    {
        assert!(ran > 0, "the integer value path never ran on a machine that has it");
    }
    let _ = ran;
}

/// A NaN in a query row or a weight row must not vanish in the int8 / i16 rounding (the
/// maximum that sets the scale ignores NaN): every result of that row is NaN, on every
/// backend and in the references, and the other rows are untouched. Per-row and per-channel
/// parameters, with and without offsets (without them only the rounding's NaN check carries
/// the NaN: the offsets' float sum would otherwise).
#[test]
fn nan_inputs_reach_the_integer_results() {
    use kvq_kernels_simd::{axpy_int_with, scores_int8_with};
    let mut rng = Rng::new(404);
    let layouts = [(false, false), (false, true), (true, false), (true, true)];
    for backend in available() {
        for ((bits, dim), (per_channel, with_offset)) in
            [(4u8, 128usize), (8, 64), (4, 64), (8, 128)].into_iter().flat_map(|c| layouts.map(|l| (c, l)))
        {
            let mut case = loop {
                let case = Case::random(&mut rng, 5, dim, bits, 0);
                if case.per_channel == per_channel {
                    break case;
                }
            };
            case.levels_kind = 0;
            case.with_offset = with_offset;
            let b = case.block();
            let mut q: Vec<f32> = (0..2 * dim).map(|_| rng.normal() as f32).collect();
            q[dim + 7] = f32::NAN;
            let mut s = vec![0f32; 10];
            scores_int8_with(backend, &b, &q, 2, &mut s).unwrap();
            assert!(
                s[..5].iter().all(|x| x.is_finite()) && s[5..].iter().all(|x| x.is_nan()),
                "{backend}: {s:?}"
            );
            let mut p: Vec<f32> = (0..10).map(|_| rng.uniform() as f32).collect();
            p[2] = f32::NAN;
            let mut o = vec![0f32; 2 * dim];
            axpy_int_with(backend, &b, &p, 2, &mut o).unwrap();
            assert!(
                o[..dim].iter().all(|x| x.is_nan()) && o[dim..].iter().all(|x| x.is_finite()),
                "{backend}"
            );
        }
    }
    let mut case = Case::random(&mut rng, 3, 64, 4, 0);
    case.levels_kind = 0;
    let b = case.block();
    let mut s = vec![0f32; 3];
    assert!(scalar::scores_int8(&b, &[f32::NAN; 64], 1, &mut s));
    assert!(s.iter().all(|x| x.is_nan()));
    let mut o = vec![0f32; 64];
    assert!(scalar::axpy_int(&b, &[0.5, f32::NAN, 0.5], 1, &mut o));
    assert!(o.iter().all(|x| x.is_nan()));
}

/// `implementation_for` names the code that runs for a block: the AVX2 kernels for groups of
/// a multiple of 16, symmetric levels and 3-bit codes, the `wide` ones for groups of 8 and
/// 5-bit codes.
#[test]
fn implementation_for_names_the_kernel_of_each_layout() {
    use kvq_kernels_simd::{implementation, implementation_for};
    let codes = vec![0u8; 4 * 32];
    let scale = [1.0f32; 8];
    let block_of = |bits: u8, group: usize, levels| {
        let params = Params::PerGroup { group, scale: &scale[..64 / group], offset: None };
        QuantBlock::new(&codes, 1, 64, bits, levels, params).unwrap()
    };
    let block = |group, levels| block_of(4, group, levels);
    for backend in available() {
        let want_fast = implementation(backend);
        assert_eq!(implementation_for(backend, &block(32, Levels::Affine)), want_fast, "{backend}");
        assert_eq!(implementation_for(backend, &block(16, Levels::Affine)), want_fast, "{backend}");
        let fallback = if want_fast == Backend::Avx2 { Backend::Wide } else { want_fast };
        assert_eq!(implementation_for(backend, &block(8, Levels::Affine)), fallback, "{backend}");
        let sym = Levels::Symmetric { zero: 8.0 };
        assert_eq!(implementation_for(backend, &block(32, sym)), want_fast, "{backend}");
        assert_eq!(implementation_for(backend, &block_of(3, 32, Levels::Affine)), want_fast, "{backend}");
        assert_eq!(implementation_for(backend, &block_of(5, 32, Levels::Affine)), fallback, "{backend}");
        // Affine rows per channel of any width and any multiple of 8 codes (the width regions
        // of `-qa` keys) have AVX2 kernels of their own; a table does not.
        for (bits, dim) in [(5u8, 24usize), (2, 16), (3, 40), (1, 8), (7, 64)] {
            let (codes, scale) = (vec![0u8; packed_len(dim, bits).unwrap()], vec![1.0f32; dim]);
            let params = Params::PerChannel { scale: &scale, offset: None };
            let b = QuantBlock::new(&codes, 1, dim, bits, Levels::Affine, params).unwrap();
            assert_eq!(implementation_for(backend, &b), want_fast, "{backend} {bits} bits × {dim}");
            let table = vec![0.0f32; 1 << bits];
            let t = QuantBlock::new(&codes, 1, dim, bits, Levels::Table(&table), params).unwrap();
            assert_eq!(implementation_for(backend, &t), fallback, "{backend} {bits}-bit table × {dim}");
        }
    }
    // FP8 rows with one scale per row and a multiple of 32 codes: AVX-512 kernels of their
    // own on that backend; other FP8 blocks the AVX2 ones.
    for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for (dim, per_row) in [(64usize, true), (96, true), (48, true), (64, false)] {
            let codes = vec![0u8; 2 * dim];
            let (rs, cs) = ([1.0f32; 2], vec![1.0f32; dim]);
            let params = if per_row {
                Params::PerRow { scale: &rs, offset: None }
            } else {
                Params::PerChannel { scale: &cs, offset: None }
            };
            let b = QuantBlock::new(&codes, 2, dim, 8, Levels::Fp8(f), params).unwrap();
            for backend in available() {
                let want = if backend == Backend::Avx512 && per_row && dim % 32 == 0 {
                    Backend::Avx512
                } else {
                    implementation(backend)
                };
                assert_eq!(
                    implementation_for(backend, &b),
                    want,
                    "{backend} {f:?} × {dim} per row {per_row}"
                );
            }
        }
    }
    let bad = Params::PerGroup { group: 24, scale: &scale[..2], offset: None };
    assert!(QuantBlock::new(&codes, 1, 64, 4, Levels::Affine, bad).is_err());
    let short = Params::PerGroup { group: 16, scale: &scale[..3], offset: None };
    assert!(QuantBlock::new(&codes, 1, 64, 4, Levels::Affine, short).is_err());
}

/// Per score, `Σ_d |q_i[d] · x_r[d]|`: the scale of its rounding error.
fn dense_score_mags(q: &[f32], x: &[f32], rows: usize, dim: usize, n_q: usize) -> Vec<f64> {
    (0..n_q * rows)
        .map(|k| {
            let (i, r) = (k / rows, k % rows);
            (0..dim).map(|d| f64::from((q[i * dim + d] * x[r * dim + d]).abs())).sum()
        })
        .collect()
}

/// Per output, `|start| + Σ_r |p_ir · x_r[d]|`: the scale of its rounding error.
fn dense_axpy_mags(start: &[f32], p: &[f32], x: &[f32], rows: usize, dim: usize, n_q: usize) -> Vec<f64> {
    (0..n_q * dim)
        .map(|k| {
            let (i, d) = (k / dim, k % dim);
            f64::from(start[k].abs())
                + (0..rows).map(|r| f64::from((p[i * rows + r] * x[r * dim + d]).abs())).sum::<f64>()
        })
        .collect()
}

/// The full-precision row kernels (tails and sinks) against the f64 reference on every
/// backend, every row length and count, with special values (zeros, huge and tiny rows).
#[test]
fn dense_kernels_match_the_reference() {
    use kvq_kernels_simd::{dense_axpy_with, dense_implementation, dense_scores_with};
    let mut rng = Rng::new(0xde45e);
    for backend in available() {
        // AVX-512 runs kernels of its own for rows of a multiple of 16: these are tested here.
        if backend == Backend::Avx512 {
            assert_eq!(dense_implementation(backend, 64), Backend::Avx512);
            assert_eq!(dense_implementation(backend, 72), Backend::Avx2);
        } else {
            assert_eq!(dense_implementation(backend, 64), kvq_kernels_simd::implementation(backend));
        }
        for &dim in DIMS {
            for &rows in ROWS {
                let magnitude = [1.0f32, 1e-30, 1e20, 0.0][rng.below(4) as usize];
                let x: Vec<f32> = (0..rows * dim).map(|_| rng.normal() as f32 * magnitude).collect();
                for n_q in [1usize, 3, 4, 5] {
                    let what = format!("{backend} dim {dim} rows {rows} n_q {n_q} magnitude {magnitude}");
                    let q: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
                    let p: Vec<f32> = (0..n_q * rows).map(|_| rng.uniform() as f32).collect();
                    let start: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
                    let mags = |xv: &[f32]| {
                        (
                            dense_score_mags(&q, xv, rows, dim, n_q),
                            dense_axpy_mags(&start, &p, xv, rows, dim, n_q),
                        )
                    };
                    let (mut got, mut want) = (vec![0f32; n_q * rows], vec![0f32; n_q * rows]);
                    let (mut got_o, mut want_o) = (start.clone(), start.clone());
                    dense_scores_with(backend, &x, rows, dim, &q, n_q, &mut got).unwrap();
                    scalar::dense_scores(&x, rows, dim, &q, n_q, &mut want);
                    dense_axpy_with(backend, &x, rows, dim, &p, n_q, &mut got_o).unwrap();
                    scalar::dense_axpy(&x, rows, dim, &p, n_q, &mut want_o);
                    let (score_mags, axpy_mags) = mags(&x);
                    close(&format!("{what}: scores"), &got, &want, &score_mags);
                    close(&format!("{what}: axpy"), &got_o, &want_o, &axpy_mags);
                    // The same rows stored as f16 (huge values become ±∞ there: skipped).
                    if magnitude < 1e4 {
                        let x16: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
                        let (mut got_o, mut want_o) = (start.clone(), start.clone());
                        dense_scores_with(backend, &x16, rows, dim, &q, n_q, &mut got).unwrap();
                        scalar::dense_scores_f16(&x16, rows, dim, &q, n_q, &mut want);
                        dense_axpy_with(backend, &x16, rows, dim, &p, n_q, &mut got_o).unwrap();
                        scalar::dense_axpy_f16(&x16, rows, dim, &p, n_q, &mut want_o);
                        let (score_mags, axpy_mags) =
                            mags(&x16.iter().map(|h| h.to_f32()).collect::<Vec<_>>());
                        close(&format!("{what}: f16 scores"), &got, &want, &score_mags);
                        close(&format!("{what}: f16 axpy"), &got_o, &want_o, &axpy_mags);
                    }
                }
            }
        }
        let mut out = [0f32; 2];
        assert!(dense_scores_with(backend, &[0.0; 7], 2, 4, &[0.0; 4], 1, &mut out).is_err());
        assert!(dense_axpy_with(backend, &[0.0; 8], 2, 4, &[0.0; 3], 1, &mut [0.0; 4]).is_err());
        assert!(dense_scores_with::<f32>(backend, &[], usize::MAX, 2, &[0.0; 2], 1, &mut out).is_err());
        let x16 = [half::f16::ZERO; 8];
        assert!(dense_scores_with(backend, &x16[..7], 2, 4, &[0.0; 4], 1, &mut out).is_err());
        assert!(dense_axpy_with(backend, &x16, 2, 4, &[0.0; 3], 1, &mut [0.0; 4]).is_err());
        assert!(dense_scores_with::<half::f16>(backend, &[], usize::MAX, 2, &[0.0; 2], 1, &mut out).is_err());
    }
}

#[test]
fn f16_widening_equals_the_reference_at_every_length_and_alignment() {
    use half::f16;
    let mut rng = Rng::new(41);
    // Normal, subnormal, zero, infinite and NaN halves, and random bit patterns.
    let specials =
        [0x0000u16, 0x8000, 0x0001, 0x83ff, 0x3c00, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00, 0x7c01];
    for len in 0..70usize {
        for pad in [0usize, 1] {
            let vals: Vec<u16> = (0..len)
                .map(|i| {
                    if i % 5 == 0 { specials[i / 5 % specials.len()] } else { (rng.next_u64() >> 48) as u16 }
                })
                .collect();
            let mut bytes = vec![0u8; pad];
            bytes.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
            let mut got = vec![-1f32; len + 3];
            let n = kvq_kernels_simd::widen_f16(&bytes[pad..], &mut got);
            assert_eq!(n, len, "converts what both sides hold");
            for (i, &v) in vals.iter().enumerate() {
                let want = f16::from_bits(v).to_f32();
                if want.is_nan() {
                    assert!(got[i].is_nan(), "{v:#06x} -> {}", got[i]);
                } else {
                    assert_eq!(got[i].to_bits(), want.to_bits(), "{v:#06x} at {i} of {len}");
                }
            }
            assert!(got[len..].iter().all(|&x| x == -1.0), "nothing written past the values");
            // A short byte slice converts only its whole values.
            let mut few = vec![0f32; len];
            let odd = &bytes[pad..pad + (2 * len).saturating_sub(1)];
            assert_eq!(kvq_kernels_simd::widen_f16(odd, &mut few), len.saturating_sub(1));
        }
    }
}

/// One-byte parameters widened on their grid: the vector kernel against `ParamGrid::widen`
/// bit for bit, at every length around the 8-pair lanes, on grids narrow, wide, negative,
/// of zero width and at f16's ends, with indices at both ends, equal, and a maximum below its
/// minimum (a corrupt block: width zero). Slices of different lengths panic, as the
/// reference's do.
#[test]
fn grid_widening_equals_the_reference_bit_for_bit() {
    use kvq_quant_core::ParamGrid;
    let mut rng = Rng::new(47);
    let grids =
        [(-1.0f32, 1.0f32), (0.0, 0.0), (-3.5, -0.25), (0.125, 7.0), (-65504.0, 65504.0), (1e-3, 2e-3)];
    for (lo, hi) in grids {
        let grid = ParamGrid::fit([(lo, hi)]).unwrap();
        for levels in [1.0f32, 3.0, 7.0, 15.0, 255.0] {
            for len in 0..=67usize {
                let byte = |rng: &mut Rng, i: usize| match i % 11 {
                    0 => 0u8,
                    1 => 255,
                    _ => (rng.next_u64() % 256) as u8,
                };
                let mins: Vec<u8> = (0..len).map(|i| byte(&mut rng, i)).collect();
                let maxs: Vec<u8> = (0..len)
                    .map(|i| match i % 5 {
                        0 => mins[i],
                        1 => byte(&mut rng, i + 1),
                        _ => mins[i].saturating_add((rng.next_u64() % 64) as u8),
                    })
                    .collect();
                let (mut ws, mut wo) = (vec![0f32; len], vec![0f32; len]);
                grid.widen(&mins, &maxs, levels, &mut ws, &mut wo);
                let (mut gs, mut go) = (vec![-1f32; len], vec![-1f32; len]);
                kvq_kernels_simd::widen_grid(&grid, &mins, &maxs, levels, &mut gs, &mut go);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&gs), bits(&ws), "scales: grid {lo}..{hi}, levels {levels}, {len} pairs");
                assert_eq!(bits(&go), bits(&wo), "offsets: grid {lo}..{hi}, levels {levels}, {len} pairs");
            }
        }
    }
    let grid = ParamGrid::fit([(0.0, 1.0)]).unwrap();
    let r = std::panic::catch_unwind(|| {
        kvq_kernels_simd::widen_grid(&grid, &[1, 2], &[3], 15.0, &mut [0.0; 2], &mut [0.0; 2]);
    });
    assert!(r.is_err(), "slices of different lengths are refused, as by ParamGrid::widen");
}

/// Keys stored before RoPE, decoded and turned, and scored: every backend against the f64
/// reference, on widths with and without a vector body, 2-, 3-, 4- and 8-bit rows packed as a
/// block holds them, both pairings, codes at both ends of their range, zero, large and negative
/// parameters, a table of real (cos, sin) pairs, and 1 to 9 query rows.
#[test]
fn decode_turn_matches_the_reference() {
    use kvq_kernels_simd::{TurnRows, decode_turn_with, scores_turn_with};
    use kvq_quant_core::RopePairing;
    let mut rng = Rng::new(43);
    for d in (2..=160usize).step_by(2) {
        for (rows, bits) in [(0usize, 4u8), (1, 8), (3, 4), (5, 2), (4, 3), (2, 8), (7, 4)] {
            for pairing in [RopePairing::Half, RopePairing::Interleaved] {
                let partner = |c: usize| {
                    let i = (0..d / 2)
                        .find(|&i| [pairing.channels(i, d).0, pairing.channels(i, d).1].contains(&c));
                    pairing.channels(i.unwrap(), d)
                };
                let top = (1u16 << bits) - 1;
                let codes: Vec<u8> = (0..rows * d)
                    .map(|i| match i % 7 {
                        0 => 0,
                        1 => top as u8,
                        _ => (rng.next_u64() % (u64::from(top) + 1)) as u8,
                    })
                    .collect();
                let packed: Vec<u8> =
                    codes.chunks(d.max(1)).flat_map(|row| pack(row, bits).unwrap()).collect();
                let scale: Vec<f32> =
                    (0..d).map(|c| if c % 9 == 4 { 0.0 } else { (rng.normal() * 3.0) as f32 }).collect();
                let offset: Vec<f32> =
                    (0..d).map(|c| if c % 11 == 3 { -1e4 } else { rng.normal() as f32 }).collect();
                let mut table = Vec::new();
                for _ in 0..rows {
                    let angles: Vec<f64> = (0..d).map(|_| rng.normal() * 4.0).collect();
                    // Both channels of a pair take the angle of its first channel.
                    let angle = |c: usize| angles[partner(c).0];
                    table.extend((0..d).map(|c| angle(c).cos() as f32));
                    table.extend((0..d).map(|c| {
                        let s = angle(c).sin() as f32;
                        if partner(c).0 == c { -s } else { s }
                    }));
                }
                let t = TurnRows {
                    codes: &packed,
                    bits,
                    scale: &scale,
                    offset: &offset,
                    table: &table,
                    pairing,
                    dim: d,
                };
                let what = format!("{pairing:?} d {d}, {rows} rows of {bits} bits");
                // |x| of a channel of row r: the decode's two terms.
                let x = |r: usize, j: usize| (f32::from(codes[r * d + j]) * scale[j]).abs() + offset[j].abs();
                let mut want = vec![0f32; rows * d];
                kvq_kernels_simd::scalar::decode_turn(&t, &mut want);
                for backend in available() {
                    let mut got = vec![f32::NAN; rows * d];
                    decode_turn_with(backend, &t, &mut got).unwrap();
                    for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        let (r, c) = (k / d, k % d);
                        let (a, b) = partner(c);
                        let tol = 4.0 * f32::EPSILON * (x(r, a) + x(r, b));
                        assert!((g - w).abs() <= tol, "{backend} {what}: row {r} channel {c}: {g} vs {w}");
                    }
                }
                for n_q in [1usize, 3, 4, 5, 9] {
                    let q: Vec<f32> = (0..n_q * d).map(|_| rng.normal() as f32).collect();
                    let mut want = vec![0f32; n_q * rows];
                    kvq_kernels_simd::scalar::scores_turn(&t, &q, n_q, &mut want);
                    for backend in available() {
                        let mut got = vec![f32::NAN; n_q * rows];
                        scores_turn_with(backend, &t, &q, n_q, &mut got).unwrap();
                        for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
                            let (i, r) = (k / rows, k % rows);
                            let mag: f32 = (0..d)
                                .map(|c| q[i * d + c].abs() * (x(r, partner(c).0) + x(r, partner(c).1)))
                                .sum();
                            let tol = 8.0 * f32::EPSILON * mag + 1e-30;
                            assert!((g - w).abs() <= tol, "{backend} {what}: q {i} row {r}: {g} vs {w}");
                        }
                    }
                    let mut short = vec![0f32; n_q * rows + 1];
                    assert!(scores_turn_with(Kernels::SCALAR, &t, &q, n_q, &mut short).is_err());
                }
                // Bad shapes are errors, not panics.
                if rows > 0 {
                    let mut out = vec![0f32; rows * d];
                    let bad = [
                        TurnRows { table: &table[..rows * 2 * d - 1], ..t },
                        TurnRows { scale: &scale[1..], ..t },
                        TurnRows { codes: &packed[1..], ..t },
                        TurnRows { bits: 9, ..t },
                        TurnRows { bits: 0, ..t },
                    ];
                    for b in bad {
                        assert!(decode_turn_with(Kernels::SCALAR, &b, &mut out).is_err());
                    }
                }
            }
        }
    }
    let odd = TurnRows {
        codes: &[0; 3],
        bits: 8,
        scale: &[0.0; 3],
        offset: &[0.0; 3],
        table: &[0.0; 6],
        pairing: RopePairing::Half,
        dim: 3,
    };
    assert!(decode_turn_with(Kernels::SCALAR, &odd, &mut [0f32; 3]).is_err());
}

/// A case of affine INT4 codes with parameters per channel (`per_channel`) or per row.
fn affine_case(rng: &mut Rng, rows: usize, dim: usize, per_channel: bool, special: u8) -> Case {
    affine_bits_case(rng, rows, dim, 4, per_channel, special)
}

/// [`affine_case`] with codes of `bits` bits.
fn affine_bits_case(
    rng: &mut Rng,
    rows: usize,
    dim: usize,
    bits: u8,
    per_channel: bool,
    special: u8,
) -> Case {
    let mut case = Case::random(rng, rows, dim, bits, special);
    case.levels_kind = 0;
    case.with_offset = true;
    if case.per_channel != per_channel {
        let groups = if per_channel { dim } else { rows };
        case.per_channel = per_channel;
        case.scale = (0..groups)
            .map(|g| if special == 5 && g % 2 == 0 { 0.0 } else { rng.uniform() as f32 + 0.01 })
            .collect();
        case.offset = (0..groups).map(|_| rng.normal() as f32).collect();
    }
    case
}

/// A fused call's softmax state after one block against its reference's, for the query rows
/// of `q`: the running maxima to the rounding of the scores' float epilogue (`key_term(c)`
/// bounds channel `c` of every key row), the sums and outputs to that of `exp` and of float
/// sums in other orders, plus two flips of a rounded weight per output. `si` holds the
/// integer path's scores (a row of the values' rows per query row) that both sides weight the
/// values `vc` with; `m0` and `o0` the state before the call.
#[allow(clippy::too_many_arguments)]
fn assert_fused_close(
    what: &str,
    q: &[f32],
    key_term: impl Fn(usize) -> f64,
    si: &[f32],
    vc: &Case,
    (m0, o0): (&[f32], &[f32]),
    got: Outcome<'_>,
    want: Outcome<'_>,
) {
    let (rows, dim) = (vc.rows, vc.dim);
    let mut x = vec![0f32; rows * dim];
    scalar::dequantize(&vc.block(), &mut x);
    for i in 0..got.m.len() {
        let qi = &q[i * dim..(i + 1) * dim];
        let mag: f64 = (0..dim).map(|c| f64::from(qi[c].abs()) * key_term(c)).sum();
        let dm = 2e-6 * mag + 1e-30;
        let (m, wm) = (got.m[i], want.m[i]);
        assert!((m - wm).abs() as f64 <= dm, "{what} m[{i}]: {m} vs {wm}");
        // A shift δ of the maximum scales every exponential by e^δ.
        let rel = 1e-5 + 2.0 * dm;
        let (l, wl) = (got.l[i], want.l[i]);
        assert!(((l - wl).abs() as f64) <= rel * f64::from(wl.abs()) + 1e-30, "{what} l[{i}]: {l} vs {wl}");
        let f = f64::from((m0[i] - wm).exp());
        let p: Vec<f64> = (0..rows).map(|r| (f64::from(si[i * rows + r]) - f64::from(wm)).exp()).collect();
        for c in 0..dim {
            // The largest weight of the channel's row or group, over 255.
            let sw =
                (0..rows).map(|r| p[r] * f64::from(vc.scale[vc.param(r, c)])).fold(0f64, f64::max) / 255.0;
            let j = i * dim + c;
            let mag: f64 = f64::from(o0[j].abs()) * f
                + (0..rows).map(|r| p[r] * f64::from(x[r * dim + c].abs())).sum::<f64>();
            let tol = rel * mag + 16.0 * sw + 1e-30;
            let (o, wo) = (got.o[j], want.o[j]);
            assert!(
                (f64::from(o) - f64::from(wo)).abs() <= tol,
                "{what} o[{j}]: {o} vs {wo} (tolerance {tol})"
            );
        }
    }
}

/// A softmax state read back: maxima, sums, outputs.
struct Outcome<'a> {
    m: &'a [f32],
    l: &'a [f32],
    o: &'a [f32],
}

/// The fused block kernel (keys' scores, the online softmax step, the values' sums in one
/// call) against its reference, the integer kernels run one after the other: the running
/// maxima to the rounding of the scores' float epilogue, the sums and outputs to that of
/// `exp` and of float sums in other orders, plus two flips of a rounded weight.
#[test]
fn fused_block_attention_matches_its_reference() {
    use kvq_kernels_simd::{Online, attend_int_with};
    let mut rng = Rng::new(0xf05e);
    let mut ran = 0;
    let mut ran_at = std::collections::BTreeSet::new();
    let mut narrow_at = std::collections::BTreeSet::new();
    for backend in available() {
        for (dim, rows) in [
            (128usize, 32usize),
            (128, 1),
            (128, 5),
            (128, 17),
            (128, 64),
            (256, 33),
            (128, 256),
            (256, 100),
            (64, 32),
            (64, 1),
            (64, 7),
            (64, 13),
            (64, 130),
        ] {
            // Keys per channel (`Some(0)`) and values per row or per group (the AVX-512 and
            // AVX2 kernels'); keys per row (`None`) or per group (theirs too) with values per
            // row or per group.
            let layouts = [
                (Some(0), None),
                (Some(0), Some(32usize)),
                (Some(0), Some(64)),
                (Some(0), Some(128)),
                (None, None),
                (None, Some(32)),
                (Some(32), None),
                (Some(32), Some(32)),
                (Some(64), Some(32)),
                (Some(128), Some(64)),
            ]
            .into_iter()
            .filter(|(kg, vg)| [kg, vg].iter().all(|g| g.is_none_or(|g| g == 0 || dim % g == 0)));
            // Keys and values of 4 bits; with values per row also values of 1 to 3 bits (the
            // AVX-512 kernel's narrow values) and, keys per channel, keys of 2, 3 and 8 bits
            // (its key regions, one of the whole row).
            let widths = |(k, g): (Option<usize>, Option<usize>)| match (k, g) {
                (_, Some(_)) => &[(4u8, 4u8)][..],
                (Some(0), None) => &[(4, 4), (4, 3), (4, 2), (4, 1), (3, 3), (2, 2), (8, 4), (3, 4)][..],
                _ => &[(4, 4), (4, 3), (4, 1)][..],
            };
            for (special, (key_layout, group), (kbits, vbits)) in [0u8, 5, 6]
                .into_iter()
                .flat_map(|s| layouts.clone().flat_map(move |g| widths(g).iter().map(move |&b| (s, g, b))))
            {
                let per_channel = key_layout == Some(0);
                let key_group = key_layout.filter(|&g| g > 0);
                let special_keys = if special == 5 { 0 } else { special };
                let mut kc = affine_bits_case(&mut rng, rows, dim, kbits, per_channel, special_keys);
                let mut vc = affine_bits_case(&mut rng, rows, dim, vbits, false, special);
                // Every group's own scale and offset (values, special 5: every other scale zero).
                for (c, g, zeros) in [(&mut kc, key_group, false), (&mut vc, group, special == 5)] {
                    if let Some(g) = g {
                        *c = c.clone().grouped(g);
                        for (j, (s, f)) in c.scale.iter_mut().zip(c.offset.iter_mut()).enumerate() {
                            *s = if zeros && j % 2 == 0 { 0.0 } else { rng.uniform() as f32 + 0.01 };
                            *f = rng.normal() as f32;
                        }
                    }
                }
                let (k, v) = (kc.block(), vc.block());
                for n_q in [1usize, 2, 3, 4, 5, 8] {
                    // Special 6: scores spread over a wide range (most weights underflow).
                    let spread = if special == 6 { 40.0 } else { 1.0 };
                    let q: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32 * spread).collect();
                    for running in [false, true] {
                        let (mut m, mut l) = if running {
                            let m: Vec<f32> = (0..n_q).map(|_| rng.normal() as f32 * 3.0).collect();
                            (m, (0..n_q).map(|_| rng.uniform() as f32 * 5.0 + 0.5).collect::<Vec<f32>>())
                        } else {
                            (vec![f32::NEG_INFINITY; n_q], vec![0.0; n_q])
                        };
                        let mut o: Vec<f32> = if running {
                            (0..n_q * dim).map(|_| rng.normal() as f32).collect()
                        } else {
                            vec![0.0; n_q * dim]
                        };
                        let (m0, o0) = (m.clone(), o.clone());
                        let (mut wm, mut wl, mut wo) = (m.clone(), l.clone(), o.clone());
                        let state = Online { m: &mut m, l: &mut l, o: &mut o };
                        if !attend_int_with(backend, &k, &v, &q, n_q, state).unwrap() {
                            continue;
                        }
                        ran += 1;
                        if (kbits, vbits) == (4, 4) {
                            ran_at.insert((backend.backend(), dim, group.is_some(), !per_channel));
                        }
                        narrow_at.insert((backend.backend(), dim, kbits, vbits));
                        assert!(scalar::attend_int(
                            &k,
                            &v,
                            &q,
                            n_q,
                            Online { m: &mut wm, l: &mut wl, o: &mut wo }
                        ));
                        let what = format!(
                            "{backend} dim {dim} rows {rows} keys per channel {per_channel} per group {key_group:?} {kbits} bits, values of {vbits} bits per group {group:?} special {special} n_q {n_q} running {running}"
                        );
                        // The scores both sides weight the values with: the integer path's
                        // (its rounded query), not the float ones, which differ by the query's
                        // rounding (several units at special 6's spread).
                        let mut si = vec![0f32; n_q * rows];
                        assert!(scalar::scores_int8(&k, &q, n_q, &mut si));
                        // The scores' magnitude: the query times every key value's terms (keys
                        // per group: each channel's largest over the rows).
                        let key_term = |c: usize| {
                            let term = |r| {
                                let j = kc.param(r, c);
                                let top = f64::from((1u16 << kbits) - 1);
                                f64::from(kc.scale[j]) * top + f64::from(kc.offset[j].abs())
                            };
                            (0..rows).map(term).fold(0f64, f64::max)
                        };
                        let (got, want) =
                            (Outcome { m: &m, l: &l, o: &o }, Outcome { m: &wm, l: &wl, o: &wo });
                        assert_fused_close(&what, &q, key_term, &si, &vc, (&m0, &o0), got, want);
                    }
                }
            }
        }
    }
    // The head_dims each backend's kernel ran at, with values per group or not and keys per
    // row or group or per channel.
    let dims = |b: Backend, grouped: bool, keys: bool| {
        let at = ran_at.iter().filter(|x| x.0 == b && x.2 == grouped && x.3 == keys).map(|x| x.1);
        at.collect::<std::collections::BTreeSet<_>>().into_iter().collect::<Vec<_>>()
    };
    let none = Vec::<usize>::new();
    #[cfg(target_arch = "aarch64")]
    if available().iter().any(|k| *k == Backend::Dotprod) {
        assert_eq!(
            dims(Backend::Dotprod, false, false),
            vec![64, 128, 256],
            "head_dims the dotprod kernel ran at"
        );
        let all = vec![64, 128, 256];
        assert_eq!(dims(Backend::Dotprod, true, false), all, "values per group: the dotprod kernel");
        assert_eq!(dims(Backend::Dotprod, false, true), all, "keys per row or group: the dotprod kernel");
        assert_eq!(dims(Backend::Dotprod, true, true), all, "keys and values per group: dotprod");
        // Keys per channel of other widths and narrow values: one key region, unpacked.
        let widths = [(4u8, 3u8), (4, 2), (4, 1), (3, 3), (2, 2), (8, 4), (3, 4)];
        for (dim, (kb, vb)) in all.iter().flat_map(|&d| widths.map(move |w| (d, w))) {
            assert!(narrow_at.contains(&(Backend::Dotprod, dim, kb, vb)), "dotprod: {kb}/{vb} bits at {dim}");
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        if available().iter().any(|k| *k == Backend::Avx512)
            && std::arch::is_x86_feature_detected!("avx512vnni")
        {
            assert!(ran > 0, "the fused kernel never ran on a machine that has it");
            let all = vec![64, 128, 256];
            assert_eq!(dims(Backend::Avx512, false, false), all, "head_dims the AVX-512 kernel ran at");
            assert_eq!(dims(Backend::Avx512, true, false), all, "values per group: the AVX-512 kernel");
            assert_eq!(dims(Backend::Avx512, false, true), all, "keys per row or group: the AVX-512 kernel");
            assert_eq!(dims(Backend::Avx512, true, true), all, "keys and values per group: AVX-512");
            if std::arch::is_x86_feature_detected!("avx512vbmi") {
                let widths = [(4u8, 3u8), (4, 2), (4, 1), (3, 3), (2, 2), (8, 4), (3, 4)];
                for (dim, (kb, vb)) in all.iter().flat_map(|&d| widths.map(move |w| (d, w))) {
                    assert!(narrow_at.contains(&(Backend::Avx512, dim, kb, vb)), "{kb}/{vb} bits at {dim}");
                }
            }
        }
        if available().iter().any(|k| *k == Backend::Avx2) {
            let all = vec![64, 128, 256];
            assert_eq!(dims(Backend::Avx2, false, false), all, "head_dims the AVX2 kernel ran at");
            assert_eq!(
                dims(Backend::Avx2, true, false),
                all,
                "values per group: head_dims of the AVX2 kernel"
            );
            assert_eq!(dims(Backend::Avx2, false, true), all, "keys per row or group: the AVX2 kernel");
            assert_eq!(dims(Backend::Avx2, true, true), all, "keys and values per group: AVX2");
            // Keys per channel of other widths and narrow values: one key region, unpacked.
            let widths = [(4u8, 3u8), (4, 2), (4, 1), (3, 3), (2, 2), (8, 4), (3, 4)];
            for (dim, (kb, vb)) in all.iter().flat_map(|&d| widths.map(move |w| (d, w))) {
                assert!(narrow_at.contains(&(Backend::Avx2, dim, kb, vb)), "AVX2: {kb}/{vb} bits at {dim}");
            }
        }
    }
    // Narrow values run on the AVX-512, AVX2 and dotprod kernels only.
    let simd = |b: Backend| matches!(b, Backend::Avx512 | Backend::Avx2 | Backend::Dotprod);
    assert!(narrow_at.iter().all(|x| (x.2, x.3) == (4, 4) || simd(x.0)), "{narrow_at:?}");
    let _ = (ran, dims, none);
}

/// Keys in parts (a block of per-channel keys whose parameters change every few rows, as a
/// cache block of `int4-channel32` keys 128 tokens long holds them) against one block of
/// values, in one fused call, against its reference: each part's scores by the integer
/// scores kernel, one softmax step and one value sum over all rows. Tolerances as the
/// one-block test's. Bad splits are errors; one part is `attend_int_with` itself.
#[test]
fn fused_attention_over_key_parts_matches_its_reference() {
    use kvq_kernels_simd::{Online, attend_int_fused_parts, attend_int_parts_with, attend_int_with};
    let mut rng = Rng::new(0x9a27);
    let mut ran = std::collections::BTreeSet::new();
    for backend in available() {
        for (dim, split) in [
            (128usize, vec![32usize, 32, 32, 32]),
            (128, vec![32, 32, 32, 7]),
            (64, vec![16, 16]),
            (64, vec![32, 32, 32, 32, 32, 32, 32, 32]),
            (256, vec![64, 1, 33]),
            (128, vec![5]),
        ] {
            let rows: usize = split.iter().sum();
            for (special, group, vbits) in [
                (0u8, None, 4u8),
                (5, None, 4),
                (6, None, 4),
                (0, Some(32usize), 4),
                (6, Some(64), 4),
                (5, None, 3),
            ] {
                let kcs: Vec<_> = split
                    .iter()
                    .map(|&r| affine_case(&mut rng, r, dim, true, if special == 5 { 0 } else { special }))
                    .collect();
                let mut vc = affine_bits_case(&mut rng, rows, dim, vbits, false, special);
                if let Some(g) = group {
                    vc = vc.grouped(g);
                    for (s, f) in vc.scale.iter_mut().zip(vc.offset.iter_mut()) {
                        (*s, *f) = (rng.uniform() as f32 + 0.01, rng.normal() as f32);
                    }
                }
                let parts: Vec<_> = kcs.iter().map(|c| c.block()).collect();
                let v = vc.block();
                for n_q in [1usize, 3, 4, 8] {
                    let spread = if special == 6 { 40.0 } else { 1.0 };
                    let q: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32 * spread).collect();
                    let m0: Vec<f32> = (0..n_q).map(|_| rng.normal() as f32 * 3.0).collect();
                    let l0: Vec<f32> = (0..n_q).map(|_| rng.uniform() as f32 * 5.0 + 0.5).collect();
                    let o0: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
                    let (mut m, mut l, mut o) = (m0.clone(), l0.clone(), o0.clone());
                    let state = Online { m: &mut m, l: &mut l, o: &mut o };
                    let fused = attend_int_fused_parts(backend, &parts, &v, n_q);
                    let done = attend_int_parts_with(backend, &parts, &v, &q, n_q, state).unwrap();
                    assert_eq!(done, fused, "{backend}: attend_int_fused_parts says what runs");
                    if !done {
                        assert!(m == m0 && l == l0 && o == o0, "{backend}: a refusal changes nothing");
                        continue;
                    }
                    ran.insert((backend.backend(), dim, group.is_some()));
                    let (mut wm, mut wl, mut wo) = (m0.clone(), l0.clone(), o0.clone());
                    assert!(scalar::attend_int_parts(
                        &parts,
                        &v,
                        &q,
                        n_q,
                        Online { m: &mut wm, l: &mut wl, o: &mut wo }
                    ));
                    let what = format!(
                        "{backend} dim {dim} parts {split:?} values per group {group:?} special {special} n_q {n_q}"
                    );
                    // The scores the reference weighs with: each part's integer scores.
                    let mut si = vec![0f32; n_q * rows];
                    let mut at = 0;
                    for k in &parts {
                        let mut part = vec![0f32; n_q * k.rows()];
                        assert!(scalar::scores_int8(k, &q, n_q, &mut part));
                        for i in 0..n_q {
                            si[i * rows + at..i * rows + at + k.rows()]
                                .copy_from_slice(&part[i * k.rows()..(i + 1) * k.rows()]);
                        }
                        at += k.rows();
                    }
                    let key_term = |c: usize| {
                        let term = |kc: &Case| f64::from(kc.scale[c]) * 15.0 + f64::from(kc.offset[c].abs());
                        kcs.iter().map(term).fold(0f64, f64::max)
                    };
                    let (got, want) = (Outcome { m: &m, l: &l, o: &o }, Outcome { m: &wm, l: &wl, o: &wo });
                    assert_fused_close(&what, &q, key_term, &si, &vc, (&m0, &o0), got, want);
                }
                // One part is the one-block call, bit for bit.
                if split.len() == 1 {
                    let q: Vec<f32> = (0..4 * dim).map(|_| rng.normal() as f32).collect();
                    let (mut a, mut b) = (
                        (vec![0f32; 4], vec![0f32; 4], vec![0f32; 4 * dim]),
                        (vec![0f32; 4], vec![0f32; 4], vec![0f32; 4 * dim]),
                    );
                    a.0.fill(f32::NEG_INFINITY);
                    b.0.fill(f32::NEG_INFINITY);
                    let x = attend_int_parts_with(
                        backend,
                        &parts,
                        &v,
                        &q,
                        4,
                        Online { m: &mut a.0, l: &mut a.1, o: &mut a.2 },
                    )
                    .unwrap();
                    let y = attend_int_with(
                        backend,
                        &parts[0],
                        &v,
                        &q,
                        4,
                        Online { m: &mut b.0, l: &mut b.1, o: &mut b.2 },
                    )
                    .unwrap();
                    assert!(x == y && a == b, "{backend}: one part is one block");
                }
                // Parts that do not add up to the values' rows, or no parts: errors.
                let q = vec![0f32; dim];
                let (mut m, mut l, mut o) = (vec![f32::NEG_INFINITY], vec![0f32], vec![0f32; dim]);
                for bad in [&parts[..parts.len() - 1], &[]] {
                    if bad.iter().map(|k| k.rows()).sum::<usize>() == rows {
                        continue;
                    }
                    let state = Online { m: &mut m, l: &mut l, o: &mut o };
                    assert!(
                        attend_int_parts_with(backend, bad, &v, &q, 1, state).is_err(),
                        "{backend}: bad split"
                    );
                }
            }
        }
    }
    // Parts of different layouts (a part per row, or 8-bit), or in parts but per row: no fused
    // kernel, nothing changed.
    for backend in available() {
        let v = affine_case(&mut rng, 64, 128, false, 0);
        let a = affine_case(&mut rng, 32, 128, true, 0);
        let mut wide = Case::random(&mut rng, 32, 128, 8, 0);
        (wide.levels_kind, wide.with_offset, wide.per_channel) = (0, true, true);
        wide.scale = (0..128).map(|_| rng.uniform() as f32 + 0.01).collect();
        wide.offset = (0..128).map(|_| rng.normal() as f32).collect();
        let rows = affine_case(&mut rng, 32, 128, false, 0);
        for (a, b) in [(&a, &rows), (&a, &wide), (&rows, &rows)] {
            let parts = [a.block(), b.block()];
            let q: Vec<f32> = (0..4 * 128).map(|_| rng.normal() as f32).collect();
            let (mut m, mut l, mut o) = (vec![0.5f32; 4], vec![1f32; 4], vec![0.25f32; 4 * 128]);
            let state = Online { m: &mut m, l: &mut l, o: &mut o };
            assert!(!attend_int_fused_parts(backend, &parts, &v.block(), 4));
            assert!(!attend_int_parts_with(backend, &parts, &v.block(), &q, 4, state).unwrap());
            assert!(m == [0.5; 4] && l == [1.0; 4] && o.iter().all(|&x| x == 0.25), "{backend}");
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        if available().iter().any(|k| *k == Backend::Avx512)
            && std::arch::is_x86_feature_detected!("avx512vnni")
        {
            for dim in [64, 128, 256] {
                for grouped in [false, true] {
                    assert!(
                        ran.contains(&(Backend::Avx512, dim, grouped)),
                        "AVX-512 parts at {dim}, grouped {grouped}"
                    );
                }
            }
        }
        if available().iter().any(|k| *k == Backend::Avx2) {
            for dim in [64, 128, 256] {
                assert!(ran.contains(&(Backend::Avx2, dim, false)), "AVX2 parts at {dim}");
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    if available().iter().any(|k| *k == Backend::Dotprod) {
        for dim in [64, 128, 256] {
            assert!(ran.contains(&(Backend::Dotprod, dim, false)), "dotprod parts at {dim}");
        }
    }
    let _ = ran;
}

/// Keys in channel regions of their own widths (`-qa` keys: each width's channels a
/// per-channel block) against one block of values, in one fused call, against its reference:
/// each region's scores by the integer scores kernel with its columns of the query, added,
/// one softmax step and one value sum. Every width from 1 to 8 bits, regions of 8 to 200
/// channels, tails of rows. Tolerances as the one-block test's. Regions that do not tile the
/// row are errors; regions of other levels are refused and change nothing.
#[test]
fn fused_attention_over_key_regions_matches_its_reference() {
    use kvq_kernels_simd::{
        KeyRegion, Online, attend_int_fused_regions, attend_int_regions_with, scores_int8_regions_with,
    };
    let mut rng = Rng::new(0x4e91);
    let (mut ran, mut scored) = (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
    let splits: [(usize, &[(u8, usize)]); 7] = [
        (128, &[(3, 32), (4, 64), (5, 32)]),
        (128, &[(1, 32), (2, 64), (3, 32)]),
        (128, &[(5, 128)]),
        (64, &[(1, 8), (2, 8), (3, 8), (4, 8), (5, 8), (6, 8), (7, 8), (8, 8)]),
        (64, &[(2, 8), (6, 16), (7, 8), (8, 32)]),
        (256, &[(4, 200), (8, 56)]),
        (256, &[(3, 72), (5, 136), (2, 48)]),
    ];
    for backend in available() {
        for (dim, split) in splits {
            for rows in [32usize, 7, 129] {
                // Values of 4 bits (per row or group) and of 1 to 3 bits per row.
                for (special, group, vbits) in [
                    (0u8, None, 4u8),
                    (5, None, 4),
                    (6, None, 3),
                    (1, None, 2),
                    (2, Some(32usize), 4),
                    (0, None, 3),
                    (5, None, 1),
                ] {
                    let kcs: Vec<_> = split
                        .iter()
                        .map(|&(bits, c)| {
                            affine_bits_case(
                                &mut rng,
                                rows,
                                c,
                                bits,
                                true,
                                if special == 5 { 0 } else { special },
                            )
                        })
                        .collect();
                    let mut vc = affine_bits_case(&mut rng, rows, dim, vbits, false, special);
                    if let Some(g) = group {
                        vc = vc.grouped(g);
                        for (s, f) in vc.scale.iter_mut().zip(vc.offset.iter_mut()) {
                            (*s, *f) = (rng.uniform() as f32 + 0.01, rng.normal() as f32);
                        }
                    }
                    let mut first = 0;
                    let regions: Vec<KeyRegion<'_>> = kcs
                        .iter()
                        .map(|c| {
                            let r = KeyRegion { first, keys: c.block() };
                            first += c.dim;
                            r
                        })
                        .collect();
                    let v = vc.block();
                    for n_q in [1usize, 2, 3, 4, 8] {
                        let spread = if special == 6 { 40.0 } else { 1.0 };
                        let q: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32 * spread).collect();
                        let m0: Vec<f32> = (0..n_q).map(|_| rng.normal() as f32 * 3.0).collect();
                        let l0: Vec<f32> = (0..n_q).map(|_| rng.uniform() as f32 * 5.0 + 0.5).collect();
                        let o0: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
                        let (mut m, mut l, mut o) = (m0.clone(), l0.clone(), o0.clone());
                        let state = Online { m: &mut m, l: &mut l, o: &mut o };
                        let fused = attend_int_fused_regions(backend, &regions, &v, n_q);
                        let done = attend_int_regions_with(backend, &regions, &v, &q, n_q, state).unwrap();
                        assert_eq!(done, fused, "{backend}: attend_int_fused_regions says what runs");
                        let what = format!(
                            "{backend} dim {dim} regions {split:?} rows {rows} values of {vbits} bits per group {group:?} special {special} n_q {n_q}"
                        );
                        let key_term = |c: usize| {
                            let (kc, at) = kcs
                                .iter()
                                .zip(&regions)
                                .find(|(_, r)| (r.first..r.first + r.keys.dim()).contains(&c))
                                .map(|(kc, r)| (kc, c - r.first))
                                .expect("a region per channel");
                            let top = f64::from((1u16 << kc.bits) - 1);
                            f64::from(kc.scale[at]) * top + f64::from(kc.offset[at].abs())
                        };
                        // The scores alone: the reference's (the regions' scores added), to the
                        // rounding of float sums in another order.
                        let mut want = vec![0f32; n_q * rows];
                        assert!(scalar::scores_int8_regions(&regions, &q, n_q, &mut want));
                        let mut got = vec![f32::NAN; n_q * rows + 3];
                        if scores_int8_regions_with(backend, &regions, &q, n_q, &mut got).unwrap() {
                            scored.insert((backend.backend(), dim));
                            // The AVX2 and dotprod kernels take the reference's epilogue in its
                            // order: its bits.
                            if matches!(backend.backend(), Backend::Avx2 | Backend::Dotprod) {
                                let same = got
                                    .iter()
                                    .zip(&want)
                                    .all(|(g, w)| g.to_bits() == w.to_bits() || g.is_nan() && w.is_nan());
                                assert!(same, "{what}: AVX2 region scores bit for bit");
                            }
                            for (j, (&g, &w)) in got.iter().zip(&want).enumerate() {
                                let qi = &q[j / rows * dim..(j / rows + 1) * dim];
                                let mag: f64 = (0..dim).map(|c| f64::from(qi[c].abs()) * key_term(c)).sum();
                                assert!(
                                    (f64::from(g) - f64::from(w)).abs() <= 2e-6 * mag + 1e-30
                                        || (g.is_nan() && w.is_nan()),
                                    "{what}: score {j}: {g} vs {w}"
                                );
                            }
                        }
                        assert!(
                            got[n_q * rows..].iter().all(|x| x.is_nan()),
                            "{what}: nothing past the scores"
                        );
                        assert!(
                            !done || scored.contains(&(backend.backend(), dim)),
                            "{what}: a fused kernel scores alone too"
                        );
                        if !done {
                            assert!(m == m0 && l == l0 && o == o0, "{backend}: a refusal changes nothing");
                            continue;
                        }
                        ran.insert((backend.backend(), dim, vbits));
                        let (mut wm, mut wl, mut wo) = (m0.clone(), l0.clone(), o0.clone());
                        let want = Online { m: &mut wm, l: &mut wl, o: &mut wo };
                        assert!(scalar::attend_int_regions(&regions, &v, &q, n_q, want));
                        // The scores the reference weighs with: the regions' integer scores, added.
                        let mut si = vec![0f32; n_q * rows];
                        for r in &regions {
                            let c = r.keys.dim();
                            let qr: Vec<f32> = q
                                .chunks_exact(dim)
                                .flat_map(|row| row[r.first..r.first + c].to_vec())
                                .collect();
                            let mut part = vec![0f32; n_q * rows];
                            assert!(scalar::scores_int8(&r.keys, &qr, n_q, &mut part));
                            si.iter_mut().zip(&part).for_each(|(x, y)| *x += y);
                        }
                        let (got, want) =
                            (Outcome { m: &m, l: &l, o: &o }, Outcome { m: &wm, l: &wl, o: &wo });
                        assert_fused_close(&what, &q, key_term, &si, &vc, (&m0, &o0), got, want);
                        let mut want = vec![0f32; n_q * rows];
                        assert!(scalar::scores_int8_regions(&regions, &q, n_q, &mut want));
                        assert_eq!(want, si, "the reference adds the regions' scores");
                    }
                    // Regions that leave a gap, overlap, miss the end or hold other rows: errors.
                    let q = vec![0f32; dim];
                    let (mut m, mut l, mut o) = (vec![f32::NEG_INFINITY], vec![0f32], vec![0f32; dim]);
                    let shifted: Vec<_> =
                        regions.iter().map(|r| KeyRegion { first: r.first + 8, ..*r }).collect();
                    let short = affine_bits_case(&mut rng, rows - 1, split[0].1, split[0].0, true, 0);
                    let mut fewer = regions.clone();
                    fewer[0].keys = short.block();
                    for bad in [&regions[..regions.len() - 1], &[], &shifted[..], &fewer[..]] {
                        let state = Online { m: &mut m, l: &mut l, o: &mut o };
                        assert!(
                            attend_int_regions_with(backend, bad, &v, &q, 1, state).is_err(),
                            "{backend}: bad regions"
                        );
                    }
                    // (One region of fewer rows is a block of its own to score.)
                    let bad_scores = if regions.len() > 1 { &fewer[..] } else { &[][..] };
                    for bad in [&[][..], &shifted[..], bad_scores] {
                        let mut out = vec![0f32; rows];
                        assert!(
                            scores_int8_regions_with(backend, bad, &q, 1, &mut out).is_err(),
                            "{backend}"
                        );
                    }
                    let mut short = vec![0f32; rows - 1];
                    assert!(
                        scores_int8_regions_with(backend, &regions, &q, 1, &mut short).is_err(),
                        "{backend}"
                    );
                }
            }
        }
    }
    // A region of table levels: no fused kernel, nothing changed.
    for backend in available() {
        let v = affine_case(&mut rng, 32, 128, false, 0);
        let a = affine_bits_case(&mut rng, 32, 64, 3, true, 0);
        let mut t = Case::random(&mut rng, 32, 64, 4, 0);
        (t.levels_kind, t.per_channel) = (2, true);
        t.scale = (0..64).map(|_| rng.uniform() as f32 + 0.01).collect();
        t.offset = (0..64).map(|_| rng.normal() as f32).collect();
        let regions = [KeyRegion { first: 0, keys: a.block() }, KeyRegion { first: 64, keys: t.block() }];
        let q: Vec<f32> = (0..4 * 128).map(|_| rng.normal() as f32).collect();
        let (mut m, mut l, mut o) = (vec![0.5f32; 4], vec![1f32; 4], vec![0.25f32; 4 * 128]);
        let state = Online { m: &mut m, l: &mut l, o: &mut o };
        assert!(!attend_int_fused_regions(backend, &regions, &v.block(), 4));
        assert!(!attend_int_regions_with(backend, &regions, &v.block(), &q, 4, state).unwrap());
        let mut out = vec![0.5f32; 4 * 32];
        assert!(!scores_int8_regions_with(backend, &regions, &q, 4, &mut out).unwrap());
        assert!(out.iter().all(|&x| x == 0.5), "{backend}: a refusal computes nothing");
        assert!(m == [0.5; 4] && l == [1.0; 4] && o.iter().all(|&x| x == 0.25), "{backend}");
    }
    #[cfg(target_arch = "x86_64")]
    if available().iter().any(|k| *k == Backend::Avx512)
        && std::arch::is_x86_feature_detected!("avx512vnni")
        && std::arch::is_x86_feature_detected!("avx512vbmi")
    {
        for dim in [64, 128, 256] {
            for vbits in 1..=4 {
                assert!(
                    ran.contains(&(Backend::Avx512, dim, vbits)),
                    "AVX-512 regions at {dim}, values of {vbits} bits"
                );
            }
        }
    }
    // AVX2: the region scores at every head_dim, fused with values of 1 to 4 bits.
    #[cfg(target_arch = "x86_64")]
    if available().iter().any(|k| *k == Backend::Avx2) {
        for dim in [64, 128, 256] {
            assert!(scored.contains(&(Backend::Avx2, dim)), "AVX2 region scores at {dim}");
            for vbits in 1..=4 {
                assert!(
                    ran.contains(&(Backend::Avx2, dim, vbits)),
                    "AVX2 regions at {dim}, values of {vbits} bits"
                );
            }
        }
    }
    // Dotprod: the same.
    if available().iter().any(|k| *k == Backend::Dotprod) {
        for dim in [64, 128, 256] {
            assert!(scored.contains(&(Backend::Dotprod, dim)), "dotprod region scores at {dim}");
            for vbits in 1..=4 {
                assert!(
                    ran.contains(&(Backend::Dotprod, dim, vbits)),
                    "dotprod regions at {dim}, values of {vbits} bits"
                );
            }
        }
    }
    let _ = (ran, scored);
}

/// The fused kernels' value sums at their largest: every weight rounded to 255 (equal scores,
/// equal value scales) and every value code at an end of its range (0 or 15, centred −8 or 7),
/// blocks long enough to fill the 16-bit sums a kernel keeps before widening. The outputs are
/// exact here (every value equals its offset plus a multiple of its scale), so a wrapped sum
/// shows as an error of thousands.
#[test]
fn fused_block_attention_holds_extreme_value_sums() {
    use kvq_kernels_simd::{Online, attend_int_with};
    for backend in available() {
        for dim in [64usize, 128, 256] {
            for rows in [16usize, 17, 32, 33, 256] {
                for code in [0x00u8, 0xff] {
                    let (kc, vc) = (vec![0x5au8; rows * dim / 2], vec![code; rows * dim / 2]);
                    let (ks, ko) = (vec![0.25f32; dim], vec![0.0f32; dim]);
                    let (vs, vo) = (vec![0.5f32; rows], vec![1.0f32; rows]);
                    let kp = Params::PerChannel { scale: &ks, offset: Some(&ko) };
                    let vp = Params::PerRow { scale: &vs, offset: Some(&vo) };
                    let k = QuantBlock::new(&kc, rows, dim, 4, Levels::Affine, kp).unwrap();
                    let v = QuantBlock::new(&vc, rows, dim, 4, Levels::Affine, vp).unwrap();
                    let n_q = 4;
                    let q = vec![0.0f32; n_q * dim];
                    let (mut m, mut l, mut o) =
                        (vec![f32::NEG_INFINITY; n_q], vec![0f32; n_q], vec![0f32; n_q * dim]);
                    if !attend_int_with(backend, &k, &v, &q, n_q, Online { m: &mut m, l: &mut l, o: &mut o })
                        .unwrap()
                    {
                        continue;
                    }
                    // Every score 0: every weight 1, every value 1 + 0.5 · code.
                    let want = rows as f32 * (1.0 + 0.5 * f32::from(code & 0x0f));
                    assert!(l.iter().all(|&x| x == rows as f32), "{backend} {dim} {rows}: l {l:?}");
                    for (c, &x) in o.iter().enumerate() {
                        assert!(
                            (x - want).abs() <= 1e-4 * want,
                            "{backend} dim {dim} rows {rows} code {code} o[{c}]: {x} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// What the fused kernel does not take leaves the state as it was (`Ok(false)`): a negative
/// value scale, keys per group of 16, values per channel, 32 channels. A NaN in a query row
/// makes that row's sum and outputs NaN (with a running state), and only that row's.
#[test]
fn fused_block_attention_declines_and_propagates_nan() {
    use kvq_kernels_simd::{Online, attend_int_with};
    let mut rng = Rng::new(77);
    for backend in available() {
        let kc = affine_case(&mut rng, 32, 128, true, 0);
        let vc = affine_case(&mut rng, 32, 128, false, 0);
        let k16 = affine_case(&mut rng, 32, 128, false, 0).grouped(16);
        let (k32, v32) = (affine_case(&mut rng, 32, 32, true, 0), affine_case(&mut rng, 32, 32, false, 0));
        let run = |k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize, q: &[f32]| {
            let (mut m, mut l, mut o) = (vec![0.5f32; n_q], vec![1.0f32; n_q], vec![0.25f32; n_q * k.dim()]);
            let ran =
                attend_int_with(backend, k, v, q, n_q, Online { m: &mut m, l: &mut l, o: &mut o }).unwrap();
            (ran, m, l, o)
        };
        let q: Vec<f32> = (0..5 * 128).map(|_| rng.normal() as f32).collect();
        let unchanged = |(ran, m, l, o): (bool, Vec<f32>, Vec<f32>, Vec<f32>)| {
            assert!(
                !ran && m.iter().all(|&x| x == 0.5)
                    && l.iter().all(|&x| x == 1.0)
                    && o.iter().all(|&x| x == 0.25)
            );
        };
        unchanged(run(&kc.block(), &kc.block(), 2, &q[..256]));
        unchanged(run(&k16.block(), &vc.block(), 2, &q[..256]));
        unchanged(run(&k32.block(), &v32.block(), 2, &q[..64]));
        // Values per group of 16 (not a multiple of 32), and per group at head_dim 32.
        unchanged(run(&kc.block(), &vc.clone().grouped(16).block(), 2, &q[..256]));
        unchanged(run(&k32.block(), &v32.clone().grouped(32).block(), 2, &q[..64]));
        // Values per row, then per group of 32.
        for vc in [vc.clone(), vc.clone().grouped(32)] {
            let mut vc = vc;
            let (ran, ..) = run(&kc.block(), &vc.block(), 2, &q[..256]);
            if ran {
                let mut nan = q[..256].to_vec();
                nan[128 + 9] = f32::NAN;
                // Keys with offsets (their sum `Σ q · offset` is NaN too) and without (only the
                // query's rounding sees it).
                let mut plain = kc.clone();
                plain.with_offset = false;
                for keys in [&kc, &plain] {
                    let (_, _, l, o) = run(&keys.block(), &vc.block(), 2, &nan);
                    assert!(l[0].is_finite() && l[1].is_nan(), "{backend}: {l:?}");
                    assert!(
                        o[..128].iter().all(|x| x.is_finite()) && o[128..].iter().all(|x| x.is_nan()),
                        "{backend}"
                    );
                }
                let last = vc.scale.len() - 1;
                vc.scale[last] = -vc.scale[last];
                unchanged(run(&kc.block(), &vc.block(), 2, &q[..256]));
            }
        }
        // Shapes that do not fit are errors.
        let (mut m, mut l, mut o) = (vec![0f32; 2], vec![0f32; 2], vec![0f32; 200]);
        assert!(
            attend_int_with(
                backend,
                &kc.block(),
                &vc.block(),
                &q[..256],
                2,
                Online { m: &mut m, l: &mut l, o: &mut o }
            )
            .is_err()
        );
        assert!(
            attend_int_with(
                backend,
                &kc.block(),
                &v32.block(),
                &q[..256],
                2,
                Online { m: &mut m, l: &mut l, o: &mut o }
            )
            .is_err()
        );
    }
}

/// A block of FP8 codes of format `f` with one scale per row (offsets drawn half the time),
/// every code finite unless the test puts a special one in.
fn fp8_case(rng: &mut Rng, rows: usize, dim: usize, f: Fp8Format, special: u8) -> Case {
    let mut case = Case::random(rng, rows, dim, 8, special);
    let finite: Vec<u8> =
        case.raw.iter().map(|&c| if f.decode(c).is_finite() { c } else { c & 0xf0 }).collect();
    if case.per_channel {
        case.per_channel = false;
        case.scale = (0..rows)
            .map(|r| if special == 5 && r % 2 == 0 { 0.0 } else { rng.uniform() as f32 + 0.01 })
            .collect();
        case.offset = (0..rows).map(|_| rng.normal() as f32).collect();
    }
    (case.levels_kind, case.fp8, case.with_offset) = (3, Some(f), rng.below(2) == 0);
    (case.raw, case.codes) = (finite.clone(), finite);
    case
}

/// The fused FP8 kernel (one block of FP8 keys and values per row: scores, online softmax
/// step, value sums in one call) against its reference, the float kernels one after the
/// other in f64 (`scalar::attend_float`): the running maxima to the rounding of the scores,
/// the sums and outputs to that of `exp` and of float sums in other orders. Rows of 1 to 256
/// (tails of a quad of rows), head_dims of 32 to 256 (an odd number of 32-channel runs
/// included), one to eight query rows, fresh and running states, tiny scales, zero scales,
/// widely spread scores. Where the kernel does not run it says so and changes nothing.
#[test]
fn fused_fp8_attention_matches_its_reference() {
    use kvq_kernels_simd::{Online, attend_float_fused, attend_float_with};
    let mut rng = Rng::new(0xf8a7);
    let mut ran_at = std::collections::BTreeSet::new();
    for backend in available() {
        for (dim, rows) in
            [(128usize, 32usize), (128, 1), (128, 6), (64, 33), (32, 7), (96, 16), (256, 256), (192, 130)]
        {
            for (kf, vf) in [
                (Fp8Format::E4M3, Fp8Format::E4M3),
                (Fp8Format::E5M2, Fp8Format::E5M2),
                (Fp8Format::E4M3, Fp8Format::E5M2),
            ] {
                for special in [0u8, 3, 5, 6] {
                    let kc = fp8_case(&mut rng, rows, dim, kf, if special == 5 { 0 } else { special });
                    let vc = fp8_case(&mut rng, rows, dim, vf, special);
                    let (k, v) = (kc.block(), vc.block());
                    let mut x = vec![0f32; rows * dim];
                    scalar::dequantize(&v, &mut x);
                    for n_q in [1usize, 2, 3, 4, 5, 8] {
                        let spread = if special == 6 { 40.0 } else { 1.0 };
                        let q: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32 * spread).collect();
                        for running in [false, true] {
                            let (m0, l0, o0): (Vec<f32>, Vec<f32>, Vec<f32>) = if running {
                                (
                                    (0..n_q).map(|_| rng.normal() as f32 * 3.0).collect(),
                                    (0..n_q).map(|_| rng.uniform() as f32 * 5.0 + 0.5).collect(),
                                    (0..n_q * dim).map(|_| rng.normal() as f32).collect(),
                                )
                            } else {
                                (vec![f32::NEG_INFINITY; n_q], vec![0.0; n_q], vec![0.0; n_q * dim])
                            };
                            let (mut m, mut l, mut o) = (m0.clone(), l0.clone(), o0.clone());
                            let state = Online { m: &mut m, l: &mut l, o: &mut o };
                            let what = format!(
                                "{backend} {kf:?}/{vf:?} {rows}x{dim} special {special} n_q {n_q} running {running}"
                            );
                            let ran = attend_float_with(backend, &k, &v, &q, n_q, state).unwrap();
                            assert_eq!(ran, attend_float_fused(backend, &k, &v, n_q), "{what}");
                            if !ran {
                                assert!(
                                    m == m0 && l == l0 && o == o0,
                                    "{what}: declined, yet changed the state"
                                );
                                continue;
                            }
                            ran_at.insert((backend.backend(), dim));
                            let (mut wm, mut wl, mut wo) = (m0.clone(), l0.clone(), o0.clone());
                            assert!(scalar::attend_float(
                                &k,
                                &v,
                                &q,
                                n_q,
                                Online { m: &mut wm, l: &mut wl, o: &mut wo }
                            ));
                            let mags = magnitudes_scores(&kc, &k, &q, n_q);
                            let mut s = vec![0f32; n_q * rows];
                            scalar::scores(&k, &q, n_q, &mut s);
                            for i in 0..n_q {
                                let dm = 2e-6
                                    * mags[i * rows..(i + 1) * rows].iter().fold(0f64, |a, &b| a.max(b))
                                    + 1e-30;
                                assert!(
                                    f64::from((m[i] - wm[i]).abs()) <= dm,
                                    "{what}: m[{i}] {} vs {}",
                                    m[i],
                                    wm[i]
                                );
                                let rel = 1e-5 + 2.0 * dm;
                                assert!(
                                    f64::from((l[i] - wl[i]).abs()) <= rel * f64::from(wl[i].abs()) + 1e-30,
                                    "{what}: l[{i}] {} vs {}",
                                    l[i],
                                    wl[i]
                                );
                                let f = f64::from((m0[i] - wm[i]).exp());
                                let p: Vec<f64> = (0..rows)
                                    .map(|r| (f64::from(s[i * rows + r]) - f64::from(wm[i])).exp())
                                    .collect();
                                for c in 0..dim {
                                    let j = i * dim + c;
                                    let off = |r: usize| {
                                        if vc.with_offset { f64::from(vc.offset[r].abs()) } else { 0.0 }
                                    };
                                    let mag = f64::from(o0[j].abs()) * f
                                        + (0..rows)
                                            .map(|r| p[r] * (f64::from(x[r * dim + c].abs()) + 2.0 * off(r)))
                                            .sum::<f64>();
                                    let tol = rel * mag + 1e-30;
                                    assert!(
                                        f64::from((o[j] - wo[j]).abs()) <= tol,
                                        "{what}: o[{j}] {} vs {} (tolerance {tol})",
                                        o[j],
                                        wo[j]
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    if Backend::Avx512.is_available() {
        for dim in [32usize, 64, 96, 128, 192, 256] {
            assert!(ran_at.contains(&(Backend::Avx512, dim)), "the AVX-512 kernel ran at head_dim {dim}");
        }
    }
    assert!(ran_at.iter().all(|&(b, _)| b == Backend::Avx512), "only the AVX-512 backend has the kernel");
}

/// An e4m3 NaN code in a key row makes every query row's sum and outputs NaN (the score is
/// skipped by the maximum, not by the exponentials), and one in a value row makes that
/// channel's outputs NaN and nothing else, in the fused FP8 kernel as in its reference; blocks
/// of other shapes are errors.
#[test]
fn fused_fp8_attention_propagates_nan_codes_and_checks_shapes() {
    use kvq_kernels_simd::{Online, attend_float_with};
    let mut rng = Rng::new(0xf8ab);
    let (rows, dim, n_q) = (5usize, 64usize, 4usize);
    let q: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
    for backend in available() {
        for (part, at) in [(0usize, 0usize), (0, 4 * dim + 63), (1, 2 * dim + 17), (1, 31)] {
            let (mut kc, mut vc) = (
                fp8_case(&mut rng, rows, dim, Fp8Format::E4M3, 0),
                fp8_case(&mut rng, rows, dim, Fp8Format::E4M3, 0),
            );
            let c = if part == 0 { &mut kc } else { &mut vc };
            c.codes[at] = if at % 2 == 0 { 0x7f } else { 0xff };
            let (k, v) = (kc.block(), vc.block());
            let run = |f: &dyn Fn(Online<'_>) -> bool| {
                let (mut m, mut l, mut o) =
                    (vec![f32::NEG_INFINITY; n_q], vec![0f32; n_q], vec![0f32; n_q * dim]);
                let ran = f(Online { m: &mut m, l: &mut l, o: &mut o });
                (ran, m, l, o)
            };
            let (ran, m, l, o) = run(&|s| attend_float_with(backend, &k, &v, &q, n_q, s).unwrap());
            if !ran {
                continue;
            }
            let (_, wm, wl, wo) = run(&|s| scalar::attend_float(&k, &v, &q, n_q, s));
            for (i, (&x, &y)) in m.iter().zip(&wm).enumerate() {
                // The NaN score is skipped: the maximum is the other rows'.
                assert!(
                    !x.is_nan() && (x - y).abs() <= 1e-4 * y.abs(),
                    "{backend} part {part} code {at}: m[{i}] {x} vs {y}"
                );
            }
            for (i, (&x, &y)) in l.iter().zip(&wl).enumerate() {
                assert_eq!(x.is_nan(), y.is_nan(), "{backend} part {part} code {at}: l[{i}] {x} vs {y}");
                assert_eq!(x.is_nan(), part == 0, "{backend} part {part} code {at}: l[{i}] {x}");
            }
            for (j, (&x, &y)) in o.iter().zip(&wo).enumerate() {
                assert_eq!(x.is_nan(), y.is_nan(), "{backend} part {part} code {at}: o[{j}] {x} vs {y}");
                assert_eq!(
                    x.is_nan(),
                    part == 0 || j % dim == at % dim,
                    "{backend} part {part} code {at}: o[{j}] {x}"
                );
            }
        }
        let (kc, vc) = (
            fp8_case(&mut rng, rows, dim, Fp8Format::E4M3, 0),
            fp8_case(&mut rng, rows + 1, dim, Fp8Format::E4M3, 0),
        );
        let (mut m, mut l, mut o) = (vec![0f32; n_q], vec![0f32; n_q], vec![0f32; n_q * dim]);
        let bad = attend_float_with(
            backend,
            &kc.block(),
            &vc.block(),
            &q,
            n_q,
            Online { m: &mut m, l: &mut l, o: &mut o },
        );
        assert!(bad.is_err(), "{backend}: keys of 5 rows against values of 6");
        let short = attend_float_with(
            backend,
            &kc.block(),
            &kc.block(),
            &q[1..],
            n_q,
            Online { m: &mut m, l: &mut l, o: &mut o },
        );
        assert!(short.is_err(), "{backend}: a short query");
    }
}

/// Integer scores of blocks of 1 MiB of codes and more, the size from which the kernels
/// stream a block from memory (on Intel CPUs they then ask for each chunk's codes and row
/// parameters ahead of use): every backend equals the integer reference bit for bit, for
/// INT4 per row, per channel and per group of 32, 16-level tables and INT8 per row.
#[test]
fn integer_scores_of_blocks_streamed_from_memory_equal_the_reference() {
    use kvq_kernels_simd::scores_int8_with;
    let mut rng = Rng::new(0x5eed);
    let mut ran = 0;
    for (bits, group, levels, rows) in
        [(4u8, None, 0u8, 16_400usize), (4, Some(32), 0, 16_390), (4, None, 2, 16_385), (8, None, 0, 8_200)]
    {
        for per_channel in [false, true] {
            if per_channel && group.is_some() {
                continue;
            }
            let mut case = Case::random(&mut rng, rows, 128, bits, 0);
            (case.levels_kind, case.per_channel, case.with_offset) = (levels, per_channel, true);
            let n = if per_channel { 128 } else { rows };
            case.scale = (0..n).map(|_| rng.uniform() as f32 + 0.01).collect();
            case.offset = (0..n).map(|_| rng.normal() as f32).collect();
            if let Some(g) = group {
                case = case.grouped(g);
            }
            let b = case.block();
            assert!(case.codes.len() >= 1 << 20, "a block of 1 MiB of codes at least");
            for backend in available() {
                for n_q in [1usize, 4] {
                    let q: Vec<f32> = (0..n_q * 128).map(|_| rng.normal() as f32).collect();
                    let (mut got, mut want) = (vec![0f32; n_q * rows], vec![0f32; n_q * rows]);
                    if !scores_int8_with(backend, &b, &q, n_q, &mut got).unwrap() {
                        continue;
                    }
                    ran += 1;
                    assert!(scalar::scores_int8(&b, &q, n_q, &mut want));
                    let what = format!(
                        "{backend} {bits} bits group {group:?} levels {levels} per channel {per_channel}"
                    );
                    for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "{what} [{j}]: {g} vs {w}");
                    }
                }
            }
        }
    }
    if available().iter().any(|b| matches!(b.backend(), Backend::Avx2 | Backend::Avx512 | Backend::Dotprod)) {
        assert!(ran > 0, "no integer kernel ran");
    }
}

/// FP8 blocks longer than the AVX-512 kernels' chunk of rows (256), as a block streamed from
/// memory is: scores and value sums against the reference on every backend, and an e4m3 NaN
/// code in one chunk reaching its row's score and its channel's values only (each chunk is
/// scanned for it on its own).
#[test]
fn long_fp8_blocks_match_the_reference_chunk_by_chunk() {
    let mut rng = Rng::new(0xf8c4);
    for (rows, dim) in [(600usize, 64usize), (257, 128), (513, 96)] {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let mut case = fp8_case(&mut rng, rows, dim, f, 0);
            let nan = (f == Fp8Format::E4M3).then_some((300usize.min(rows - 1), dim / 2));
            if let Some((r, c)) = nan {
                case.codes[r * dim + c] = 0xff;
            }
            let b = case.block();
            for backend in available() {
                let what = format!("{backend} {f:?} {rows}x{dim}");
                for n_q in [1usize, 4, 5] {
                    let q: Vec<f32> = (0..n_q * dim).map(|_| rng.normal() as f32).collect();
                    let (mut got, mut want) = (vec![0f32; n_q * rows], vec![0f32; n_q * rows]);
                    scores_with(backend, &b, &q, n_q, &mut got).unwrap();
                    scalar::scores(&b, &q, n_q, &mut want);
                    let mags = magnitudes_scores(&case, &b, &q, n_q);
                    for (j, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        let nan_row = nan.is_some_and(|(r, _)| j % rows == r);
                        assert_eq!(g.is_nan(), nan_row, "{what}: score {j} {g}");
                        if !nan_row {
                            let tol = 1e-5 * mags[j] + 1e-30;
                            assert!(f64::from((g - w).abs()) <= tol, "{what}: score {j} {g} vs {w}");
                        }
                    }
                    let p: Vec<f32> = (0..n_q * rows).map(|_| rng.uniform() as f32 / rows as f32).collect();
                    let (mut got, mut want) = (vec![0.5f32; n_q * dim], vec![0.5f32; n_q * dim]);
                    axpy_with(backend, &b, &p, n_q, &mut got).unwrap();
                    scalar::axpy(&b, &p, n_q, &mut want);
                    let mut x = vec![0f32; rows * dim];
                    scalar::dequantize(&b, &mut x);
                    for (j, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        let nan_channel = nan.is_some_and(|(_, c)| j % dim == c);
                        assert_eq!(g.is_nan(), nan_channel, "{what}: value {j} {g}");
                        if !nan_channel {
                            let (i, c) = (j / dim, j % dim);
                            let off = |r: usize| if case.with_offset { case.offset[r].abs() } else { 0.0 };
                            let mag: f64 = 0.5
                                + (0..rows)
                                    .map(|r| {
                                        f64::from(p[i * rows + r] * (x[r * dim + c].abs() + 2.0 * off(r)))
                                    })
                                    .sum::<f64>();
                            assert!(f64::from((g - w).abs()) <= 1e-5 * mag, "{what}: value {j} {g} vs {w}");
                        }
                    }
                }
            }
        }
    }
}
