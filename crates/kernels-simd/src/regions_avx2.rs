//! Integer scores of keys stored in channel regions of their own widths (`-qa` specs) on
//! CPUs with AVX2 and FMA, for the fused AVX2 kernel ([`crate::fused_avx2`]) and
//! [`crate::scores_int8_regions_with`]. Each region's columns of the query rows are rounded to
//! int8 with a scale of their own, as [`crate::scalar::scores_int8_regions`] rounds them;
//! each key row is unpacked to one code per 16-bit word, sixteen channels at a time, by a
//! [`Plan`] made once per layout: per plane of the channels' regions, one 16-byte window of
//! the row (`vbroadcasti128`, or two loads for two windows), a `vpshufb` placing each code's
//! byte in the high byte of its word, a `vpmulhuw` by `2^(8 − bit + base)` shifting the code's
//! field to its place in the code, and a mask; the planes or-ed. The words meet the query's
//! (`vpmaddwd`, exact for codes up to 255), and each 2-channel lane is converted and scaled by
//! the query's scale of its region in floats, so a row takes one reduction whatever its
//! regions. The scores equal the reference's to the rounding of float sums taken in another
//! order.

use std::arch::x86_64::*;

use crate::block::QuantBlock;
use crate::{KeyRegion, avx2};

use crate::regions::{self, MAX_REGIONS};

