//! Integer scores of keys stored in channel regions of their own widths (`-qa` specs) on
//! aarch64 CPUs with the dot-product extension, for the fused `dotprod` kernel
//! ([`crate::fused_dotprod`]) and [`crate::scores_int8_regions_with`]: the algebra of the AVX2
//! region scores (`regions_avx2`). Each region's columns of the query rows are rounded to int8
//! with a scale of their own by the `int8` module's rounding (so the bytes of the reference);
//! each key row is unpacked to a code a byte, sixteen channels a vector, by a [`Plan`] made
//! once per layout: per plane, a 16-byte window of the row, `tbl` moving each code's byte in
//! place, `ushl` by a per-byte count moving its field to the plane's bit (a right shift where
//! the count is negative), a mask; the planes or-ed; regions padded to 16 bytes. Then per
//! region and pair of rows `sdot` dots with the query's bytes (8-bit codes as `code − 128`,
//! `128 · Σ q` added back) and the reference's epilogue in its order, so the scores equal
//! [`crate::scalar::scores_int8_regions`] bit for bit.

use std::arch::aarch64::*;

use crate::KeyRegion;
use crate::block::QuantBlock;
use crate::dotprod::{Sdot, sdot};
use crate::regions::{self, MAX_REGIONS};

/// Whether [`Kernel`] takes these regions of `rows` rows tiling a row of `dim` channels
/// ([`regions::supported`]) on this CPU (the dot-product extension).
pub(crate) fn supported(regions: &[KeyRegion<'_>], rows: usize, dim: usize) -> bool {
    regions::supported(regions, rows, dim, crate::dotprod::cpu_ok())
}

/// One plane's bits of 16 codes: the start of their 16-byte window in the region's row, the
/// `tbl` indices of each code's byte in it, the signed `ushl` count `base − bit` of each, and
/// the mask of the plane's field at its bit in the code (zero past the region).
#[derive(Clone)]
pub(crate) struct Step {
    at: usize,
    idx: [u8; 16],
    shift: [i8; 16],
    mask: [u8; 16],
}

/// How to unpack rows of key regions on NEON: vectors of 16 bytes, a [`Step`] per plane.
type Plan = regions::Plan<Step>;

/// The plan of a layout of key regions: per plane and 16 codes, the window of their chunk
/// (or last, shorter chunk), moved back to end inside the row where the row allows.
fn plan(shapes: &[(usize, u8)]) -> Plan {
    regions::Plan::new(shapes, 16, |(c, w, pbase, base, o, rb)| {
        let m = ((1u32 << w) - 1) as u8;
        let locs: Vec<(usize, usize, usize)> = (0..16)
            .filter(|k| o + k < c)
            .map(|k| {
                let (byte, bit) = regions::plane_loc(c, w, o + k);
                (k, pbase + byte, bit)
            })
            .collect();
        let lo = locs.iter().map(|l| l.1).min().unwrap_or(pbase);
        let hi = locs.iter().map(|l| l.1).max().unwrap_or(pbase);
        let mut at = pbase + (lo - pbase) / 16 * 16;
        if at + 16 > rb && rb >= 16 {
            at = rb - 16;
        }
        debug_assert!(lo >= at && hi < at + 16, "sixteen codes of a plane span at most 16 bytes");
        let mut step = Step { at, idx: [0; 16], shift: [0; 16], mask: [0; 16] };
        for (k, byte, bit) in locs {
            step.idx[k] = (byte - at) as u8;
            step.shift[k] = base as i8 - bit as i8;
            step.mask[k] = m << base;
        }
        (step, at + 16)
    })
}

/// Unpacks blocks of key regions on NEON.
pub(crate) type Unpacker = regions::Unpacker<Step>;

/// Every row of `regions` unpacked to a code a byte ([`regions::Unpacker::unpack`]), 16-byte
/// vectors.
///
/// # Panics
/// As [`regions::Unpacker::unpack`].
pub(crate) fn unpack<'u>(u: &'u mut Unpacker, regions: &[KeyRegion<'_>]) -> (&'u [u8], usize, &'u [usize]) {
    u.unpack(regions, plan, |plan, bases, strides, count, dst| {
        // SAFETY: NEON is part of every aarch64 CPU; each of the `count` rows has `reach`
        // bytes readable from its start and `dst` holds `count` rows of width
        // (`region_rows`).
        unsafe { unpack_rows(plan, bases, strides, count, dst) }
    })
}

/// Rows `0..count` of the regions (row `r` of region `j` at `bases[j] + r · strides[j]`)
/// unpacked into rows `0..count` of `dst` (rows of the plan's width), one vector and plane at
/// a time down the rows.
///
/// # Safety
/// Each of the `count` rows of each region has the plan's `reach` bytes readable from its
/// start; `dst` holds `count` rows of the plan's width.
#[target_feature(enable = "neon")]
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
            // SAFETY: the step's vectors are 16 bytes.
            let (idx, shift, mask) = unsafe {
                (vld1q_u8(st.idx.as_ptr()), vld1q_s8(st.shift.as_ptr()), vld1q_u8(st.mask.as_ptr()))
            };
            for r in 0..count {
                // SAFETY: row r < count of the region: its window within `reach` of the row's
                // start; vector `o.at` of row r of `dst`.
                unsafe {
                    let x = vqtbl1q_u8(vld1q_u8(base.add(r * stride + st.at)), idx);
                    let mut v = vandq_u8(vshlq_u8(x, shift), mask);
                    let d = dst.add(r * width + o.at);
                    if p > 0 {
                        v = vorrq_u8(v, vld1q_u8(d));
                    }
                    vst1q_u8(d, v);
                }
            }
        }
    }
}

