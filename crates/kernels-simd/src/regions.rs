//! What the region kernels of AVX2 (`regions_avx2`) and of aarch64's `dotprod`
//! (`regions_neon`) share: which key regions and values they take, where a code of a bit
//! plane lies, the skeleton of a plan that unpacks a row of regions to a code a byte (its
//! per-architecture steps aside), and the unpacker that keeps the plans and reads the last
//! rows of a block through a copy.

use crate::KeyRegion;
use crate::block::{Levels, Params, QuantBlock};
use crate::int8::grown;

/// Whether a key region is what the SIMD region kernels unpack: affine codes of 1 to 8 bits
/// with per-channel parameters, a multiple of 8 channels (whole bytes of every plane a row),
/// rows of `dim · bits / 8` bytes, every row inside its codes.
pub(crate) fn region_codes_ok(r: &KeyRegion<'_>) -> bool {
    let k = &r.keys;
    region_rows_ok(k) && matches!(k.levels, Levels::Affine) && matches!(k.params, Params::PerChannel { .. })
}

/// Most regions the region unpackers take.
pub(crate) const MAX_REGIONS: usize = 16;

/// Where the rows of `regions` (at most [`MAX_REGIONS`], `n` rows each) are read from when
/// an unpacker's loads reach `reach[j]` bytes past the start of a row of region `j`: `rows`
/// is called once with every region's codes and row length for the rows whose loads lie
/// inside every region's codes (the first `count`, unpacked into `dst` row 0 on), and once
/// more, if any are left, with copies of the remaining rows, each followed by room for its
/// loads (`bounce`), for rows `count..n` (into `dst` row `count` on). `dst` is the first of
/// `n` rows of `width` bytes.
pub(crate) fn region_rows(
    regions: &[KeyRegion<'_>],
    reach: &[usize],
    width: usize,
    dst: *mut u8,
    bounce: &mut Vec<u8>,
    mut rows: impl FnMut(&[*const u8; MAX_REGIONS], &[usize; MAX_REGIONS], usize, *mut u8),
) {
    assert!(regions.len() <= MAX_REGIONS && reach.len() == regions.len(), "regions");
    let n = regions.first().map_or(0, |r| r.keys.rows);
    let safe = regions
        .iter()
        .zip(reach)
        .map(|(r, &reach)| {
            let (len, rb) = (r.keys.codes.len(), r.keys.row_bytes.max(1));
            if reach > len { 0 } else { (len - reach) / rb + 1 }
        })
        .min()
        .unwrap_or(0)
        .min(n);
    let mut bases = [std::ptr::null::<u8>(); MAX_REGIONS];
    let mut strides = [0usize; MAX_REGIONS];
    for (j, r) in regions.iter().enumerate() {
        (bases[j], strides[j]) = (r.keys.codes.as_ptr(), r.keys.row_bytes);
    }
    rows(&bases, &strides, safe, dst);
    if safe < n {
        for ((s, r), &reach) in strides.iter_mut().zip(regions).zip(reach) {
            *s = r.keys.row_bytes.max(reach);
        }
        let room: usize = strides.iter().map(|s| s * (n - safe)).sum();
        let bounce = crate::int8::grown(bounce, room);
        let mut at = 0;
        for (j, r) in regions.iter().enumerate() {
            let rb = r.keys.row_bytes;
            for row in safe..n {
                let to = at + (row - safe) * strides[j];
                bounce[to..to + rb].copy_from_slice(&r.keys.codes[row * rb..(row + 1) * rb]);
            }
            bases[j] = bounce[at..].as_ptr();
            at += strides[j] * (n - safe);
        }
        rows(&bases, &strides, n - safe, dst.wrapping_add(safe * width));
    }
}

/// Byte and bit of code `i` in a bit plane of width `w` holding `dim` codes, as
/// `kvq_quant_core::pack` lays a plane out: a plane narrower than 8 bits in chunks of `16 · 8 /
/// w` codes filling 16 bytes, byte `j` holding code `j + 16 f` in field `f` (bits `f · w ..`);
/// a last, shorter chunk of `r` codes in `s = ⌈r w / 8⌉` bytes, code `j` of it in byte `j mod
/// s`, field `j / s`; 8-bit planes a byte a code.
pub(crate) fn plane_loc(dim: usize, w: usize, i: usize) -> (usize, usize) {
    if w >= 8 {
        return (i, 0);
    }
    let per = 8 / w;
    let chunk = 16 * per;
    let whole = dim / chunk * chunk;
    if i < whole {
        let j = i % chunk;
        (i / chunk * 16 + j % 16, j / 16 * w)
    } else {
        let s = (dim - whole).div_ceil(per);
        let j = i - whole;
        (whole / chunk * 16 + j % s, j / s * w)
    }
}

/// Whether the rows of a block of codes are what an [`Unpacker`] takes: 1 to 8 bits, a
/// multiple of 8 codes (whole bytes of every plane a row), rows of `dim · bits / 8` bytes,
/// every row inside the codes (any parameters: the unpacking reads codes only).
pub(crate) fn region_rows_ok(b: &QuantBlock<'_>) -> bool {
    (1..=8).contains(&b.bits)
        && b.dim.is_multiple_of(8)
        && b.row_bytes == b.dim * usize::from(b.bits) / 8
        && b.rows.checked_mul(b.row_bytes).is_some_and(|n| n <= b.codes.len())
}

/// Whether the region scores take these regions of `rows` rows tiling a row of `dim`
/// channels: at least one row, each region as [`region_codes_ok`] takes it (so `dim` is a
/// multiple of 8), at most [`MAX_REGIONS`] of them, on a CPU with the kernel's features
/// (`cpu`).
pub(crate) fn supported(regions: &[KeyRegion<'_>], rows: usize, dim: usize, cpu: bool) -> bool {
    rows >= 1
        && regions.len() <= MAX_REGIONS
        && crate::regions_tile(regions, rows, dim)
        && regions.iter().all(region_codes_ok)
        && cpu
}

/// Values of 1 to 3 bits per code (`int3-token-mse-rot`, `int2-token`: the narrow values of
/// `kvq recommend`'s candidates), affine with per-row parameters, a head_dim of 64, 128 or
/// 256, whole rows: what the AVX2 and `dotprod` fused kernels unpack to a code a byte and
/// weigh with bytes, as the integer value path rounds weights for codes of up to 4 bits.
pub(crate) fn narrow_values(v: &QuantBlock<'_>) -> bool {
    (1..=3).contains(&v.bits)
        && matches!(v.levels, Levels::Affine)
        && matches!(v.params, Params::PerRow { .. })
        && matches!(v.dim, 64 | 128 | 256)
        && region_rows_ok(v)
}

/// The values the AVX2 and `dotprod` fused kernels take with key regions, for `n_q` query
/// rows: INT4 affine per row or per group of 32 to 256 values, or [`narrow_values`]; a
/// head_dim of 64, 128 or 256; 1 to [`crate::FUSED_ROWS`] rows; at least one query row.
pub(crate) fn fused_values(v: &QuantBlock<'_>, n_q: usize) -> bool {
    (v.bits == 4
        && matches!(v.levels, Levels::Affine)
        && (matches!(v.params, Params::PerRow { .. }) || crate::lane_groups(v))
        || narrow_values(v))
        && matches!(v.dim, 64 | 128 | 256)
        && (1..=crate::FUSED_ROWS).contains(&v.rows)
        && n_q >= 1
}

/// The keys of a fused call: token parts (one block, or per-channel blocks of consecutive
/// rows), or channel regions (`-qa` keys).
#[derive(Clone, Copy)]
pub(crate) enum Keys<'a> {
    Parts(&'a [QuantBlock<'a>]),
    Regions(&'a [KeyRegion<'a>]),
}