/// Whether [`Kernel`] takes these regions of `rows` rows tiling a row of `dim` channels
/// ([`regions::supported`]) on this CPU (AVX2, FMA and F16C).
pub(crate) fn supported(regions: &[KeyRegion<'_>], rows: usize, dim: usize) -> bool {
    regions::supported(regions, rows, dim, avx2::cpu_ok())
}

/// How one plane of a region gives its bits of 32 codes: `Lanes`, where the codes come from
/// one run of `len` bytes (4, 8 or 16, broadcast to every lane of that size; 32: loaded as
/// they are) whose lanes each hold whole fields: each lane shifted right by its count
/// (`vpsrlvd`/`vpsrlvq`: the field's bit), masked (the field's width, zero past the region);
/// `Words`, for the other layouts: two vectors of 16-bit words (codes `0..8` and `16..24`,
/// `8..16` and `24..32`: so that `vpackuswb` puts them in order), each half from a 16-byte
/// window (`at`), a `vpshufb` putting each code's byte in the high byte of its word, a
/// `vpmulhuw` by `2^(8 − bit + base)` moving its field to bit `base`, and a mask.
#[derive(Clone)]
pub(crate) enum Source {
    Lanes { len: usize, at: usize, counts: [i32; 8], mask: [u8; 32] },
    Words { at: [usize; 4], idx: [[i8; 32]; 2], mult: [[u16; 16]; 2], keep: [[u16; 16]; 2] },
}

/// One plane's part of an unpacked vector: its source and the plane's first bit in the code
/// (`Lanes` shift left by it; `Words` already did).
#[derive(Clone)]
pub(crate) struct Step {
    src: Source,
    base: i32,
}

/// How to unpack rows of key regions on AVX2: vectors of 32 bytes, [`Step`]s by [`source`].
type Plan = regions::Plan<Step>;

/// The plan of a layout of key regions.
fn plan(shapes: &[(usize, u8)]) -> Plan {
    regions::Plan::new(shapes, 32, |(c, w, pbase, base, o, rb)| {
        let src = source(c, w, pbase, base, o, rb);
        let reached = match &src {
            Source::Lanes { len, at, .. } => at + len,
            Source::Words { at, .. } => at.iter().max().unwrap_or(&0) + 16,
        };
        // `Words` put the field at its base already.
        let shift = if matches!(src, Source::Lanes { .. }) { base as i32 } else { 0 };
        (Step { src, base: shift }, reached)
    })
}

/// Unpacks blocks of key regions on AVX2.
pub(crate) type Unpacker = regions::Unpacker<Step>;

/// Every row of `regions` unpacked to a code a byte ([`regions::Unpacker::unpack`]), 32-byte
/// vectors.
///
/// # Safety
/// The CPU must support AVX2; [`regions::region_rows_ok`] for every region.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack<'u>(
    u: &'u mut Unpacker,
    regions: &[KeyRegion<'_>],
) -> (&'u [u8], usize, &'u [usize]) {
    u.unpack(regions, plan, |plan, bases, strides, count, dst| {
        // SAFETY: AVX2 (this function's contract); each of the `count` rows has `reach` bytes
        // readable from its start and `dst` holds `count` rows of width (`region_rows`).
        unsafe { unpack_rows(plan, bases, strides, count, dst) }
    })
}

/// The [`Source`] of codes `o .. o + 32` (fewer past `c`) of a plane of width `w` whose bytes
/// start at `pbase` in a region row of `rb` bytes and `c` channels, its field going to bit
/// `base` of the code.
fn source(c: usize, w: usize, pbase: usize, base: usize, o: usize, rb: usize) -> Source {
    let m = ((1u32 << w) - 1) as u8;
    let valid = |k: usize| o + k < c;
    if w == 8 {
        return Source::Lanes {
            len: 32,
            at: pbase + o,
            counts: [0; 8],
            mask: std::array::from_fn(|k| if valid(k) { 0xff } else { 0 }),
        };
    }
    let chunk = 128 / w;
    let whole = c / chunk * chunk;
    // Whole 16-byte chunks: the vector's 16-code halves are fields f and f + 1 of one chunk.
    if o < whole {
        let f = (o % chunk / 16 * w) as i32;
        return Source::Lanes {
            len: 16,
            at: pbase + o / chunk * 16,
            counts: [f, 0, f, 0, f + w as i32, 0, f + w as i32, 0],
            mask: [m; 32],
        };
    }
    // A last chunk of r codes in s bytes: runs of 4 or 8 bytes take a field a lane.
    let (r, t0) = (c - whole, o - whole);
    let s = r * w / 8;
    let fields = 8 / w;
    let at = pbase + whole / chunk * 16;
    if s == 4 || s == 8 {
        let lanes = 32 / s;
        let field = |l: usize| t0 / s + l;
        let mask = std::array::from_fn(|k| if field(k / s) < fields { m } else { 0 });
        let counts = if s == 4 {
            std::array::from_fn(|l| (field(l) * w) as i32 % 32)
        } else {
            std::array::from_fn(|k| if k % 2 == 0 { (field(k / 2) * w) as i32 % 64 } else { 0 })
        };
        debug_assert!(lanes * s == 32);
        return Source::Lanes { len: s, at, counts, mask };
    }
    // Anything else: 16-bit words, eight codes a half.
    let (mut at4, mut idx, mut mult, mut keep) =
        ([pbase; 4], [[-1i8; 32]; 2], [[0u16; 16]; 2], [[0u16; 16]; 2]);
    // Halves: (vector, half, first code of it).
    for (h, (vec, half, first)) in [(0, 0, 0), (0, 1, 16), (1, 0, 8), (1, 1, 24)].into_iter().enumerate() {
        let locs: Vec<(usize, usize, usize)> = (0..8)
            .filter(|k| valid(first + k))
            .map(|k| {
                let (byte, bit) = regions::plane_loc(c, w, o + first + k);
                (k, pbase + byte, bit)
            })
            .collect();
        let Some(lo) = locs.iter().map(|l| l.1).min() else { continue };
        let hi = locs.iter().map(|l| l.1).max().unwrap_or(lo);
        // The window: from the first byte of the 16 of the codes' chunk, moved back to end
        // inside the row where the row allows.
        let mut at = pbase + (lo - pbase) / 16 * 16;
        if at + 16 > rb && rb >= 16 {
            at = rb - 16;
        }
        if hi >= at + 16 {
            at = lo;
        }
        debug_assert!(hi < at + 16 && lo >= at, "eight codes of a plane span at most 16 bytes");
        at4[h] = at;
        for (k, byte, bit) in locs {
            idx[vec][16 * half + 2 * k + 1] = (byte - at) as i8;
            mult[vec][8 * half + k] = 1 << (8 + base - bit);
            keep[vec][8 * half + k] = u16::from(m) << base;
        }
    }
    Source::Words { at: at4, idx, mult, keep }
}

/// The AVX2 region scores kernel, for [`regions::scores_in`].
pub(crate) struct Kernel;

impl regions::RegionKernel for Kernel {
    type Step = Step;
    type Int = avx2::Avx2Int;

    fn supported(regions: &[KeyRegion<'_>], rows: usize, dim: usize) -> bool {
        supported(regions, rows, dim)
    }

    unsafe fn unpack<'u>(u: &'u mut Unpacker, regions: &[KeyRegion<'_>]) -> (&'u [u8], usize, &'u [usize]) {
        // SAFETY: `supported` (the caller's contract) checked AVX2 and the regions' rows.
        unsafe { unpack(u, regions) }
    }

    regions::scores_group_for!(Kernel, "avx2,fma,f16c");

    #[inline(always)]
    unsafe fn region_dots<const NQ: usize>(
        keys: &QuantBlock<'_>,
        u: *const u8,
        q: *const i8,
        width: usize,
        pairs: usize,
        (sq, add, corr): ([f32; 4], [f32; 4], [i32; 4]),
        sums: &mut [f32],
    ) {
        // SAFETY: AVX2 and the bounds, the caller's contract (32-byte vectors: the plan pads
        // regions to 32 bytes).
        unsafe {
            let twice = |x: [f32; 4]| _mm256_setr_ps(x[0], x[1], x[2], x[3], x[0], x[1], x[2], x[3]);
            let e = Epilogue {
                sq: twice(sq),
                add: twice(add),
                corr: _mm256_setr_epi32(
                    corr[0], corr[1], corr[2], corr[3], corr[0], corr[1], corr[2], corr[3],
                ),
            };
            let vecs = keys.dim.div_ceil(32);
            if keys.bits == 8 {
                region_dots::<NQ, true>(u, q, width, vecs, pairs, &e, sums);
            } else {
                region_dots::<NQ, false>(u, q, width, vecs, pairs, &e, sums);
            }
        }
    }
}

/// One region's epilogue, for two rows of four query rows (`[row 0: q0..q3 | row 1: q0..q3]`):
/// the query's scales, what the offsets add, and for 8-bit codes `128 · Σ q` (their dots are
/// taken on `code − 128`).
struct Epilogue {
    sq: __m256,
    add: __m256,
    corr: __m256i,
}

/// The dots of one region's `vecs` vectors of every pair of rows of `u` (rows of `width`
/// bytes, from the region's first) with `NQ` query rows of `q` (rows of `width`), and
/// `sums[8 · pair ..] += sq · dot + add` (a multiply, then an add: the reference's epilogue).
/// `WIDE`: 8-bit codes, taken as `code − 128` (`|x|` against the query's bytes with x's sign,
/// so `vpmaddubsw` cannot saturate) with `128 · Σ q` added back.
///
/// # Safety
/// The CPU must support AVX2; `u` holds `2 · pairs` rows and `q` `NQ` rows of `width`, each
/// with `32 · vecs` bytes from the pointer; `sums` `8 · pairs` floats.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn region_dots<const NQ: usize, const WIDE: bool>(
    u: *const u8,
    q: *const i8,
    width: usize,
    vecs: usize,
    pairs: usize,
    e: &Epilogue,
    sums: &mut [f32],
) {
    assert!(sums.len() >= 8 * pairs && NQ <= 4);
    let (ones, flip) = (_mm256_set1_epi16(1), _mm256_set1_epi8(-128));
    for pair in 0..pairs {
        let mut acc = [[_mm256_setzero_si256(); 4]; 2];
        for v in 0..vecs {
            // SAFETY: rows 2 · pair and 2 · pair + 1 of `u`, vector v of the region; the same
            // vector of each query row.
            unsafe {
                let c0 = _mm256_loadu_si256(u.add(2 * pair * width + 32 * v).cast());
                let c1 = _mm256_loadu_si256(u.add((2 * pair + 1) * width + 32 * v).cast());
                let (x0, x1) =
                    if WIDE { (_mm256_xor_si256(c0, flip), _mm256_xor_si256(c1, flip)) } else { (c0, c1) };
                let (a0, a1) = if WIDE { (_mm256_abs_epi8(x0), _mm256_abs_epi8(x1)) } else { (c0, c1) };
                let [r0, r1] = &mut acc;
                for (i, (s0, s1)) in r0.iter_mut().zip(r1.iter_mut()).enumerate().take(NQ) {
                    let qv = _mm256_loadu_si256(q.add(i * width + 32 * v).cast());
                    let (b0, b1) =
                        if WIDE { (_mm256_sign_epi8(qv, x0), _mm256_sign_epi8(qv, x1)) } else { (qv, qv) };
                    *s0 = _mm256_add_epi32(*s0, _mm256_madd_epi16(_mm256_maddubs_epi16(a0, b0), ones));
                    *s1 = _mm256_add_epi32(*s1, _mm256_madd_epi16(_mm256_maddubs_epi16(a1, b1), ones));
                }
            }
        }
        // Each row's four query dots: two rounds of pairwise sums leave them in both halves,
        // whose sum gives [row 0: q0..q3 | row 1: q0..q3].
        let h = |a: &[__m256i; 4]| {
            _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]))
        };
        let (h0, h1) = (h(&acc[0]), h(&acc[1]));
        let dots = _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(h0, h1),
            _mm256_permute2x128_si256::<0x31>(h0, h1),
        );
        let dots = if WIDE { _mm256_add_epi32(dots, e.corr) } else { dots };
        let part = _mm256_add_ps(_mm256_mul_ps(e.sq, _mm256_cvtepi32_ps(dots)), e.add);
        // SAFETY: pair < pairs: 8 floats inside `sums`.
        unsafe {
            let at = sums.as_mut_ptr().add(8 * pair);
            _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), part));
        }
    }
}