/// The NEON (dot-product) region scores kernel, for [`regions::scores_in`].
pub(crate) struct Kernel;

impl regions::RegionKernel for Kernel {
    type Step = Step;
    type Int = Sdot;

    fn supported(regions: &[KeyRegion<'_>], rows: usize, dim: usize) -> bool {
        supported(regions, rows, dim)
    }

    unsafe fn unpack<'u>(u: &'u mut Unpacker, regions: &[KeyRegion<'_>]) -> (&'u [u8], usize, &'u [usize]) {
        unpack(u, regions)
    }

    regions::scores_group_for!(Kernel, "neon,dotprod");

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
        // SAFETY: the dot-product extension and the bounds, the caller's contract (16-byte
        // vectors: the plan pads regions to 16 bytes); each array holds 4 values.
        unsafe {
            let e = Epilogue {
                sq: vld1q_f32(sq.as_ptr()),
                add: vld1q_f32(add.as_ptr()),
                corr: vld1q_s32(corr.as_ptr()),
            };
            let vecs = keys.dim.div_ceil(16);
            if keys.bits == 8 {
                region_dots::<NQ, true>(u, q, width, vecs, pairs, &e, sums);
            } else {
                region_dots::<NQ, false>(u, q, width, vecs, pairs, &e, sums);
            }
        }
    }
}

/// One region's epilogue for four query rows: their scales, what the offsets add, and for
/// 8-bit codes `128 · Σ q`.
struct Epilogue {
    sq: float32x4_t,
    add: float32x4_t,
    corr: int32x4_t,
}

/// The dots of one region's `vecs` vectors of every pair of rows of `u` (rows of `width`
/// bytes, from the region's first) with `NQ` query rows of `q`, and `sums[8 · pair + 4 · h
/// ..] += sq · dot + add` for row `h` of the pair (a multiply, then an add). `WIDE`: 8-bit
/// codes, taken as `code − 128` with `128 · Σ q` added back.
///
/// # Safety
/// The CPU must support the dot-product extension; `u` holds `2 · pairs` rows and `q` `NQ`
/// rows of `width`, each with `16 · vecs` bytes from the pointer; `sums` `8 · pairs` floats.
#[target_feature(enable = "neon,dotprod")]
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
    let flip = vdupq_n_u8(0x80);
    for pair in 0..pairs {
        let mut acc = [[vdupq_n_s32(0); 4]; 2];
        for v in 0..vecs {
            // SAFETY: rows 2 · pair and 2 · pair + 1 of `u`, vector v of the region; the same
            // vector of each query row.
            unsafe {
                let (mut c0, mut c1) = (
                    vld1q_u8(u.add(2 * pair * width + 16 * v)),
                    vld1q_u8(u.add((2 * pair + 1) * width + 16 * v)),
                );
                if WIDE {
                    (c0, c1) = (veorq_u8(c0, flip), veorq_u8(c1, flip));
                }
                let c = [vreinterpretq_s8_u8(c0), vreinterpretq_s8_u8(c1)];
                let [r0, r1] = &mut acc;
                for (i, (s0, s1)) in r0.iter_mut().zip(r1.iter_mut()).enumerate().take(NQ) {
                    let qv = vld1q_s8(q.add(i * width + 16 * v));
                    *s0 = sdot(*s0, c[0], qv);
                    *s1 = sdot(*s1, c[1], qv);
                }
            }
        }
        for (h, a) in acc.iter().enumerate() {
            // Each query row's dot: two rounds of pairwise sums.
            let dots = vpaddq_s32(vpaddq_s32(a[0], a[1]), vpaddq_s32(a[2], a[3]));
            let dots = if WIDE { vaddq_s32(dots, e.corr) } else { dots };
            let part = vaddq_f32(vmulq_f32(e.sq, vcvtq_f32_s32(dots)), e.add);
            // SAFETY: pair < pairs: 4 floats at 8 · pair + 4h inside `sums`.
            unsafe {
                let at = sums.as_mut_ptr().add(8 * pair + 4 * h);
                vst1q_f32(at, vaddq_f32(vld1q_f32(at), part));
            }
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use crate::region_tests::{check_guarded_scores, check_unpacking};

    /// Rows of every width and multiple of 8 codes come back as quant-core packed them,
    /// padded to 16.
    #[test]
    fn unpacked_rows_are_the_packed_codes() {
        let mut u = super::Unpacker::default();
        check_unpacking(16, |regions| {
            let (got, width, _) = super::unpack(&mut u, regions);
            (got.to_vec(), width)
        });
    }

    /// The last rows' windows come from a copy where they could run past the codes; the
    /// scores are the reference's, bit for bit.
    #[test]
    fn region_windows_stay_inside_the_codes() {
        if !crate::dotprod::cpu_ok() {
            return;
        }
        let mut w = crate::regions::Scratch::default();
        check_guarded_scores(|regions, q, out| {
            crate::regions::scores_in::<super::Kernel>(regions, q, 4, out, &mut w)
        });
    }
}