/// The keys of one query group of a fused call: token parts, or the group's scores (key
/// regions: scored for all query rows before the groups).
#[derive(Clone, Copy)]
pub(crate) enum GroupKeys<'a> {
    Parts(&'a [QuantBlock<'a>]),
    Scores(&'a [f32]),
}

/// The AVX2 and `dotprod` fused kernels' loop over query groups ([`crate::fused_groups`]):
/// `group(keys, nq, q, m, l, o)` for each, with key regions as that group's rows of
/// `scores` (every query row's scores of the block's rows, taken once before the groups).
pub(crate) fn by_query_group(
    keys: Keys<'_>,
    scores: &[f32],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: crate::Online<'_>,
    mut group: impl FnMut(GroupKeys<'_>, usize, &[f32], &mut [f32], &mut [f32], &mut [f32]),
) -> bool {
    let (n, mut i0) = (v.rows, 0);
    crate::fused_groups(v, q, n_q, state, |nq, q, m, l, o| {
        let keys = match keys {
            Keys::Parts(parts) => GroupKeys::Parts(parts),
            Keys::Regions(_) => GroupKeys::Scores(&scores[i0 * n..(i0 + nq) * n]),
        };
        i0 += nq;
        group(keys, nq, q, m, l, o)
    })
}

/// One vector of an unpacked row: region `region`'s codes from byte `at` of the row, made by
/// `steps` of its plan (its planes, or-ed).
#[derive(Clone)]
pub(crate) struct Out {
    pub(crate) region: usize,
    pub(crate) at: usize,
    pub(crate) steps: std::ops::Range<usize>,
}

/// How to unpack a row of keys in channel regions of these shapes (`(channels, bits)` each,
/// in order) to a code a byte, by steps `S` of an architecture: each region's codes from byte
/// `offset[j]` of a row of `width` bytes, padded with zero codes to a multiple of the
/// vector's bytes; `reach[j]` how many bytes of a row of region `j` the loads read.
#[derive(Clone)]
pub(crate) struct Plan<S> {
    shapes: Vec<(usize, u8)>,
    pub(crate) outs: Vec<Out>,
    pub(crate) steps: Vec<S>,
    pub(crate) offset: Vec<usize>,
    pub(crate) width: usize,
    pub(crate) reach: Vec<usize>,
}

/// Where a plane lies and goes: `(c, w, pbase, base, o, rb)`: the region's channels, the
/// plane's width, its first byte in the region's row and its first bit in the code, the
/// vector's first code, and the region's row bytes.
pub(crate) type PlaneAt = (usize, usize, usize, usize, usize, usize);

impl<S> Plan<S> {
    /// The plan of `shapes` with vectors of `vector` bytes, each plane's step of a vector by
    /// `step`, which returns it and how many bytes from the row's start its loads read.
    pub(crate) fn new(
        shapes: &[(usize, u8)],
        vector: usize,
        mut step: impl FnMut(PlaneAt) -> (S, usize),
    ) -> Self {
        let (mut outs, mut steps, mut offset, mut reach) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut width = 0;
        for (j, &(c, bits)) in shapes.iter().enumerate() {
            offset.push(width);
            let rb = c * usize::from(bits) / 8;
            let mut far = 16;
            for o in (0..c).step_by(vector) {
                let first = steps.len();
                let (mut pbase, mut base) = (0usize, 0usize);
                for &w in kvq_quant_core::pack::planes(bits) {
                    let w = usize::from(w);
                    let (s, reached) = step((c, w, pbase, base, o, rb));
                    far = far.max(reached);
                    steps.push(s);
                    pbase += c * w / 8;
                    base += w;
                }
                outs.push(Out { region: j, at: width + o, steps: first..steps.len() });
            }
            reach.push(far);
            width += c.next_multiple_of(vector);
        }
        Self { shapes: shapes.to_vec(), outs, steps, offset, width, reach }
    }
}

/// Plans an [`Unpacker`] keeps: more than the KV heads of the layers of a model, whose `-qa`
/// key heads each have a layout of their own.
pub(crate) const MAX_PLANS: usize = 256;

/// Unpacks blocks of codes in channel regions to a code a byte: the plans of the last
/// [`MAX_PLANS`] layouts seen (a head's blocks share one, so the first is usually the one),
/// the unpacked rows and the
/// copy of the last rows, grown to the largest block seen.
pub(crate) struct Unpacker<S> {
    plans: Vec<Plan<S>>,
    unpacked: Vec<u8>,
    bounce: Vec<u8>,
}

impl<S> Default for Unpacker<S> {
    fn default() -> Self {
        Self { plans: Vec::new(), unpacked: Vec::new(), bounce: Vec::new() }
    }
}

impl<S> Unpacker<S> {
    /// Every row of `regions` (as [`region_rows_ok`] takes them; the same rows each, `n` of
    /// them) unpacked to a code a byte: row `r` at `r · width` of the returned bytes, each
    /// region's codes from the plan's offset, padded with zero codes, and one row of zero
    /// codes more (the partner of an odd last row). The plan of a new layout comes from
    /// `plan`; `rows` unpacks rows as [`region_rows`] hands them over. Returns the bytes, the
    /// width and the regions' offsets in a row.
    ///
    /// # Panics
    /// Where [`region_rows_ok`] is false for a region, there are none or more than
    /// [`MAX_REGIONS`], or their rows differ.
    pub(crate) fn unpack(
        &mut self,
        regions: &[KeyRegion<'_>],
        plan: impl FnOnce(&[(usize, u8)]) -> Plan<S>,
        mut rows: impl FnMut(&Plan<S>, &[*const u8; MAX_REGIONS], &[usize; MAX_REGIONS], usize, *mut u8),
    ) -> (&[u8], usize, &[usize]) {
        assert!(!regions.is_empty() && regions.len() <= MAX_REGIONS, "regions");
        let n = regions[0].keys.rows;
        assert!(regions.iter().all(|r| r.keys.rows == n && region_rows_ok(&r.keys)), "whole rows");
        let shapes = || regions.iter().map(|r| (r.keys.dim, r.keys.bits));
        match self.plans.iter().position(|p| p.shapes.iter().copied().eq(shapes())) {
            Some(0) => {}
            Some(j) => self.plans.swap(0, j),
            None => {
                // Bounded: a process that meets ever new layouts (a fuzzer, many configs one
                // after another) would otherwise keep every plan and scan them all per block.
                self.plans.truncate(MAX_PLANS - 1);
                self.plans.insert(0, plan(&shapes().collect::<Vec<_>>()));
            }
        }
        let Self { plans, unpacked, bounce } = self;
        let p = &plans[0];
        let width = p.width;
        let unpacked = grown(unpacked, (n + 1) * width);
        unpacked[n * width..].fill(0);
        region_rows(regions, &p.reach, width, unpacked.as_mut_ptr(), bounce, |bases, strides, count, dst| {
            rows(p, bases, strides, count, dst)
        });
        (&unpacked[..(n + 1) * width], width, &p.offset)
    }
}

/// The query rows of a region scores call, rounded per region: each region's scale, what its
/// offsets add (`Σ q · offset`) and `128 · Σ q8` (8-bit codes are dotted as `code − 128`), per
/// query row (up to four).
pub(crate) struct Rounded {
    pub(crate) sq: [[f32; 4]; MAX_REGIONS],
    pub(crate) kadd: [[f32; 4]; MAX_REGIONS],
    pub(crate) qsum: [[i32; 4]; MAX_REGIONS],
}

/// Each region's columns of the `nq <= 4` query rows `q` (rows of the regions' channels),
/// rounded as kernel `K` rounds a per-channel block (its scales folded in, one int8 scale per
/// row: the reference's bytes), into the region's bytes (from `starts[j]`) of `nq` rows of
/// `width` in `q8`, zero in the padding; `qc` and `prep` are room for the region's columns and
/// their rounding.
pub(crate) fn round_query<K: crate::int8::IntKernel>(
    regions: &[KeyRegion<'_>],
    q: &[f32],
    nq: usize,
    (width, starts): (usize, &[usize]),
    prep: &mut crate::int8::Prepared,
    qc: &mut Vec<f32>,
    q8: &mut Vec<i8>,
) -> Rounded {
    let d: usize = regions.iter().map(|r| r.keys.dim).sum();
    assert!(nq <= 4 && q.len() == nq * d && regions.len() <= MAX_REGIONS && starts.len() == regions.len());
    let q8 = grown(q8, nq * width);
    q8.fill(0);
    let mut x =
        Rounded { sq: [[0.0; 4]; MAX_REGIONS], kadd: [[0.0; 4]; MAX_REGIONS], qsum: [[0; 4]; MAX_REGIONS] };
    for (j, r) in regions.iter().enumerate() {
        let c = r.keys.dim;
        let qc = grown(qc, nq * c);
        for i in 0..nq {
            qc[i * c..(i + 1) * c].copy_from_slice(&q[i * d + r.first..i * d + r.first + c]);
        }
        prep.prepare::<K>(&r.keys, qc);
        let at = starts[j];
        for i in 0..nq {
            let row = &prep.q8[i * c..(i + 1) * c];
            q8[i * width + at..i * width + at + c].copy_from_slice(row);
            x.qsum[j][i] = row.iter().map(|&b| i32::from(b)).sum::<i32>() * 128;
            (x.sq[j][i], x.kadd[j][i]) = (prep.scale[i], prep.add[i]);
        }
    }
    x
}

/// The scores of `nq` query rows from `sums` (four a row of the block, query rows side by
/// side) into `out` (query row `i` at `i · n`).
pub(crate) fn scatter(sums: &[f32], n: usize, nq: usize, out: &mut [f32]) {
    for row in 0..n {
        for i in 0..nq {
            out[i * n + row] = sums[4 * row + i];
        }
    }
}

/// What one CPU's region scores kernel brings to the shared [`scores_in`] and [`scores`]: its
/// unpacking, its integer kernel's rounding of the query (so the reference's bytes), and the
/// dots of one region with their epilogue. The AVX2 and NEON kernels implement it
/// (`regions_avx2::Kernel`, `regions_neon::Kernel`).
pub(crate) trait RegionKernel {
    /// A step of its unpacking [`Plan`].
    type Step;
    /// The integer scores kernel whose rounding of a per-channel block's query rows it shares.
    type Int: crate::int8::IntKernel;

    /// Whether it takes these regions of `rows` rows tiling a row of `dim` channels on this
    /// CPU ([`supported`] with its CPU check).
    fn supported(regions: &[KeyRegion<'_>], rows: usize, dim: usize) -> bool;

    /// Every row of `regions` unpacked to a code a byte ([`Unpacker::unpack`]).
    ///
    /// # Safety
    /// [`RegionKernel::supported`] for the regions.
    unsafe fn unpack<'u>(
        u: &'u mut Unpacker<Self::Step>,
        regions: &[KeyRegion<'_>],
    ) -> (&'u [u8], usize, &'u [usize]);

    /// [`scores`] for `nq` (1 to 4) query rows, compiled with the CPU's features: written by
    /// [`scores_group_for`].
    ///
    /// # Safety
    /// As [`scores`].
    unsafe fn scores_group(
        nq: usize,
        regions: &[KeyRegion<'_>],
        q: &[f32],
        rows: (&[u8], usize, &[usize]),
        out: &mut [f32],
        bufs: Bufs<'_>,
    );

    /// One region's dots (`keys` its block: its width and bits) of every pair of rows of `u`
    /// (rows of `width` bytes, from the region's first) with `NQ` query rows of `q` (rows of
    /// `width`), and `sums[8 · pair + 4 · h ..] += sq · dot + add` for row `h` of the pair (a
    /// multiply, then an add: the reference's epilogue), 8-bit codes taken as `code − 128`
    /// with `corr` (`128 · Σ q8`) added back to their dots. `(sq, add, corr)` per query row.
    ///
    /// # Safety
    /// The CPU's features; `u` holds `2 · pairs` rows and `q` `NQ` rows of `width`, each with
    /// the region's bytes padded to whole vectors from the pointer; `sums` `8 · pairs` floats.
    #[allow(clippy::too_many_arguments)]
    unsafe fn region_dots<const NQ: usize>(
        keys: &QuantBlock<'_>,
        u: *const u8,
        q: *const i8,
        width: usize,
        pairs: usize,
        epilogue: ([f32; 4], [f32; 4], [i32; 4]),
        sums: &mut [f32],
    );
}

/// [`RegionKernel::scores_group`] of the kernel `$kernel` (a type of the module it is used in):
/// [`scores`] for 1 to 4 query rows, each compiled with the target features `$features` (the
/// one part of a kernel's [`scores`] that its CPU alone tells apart).
macro_rules! scores_group_for {
    ($kernel:ty, $features:literal) => {
        unsafe fn scores_group(
            nq: usize,
            regions: &[KeyRegion<'_>],
            q: &[f32],
            rows: (&[u8], usize, &[usize]),
            out: &mut [f32],
            bufs: regions::Bufs<'_>,
        ) {
            /// [`regions::scores`] compiled with the CPU's features.
            ///
            /// # Safety
            /// As [`regions::scores`], on a CPU with these features.
            #[target_feature(enable = $features)]
            unsafe fn scores<const NQ: usize>(
                regions: &[KeyRegion<'_>],
                q: &[f32],
                rows: (&[u8], usize, &[usize]),
                out: &mut [f32],
                bufs: regions::Bufs<'_>,
            ) {
                // SAFETY: forwarded from the caller.
                unsafe { regions::scores::<$kernel, NQ>(regions, q, rows, out, bufs) }
            }
            // SAFETY: forwarded from the caller (the CPU's features among `scores`'s contract).
            unsafe { by_group!(scores, nq, (regions, q, rows, out, bufs)) }
        }
    };
}
pub(crate) use scores_group_for;

/// The buffers of [`scores_in`], grown to the largest call seen, then reused.
pub(crate) struct Scratch<S> {
    unpacker: Unpacker<S>,
    qc: Vec<f32>,
    q8: Vec<i8>,
    prep: crate::int8::Prepared,
    sums: Vec<f32>,
}

impl<S> Default for Scratch<S> {
    fn default() -> Self {
        Self {
            unpacker: Unpacker::default(),
            qc: Vec::new(),
            q8: Vec::new(),
            prep: crate::int8::Prepared::default(),
            sums: Vec::new(),
        }
    }
}

/// The query-side buffers of [`scores`].
pub(crate) struct Bufs<'a> {
    qc: &'a mut Vec<f32>,
    q8: &'a mut Vec<i8>,
    prep: &'a mut crate::int8::Prepared,
    sums: &'a mut Vec<f32>,
}

/// The scores of [`crate::scores_int8_regions_with`] by kernel `K` for `n_q` query rows (`q`,
/// `n_q × dim`), row `i`'s into `out[i · rows ..]`: the block unpacked once, then four query
/// rows at a time. Returns `false`, computing nothing, where `K` does not take the regions
/// ([`RegionKernel::supported`]) or the shapes do not match.
pub(crate) fn scores_in<K: RegionKernel>(
    regions: &[KeyRegion<'_>],
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
    w: &mut Scratch<K::Step>,
) -> bool {
    let d: usize = regions.iter().map(|r| r.keys.dim).sum();
    let n = regions.first().map_or(0, |r| r.keys.rows);
    if !K::supported(regions, n, d) || q.len() != n_q * d || out.len() < n_q * n {
        return false;
    }
    let Scratch { unpacker, qc, q8, prep, sums } = w;
    // SAFETY: `supported` checked the CPU and the regions.
    let rows = unsafe { K::unpack(unpacker, regions) };
    let mut i0 = 0;
    while i0 < n_q {
        let nq = (n_q - i0).min(crate::int8::GROUP);
        let (q, out) = (&q[i0 * d..(i0 + nq) * d], &mut out[i0 * n..(i0 + nq) * n]);
        let bufs = Bufs { qc, q8, prep, sums };
        // SAFETY: as above; `q` holds nq rows of d, `out` nq rows of n; `rows` is the
        // regions' rows unpacked.
        unsafe { K::scores_group(nq, regions, q, rows, out, bufs) }
        i0 += nq;
    }
    true
}

/// The scores of `NQ` query rows against keys in regions, their rows unpacked (`rows`: the
/// bytes, the width of a row and each region's first byte in it, as [`Unpacker::unpack`]
/// returns them): the query's rounding per region, then region by region the integer dots
/// and the reference's epilogue, added to the rows' scores in region order (so the bits of
/// the reference, which adds the regions' scores one after the other). Inlined into each
/// kernel's [`RegionKernel::scores_group`], which compiles it with the CPU's features.
///
/// # Safety
/// `K`'s CPU features; [`RegionKernel::supported`] for `regions` (n rows, head_dim d); `rows`
/// their unpacked rows; `q` holds `NQ` rows of d, `out` `NQ` rows of n.
#[inline(always)]
pub(crate) unsafe fn scores<K: RegionKernel, const NQ: usize>(
    regions: &[KeyRegion<'_>],
    q: &[f32],
    rows: (&[u8], usize, &[usize]),
    out: &mut [f32],
    bufs: Bufs<'_>,
) {
    let n = regions[0].keys.rows;
    let d: usize = regions.iter().map(|r| r.keys.dim).sum();
    let (unpacked, width, starts) = rows;
    assert!(q.len() == NQ * d && out.len() >= NQ * n && regions.len() <= MAX_REGIONS, "shapes");
    assert!(unpacked.len() >= (n + 1) * width && starts.len() == regions.len(), "the unpacked rows");
    let Bufs { qc, q8, prep, sums } = bufs;

    // 1. Each region's columns of the query rows rounded as the scores kernel rounds a
    //    per-channel block, into the region's bytes of a row of `width`.
    let x = round_query::<K::Int>(regions, q, NQ, (width, starts), prep, qc, q8);

    // 2. Region by region, two rows at a time: the dots and the epilogue.
    let pairs = n.div_ceil(2);
    let sums = grown(sums, pairs * 8);
    sums.fill(0.0);
    for (j, r) in regions.iter().enumerate() {
        let at = starts[j];
        let (u, qb) = (unpacked[at..].as_ptr(), q8[at..].as_ptr());
        // SAFETY: `unpacked` holds n + 1 rows of `width` and `q8` NQ rows, the region's
        // padded bytes from `at` inside each; `sums` `pairs` · 8 floats; the CPU as `K` needs
        // (this function's contract).
        unsafe { K::region_dots::<NQ>(&r.keys, u, qb, width, pairs, (x.sq[j], x.kadd[j], x.qsum[j]), sums) }
    }
    scatter(sums, n, NQ, out);
}