/// Rows `0..count` of the regions (row `r` of region `j` at `bases[j] + r · strides[j]`)
/// unpacked to a code a byte into rows `0..count` of `dst` (rows of the plan's width), one
/// vector and plane at a time down the rows, so that each plane's constants stay in registers.
///
/// # Safety
/// The CPU must support AVX2; each of the `count` rows of each region has the plan's `reach`
/// bytes readable from its start; `dst` holds `count` rows of the plan's width.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_rows(
    plan: &Plan,
    bases: &[*const u8; MAX_REGIONS],
    strides: &[usize; MAX_REGIONS],
    count: usize,
    dst: *mut u8,
) {
    let width = plan.width;
    for o in &plan.outs {
        let (base, stride) = (bases[o.region], strides[o.region]);
        for (p, st) in plan.steps[o.steps.clone()].iter().enumerate() {
            let shift = _mm256_set1_epi32(st.base);
            // Down the rows: `$x` the row's first byte, `$e` the plane's bits of the vector;
            // shifted to the plane's base, or-ed into the earlier planes' bits, stored.
            macro_rules! rows {
                ($x:ident => $e:expr) => {
                    for r in 0..count {
                        // SAFETY: row r < count of the region and of `dst`, the loads within
                        // `reach` of the row's start (this function's contract).
                        unsafe {
                            let $x = base.add(r * stride);
                            let mut v = $e;
                            if st.base > 0 {
                                v = _mm256_sllv_epi32(v, shift);
                            }
                            let d = dst.add(r * width + o.at);
                            if p > 0 {
                                v = _mm256_or_si256(v, _mm256_loadu_si256(d.cast()));
                            }
                            _mm256_storeu_si256(d.cast(), v);
                        }
                    }
                };
            }
            match &st.src {
                Source::Lanes { len, at, counts, mask } => {
                    // SAFETY: the plan's vectors are 32 bytes.
                    let (c, m) = unsafe {
                        (_mm256_loadu_si256(counts.as_ptr().cast()), _mm256_loadu_si256(mask.as_ptr().cast()))
                    };
                    match len {
                        4 => {
                            rows!(row => _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(row.add(*at).cast::<i32>().read_unaligned()), c), m))
                        }
                        8 => {
                            rows!(row => _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(row.add(*at).cast::<i64>().read_unaligned()), c), m))
                        }
                        16 => {
                            rows!(row => _mm256_and_si256(_mm256_srlv_epi64(avx2::load_pair(row.add(*at)), c), m))
                        }
                        _ => rows!(row => _mm256_and_si256(_mm256_loadu_si256(row.add(*at).cast()), m)),
                    }
                }
                Source::Words { at, idx, mult, keep } => {
                    // SAFETY: the plan's vectors are 32 bytes.
                    let (i0, i1, m0, m1, k0, k1) = unsafe {
                        let l = |x: *const u8| _mm256_loadu_si256(x.cast());
                        (
                            l(idx[0].as_ptr().cast()),
                            l(idx[1].as_ptr().cast()),
                            l(mult[0].as_ptr().cast()),
                            l(mult[1].as_ptr().cast()),
                            l(keep[0].as_ptr().cast()),
                            l(keep[1].as_ptr().cast()),
                        )
                    };
                    let word = |row: *const u8, a: usize, b: usize, i, m, k| {
                        // SAFETY: windows within `reach` of the row's start (see `rows!`).
                        let x = unsafe {
                            _mm256_inserti128_si256::<1>(
                                _mm256_castsi128_si256(_mm_loadu_si128(row.add(a).cast())),
                                _mm_loadu_si128(row.add(b).cast()),
                            )
                        };
                        _mm256_and_si256(_mm256_mulhi_epu16(_mm256_shuffle_epi8(x, i), m), k)
                    };
                    rows!(row => _mm256_packus_epi16(word(row, at[0], at[1], i0, m0, k0), word(row, at[2], at[3], i1, m1, k1)))
                }
            }
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use crate::region_tests::{check_guarded_scores, check_unpacking};

    /// Rows of every width and multiple of 8 codes come back as quant-core packed them, padded
    /// to 32; the regular layouts (whole 16-byte chunks, last chunks of 4 or 8 bytes, 8-bit
    /// rows) take lane shifts only.
    #[test]
    fn unpacked_rows_are_the_packed_codes() {
        if !super::avx2::cpu_ok() {
            return;
        }
        let mut u = super::Unpacker::default();
        check_unpacking(32, |regions| {
            // SAFETY: AVX2 (checked above); one region of whole rows.
            let (got, width, _) = unsafe { super::unpack(&mut u, regions) };
            (got.to_vec(), width)
        });
        for bits in 1..=8u8 {
            for c in (8..=256).step_by(8) {
                let plan = super::plan(&[(c, bits)]);
                let words =
                    plan.steps.iter().filter(|s| matches!(s.src, super::Source::Words { .. })).count();
                let regular = kvq_quant_core::pack::planes(bits).iter().all(|&w| {
                    let chunk = 128 / usize::from(w);
                    let s = c % chunk * usize::from(w) / 8;
                    w == 8 || matches!(s, 0 | 4 | 8)
                });
                assert_eq!(words == 0, regular, "{bits} bits, {c} codes: {words} word steps");
            }
        }
        // The benchmarks' layout (3, 4 and 5 bits over 32, 64 and 32 channels): lanes only.
        let plan = super::plan(&[(32, 3), (64, 4), (32, 5)]);
        assert!(plan.steps.iter().all(|s| matches!(s.src, super::Source::Lanes { .. })));
    }

    /// The last rows' windows come from a copy where they could run past the codes; the
    /// scores are the reference's, bit for bit.
    #[test]
    fn region_windows_stay_inside_the_codes() {
        if !super::avx2::cpu_ok() {
            return;
        }
        let mut w = crate::regions::Scratch::default();
        check_guarded_scores(|regions, q, out| {
            crate::regions::scores_in::<super::Kernel>(regions, q, 4, out, &mut w)
        });
    }
}
