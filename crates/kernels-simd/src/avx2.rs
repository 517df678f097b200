//! x86-64 AVX2 + FMA (+ F16C) kernels, chosen at run time. Codes are widened and multiplied in
//! registers (no f32 copy of a row): a 16-byte load into both lanes, a shift and a mask give
//! 16 codes of the bit-plane layout, two in-lane `vpshufb` make them i32 lanes and
//! `vcvtdq2ps` floats, `vfmadd` accumulates. Each layout (width, kind of levels, per-group
//! parameters or not) has its own monomorphization, chosen once per block.
//! Query rows go 4 at a time (a GQA group): scores unpack each key row once for all four and
//! reduce their four sums together; values run one 16-channel column of the block at a time,
//! all rows into four queries' accumulators held in registers, so the output is read and
//! written once per block instead of once per row.
//!
//! Covered: affine and symmetric levels, table levels (codebooks of up to 8 levels held in a
//! register and looked up with `vpermps`; of 16, as four byte planes looked up with `vpshufb`;
//! larger tables: the 8 levels of 8 codes come from one `vgatherdps`) and FP8 levels (decoded from their bits: e5m2 codes are the high byte
//! of an f16, e4m3's seven magnitude bits placed in an f16 are the value / 256, both widened
//! by `vcvtph2ps`; no table; the 256 is applied once per row, weight or group, and only
//! blocks holding e4m3's NaN code, looked for once per block, pay for keeping it a NaN), 2-, 4- and 8-bit codes, rows whose length is a multiple of the chunk (64,
//! 32, 16 codes), and 3-bit codes in rows of a multiple of 64 (both bit planes read per 16
//! codes); symmetric levels subtract the zero point from the codes in i32 before the
//! conversion (exact). Per-row and per-channel parameters, and per-group parameters (`gN`) in
//! groups of a multiple of 16: those decode each run of 16 codes to values in registers with
//! their group's scale and offset (one FMA per 8 values, shared by the query group) before
//! the dot or the accumulation. Anything else (other widths, groups of 8) runs the `wide`
//! kernels, and [`crate::implementation_for`] says so. Each public function checks the CPU itself, so it is safe to call anywhere.
//!
//! # Platform-specific behavior
//! FMA rounds once per multiply-add and sums run in 8 lanes: results differ from the scalar
//! reference in the last bits, within the crate's stated tolerance.

use std::arch::x86_64::*;
use std::ops::Range;

use kvq_quant_core::ParamGrid;
use kvq_quant_core::fp8::Fp8Format;

use crate::block::{Levels, Params, QuantBlock};
use crate::int8;
use crate::prefetch::Ahead;
use crate::wide_backend;

fn supported(b: &QuantBlock<'_>) -> bool {
    (fast(b) || generic(b)) && cpu_ok()
}

/// The most codes a row may have for the any-width kernels ([`generic`]): a row's unpacked
/// codes sit on the stack.
const GENERIC_DIM: usize = 512;

/// Bytes of the buffers rows are unpacked into: a short last chunk's stores spill past `d`.
const GENERIC_BUF: usize = GENERIC_DIM + 32;

/// Whether the any-width kernels take `b` where the chunked ones do not: affine codes of 1 to
/// 8 bits per row or per channel, rows of a multiple of 8 codes (the width regions of `-qa`
/// keys: 1-, 5-, 6- and 7-bit rows, and 2- and 3-bit rows shorter than a 64-code chunk).
fn generic(b: &QuantBlock<'_>) -> bool {
    matches!(b.levels, Levels::Affine)
        && matches!(b.params, Params::PerRow { .. } | Params::PerChannel { .. })
        && (1..=8).contains(&b.bits)
        && b.dim > 0
        && b.dim.is_multiple_of(8)
        && b.dim <= GENERIC_DIM
}

/// Whether the chunked kernels (two or four bit planes per 16-byte load) take `b`.
fn fast(b: &QuantBlock<'_>) -> bool {
    let chunk = match b.bits {
        8 => 16,
        4 => 32,
        2 | 3 => 64,
        _ => return false,
    };
    // A per-group block decodes 16 consecutive codes at a time with one scale: its groups
    // must hold whole runs of 16.
    let groups_ok = match b.params {
        Params::PerGroup { group, .. } => group.is_multiple_of(16),
        _ => true,
    };
    // Symmetric levels are the codes minus a zero point, which folds into the offsets.
    matches!(b.levels, Levels::Affine | Levels::Symmetric { .. } | Levels::Table(_) | Levels::Fp8(_))
        && b.dim.is_multiple_of(chunk)
        && b.dim > 0
        && groups_ok
}

/// Whether these kernels run for `b` on this CPU (else the `wide` ones do).
pub fn float_supported(b: &QuantBlock<'_>) -> bool {
    supported(b)
}

/// AVX2, FMA and F16C, as detection found them once ([`crate::dispatch`]).
pub(crate) fn cpu_ok() -> bool {
    crate::dispatch::cpu().avx2
}

/// The zero point the kernels subtract from codes, in integers before the conversion to float
/// (exact, and no cancellation against the offsets): symmetric levels are `code − zero`;
/// 0 for affine and table levels.
fn zero_of(b: &QuantBlock<'_>) -> i32 {
    match b.levels {
        Levels::Symmetric { zero } => zero as i32,
        _ => 0,
    }
}

/// How [`widen_codes`] turns codes into levels: the codes themselves (minus a zero point),
/// a table of levels held in registers (up to 8 entries, looked up with `vpermps`; 16, as
/// byte planes looked up with `vpshufb`) or in memory (256 entries, gathered with
/// `vgatherdps`), or FP8 decoded from its bits.
#[derive(Clone, Copy)]
struct Lut {
    kind: LutKind,
    /// The entries of a table of up to 8.
    lo: __m256,
    /// A large table, for gathers.
    table: *const f32,
    /// The symmetric zero point in every lane, or 0.
    zero: __m256i,
    /// [`vpshufb`](_mm256_shuffle_epi8) controls widening the 16 byte codes of a lane (the
    /// same in both lanes) to i32 lanes: codes 0..8 and 8..16 (see [`widen_codes`]).
    spread: [__m256i; 2],
    /// A table of 16 levels as four byte planes (byte `j` of plane `k`: byte `k` of level
    /// `j`'s bits), in both lanes, and the control moving the upper lane's codes on by four
    /// (see [`levels16`]).
    planes: [__m256i; 4],
    ahead: __m256i,
}

#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum LutKind {
    Codes,
    /// The codes minus the zero point.
    Shifted,
    Permute8,
    Permute16,
    Gather,
    /// FP8 codes decoded from their bits (see [`fp8_halves`]): e4m3 blocks without the NaN
    /// code ([`kernel_kind`] looks), e4m3 blocks that may hold it, e5m2.
    E4m3,
    E4m3Any,
    E5m2,
}

// The [`LutKind`]s as the const parameter `K` of the float kernels: each layout's loop is
// compiled for its kind. (Matched at run time, per 16 codes, the choice cost a jump through a
// table and kept the levels' registers on the stack.)
const CODES: u8 = LutKind::Codes as u8;
const SHIFTED: u8 = LutKind::Shifted as u8;
const PERMUTE8: u8 = LutKind::Permute8 as u8;
const PERMUTE16: u8 = LutKind::Permute16 as u8;
const GATHER: u8 = LutKind::Gather as u8;
const E4M3: u8 = LutKind::E4m3 as u8;
const E4M3_ANY: u8 = LutKind::E4m3Any as u8;
const E5M2: u8 = LutKind::E5m2 as u8;

/// The kind of a block's levels: what its [`Lut`] holds. (e4m3 blocks as `E4m3Any`: which
/// of the two e4m3 kernels runs one is [`kernel_kind`]'s choice.)
fn kind_of(b: &QuantBlock<'_>) -> LutKind {
    match b.levels {
        Levels::Fp8(Fp8Format::E4M3) => LutKind::E4m3Any,
        Levels::Fp8(Fp8Format::E5M2) => LutKind::E5m2,
        Levels::Table(t) if t.len() <= 8 => LutKind::Permute8,
        Levels::Table(t) if t.len() <= 16 => LutKind::Permute16,
        Levels::Table(_) => LutKind::Gather,
        _ if zero_of(b) != 0 => LutKind::Shifted,
        _ => LutKind::Codes,
    }
}

/// The monomorphization of the kernels that runs a block ([`by_layout`]): its [`kind_of`],
/// except that an e4m3 block without the NaN code (as every quantizer writes) takes the
/// kernels that do not look for it.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
unsafe fn kernel_kind(b: &QuantBlock<'_>) -> LutKind {
    match kind_of(b) {
        // SAFETY: AVX2 is enabled by this function's target features.
        LutKind::E4m3Any if !unsafe { holds_e4m3_nan(b.codes) } => LutKind::E4m3,
        kind => kind,
    }
}

/// Whether any of `codes` is e4m3's NaN (magnitude bits 0x7f), 32 bytes per two vector
/// instructions: each byte with its sign bit set is 0xff only for the NaN, so the running
/// unsigned maximum reaches 0xff in some byte exactly when a NaN is there. About 2% of the
/// work of the kernels that read the block after it (in L1 by then).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn holds_e4m3_nan(codes: &[u8]) -> bool {
    let sign = _mm256_set1_epi8(i8::MIN);
    let mut top = _mm256_setzero_si256();
    let chunks = codes.chunks_exact(32);
    let tail = chunks.remainder();
    for c in chunks {
        // SAFETY: `c` holds 32 bytes.
        let v = unsafe { _mm256_loadu_si256(c.as_ptr().cast()) };
        top = _mm256_max_epu8(top, _mm256_or_si256(v, sign));
    }
    _mm256_movemask_epi8(_mm256_cmpeq_epi8(top, _mm256_set1_epi8(-1))) != 0
        || tail.iter().any(|&c| c & 0x7f == 0x7f)
}

/// What the kernels' levels must be multiplied by to be the block's: 256 for e4m3, whose
/// levels [`fp8_halves`] leaves at 1/256 of their value (the factor is exact, so that applying
/// it to the dots, the weights or a group's scale instead gives the same results), else 1.
fn unit_of(b: &QuantBlock<'_>) -> f32 {
    if matches!(b.levels, Levels::Fp8(Fp8Format::E4M3)) { 256.0 } else { 1.0 }
}

/// The [`Lut`] of a block.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn lut_of(b: &QuantBlock<'_>) -> Lut {
    let mut lut = Lut {
        kind: kind_of(b),
        lo: _mm256_setzero_ps(),
        table: std::ptr::null(),
        zero: _mm256_set1_epi32(zero_of(b)),
        // Opaque to the compiler, which would turn the constant shuffles of a broadcast back
        // into `vpmovzxbd` (two µops on Zen 3, and the upper half needs a shift first).
        spread: std::hint::black_box([
            _mm256_setr_epi8(
                0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 4, -1, -1, -1, 5, -1, -1, -1, 6,
                -1, -1, -1, 7, -1, -1, -1,
            ),
            _mm256_setr_epi8(
                8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1, 12, -1, -1, -1, 13, -1, -1, -1,
                14, -1, -1, -1, 15, -1, -1, -1,
            ),
        ]),
        planes: [_mm256_setzero_si256(); 4],
        // Opaque as `spread`, for the same reason (the constant shuffle of a broadcast).
        ahead: std::hint::black_box(_mm256_setr_epi8(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
            0, 1, 2, 3,
        )),
    };
    if let Levels::Table(t) = b.levels {
        if t.len() <= 16 {
            let mut small = [0f32; 16];
            small[..t.len()].copy_from_slice(t);
            // SAFETY: `small` holds 16 floats.
            lut.lo = unsafe { _mm256_loadu_ps(small.as_ptr()) };
            if lut.kind == LutKind::Permute16 {
                let mut planes = [[0u8; 32]; 4];
                for (j, level) in small.iter().enumerate() {
                    for (k, byte) in level.to_le_bytes().into_iter().enumerate() {
                        (planes[k][j], planes[k][16 + j]) = (byte, byte);
                    }
                }
                // SAFETY: each plane holds 32 bytes.
                lut.planes = planes.map(|p| unsafe { _mm256_loadu_si256(p.as_ptr().cast()) });
            }
        } else {
            lut.table = t.as_ptr();
        }
    }
    lut
}

/// Levels of 8 codes (as i32 lanes) from a [`Lut`] of kind `K` (not FP8: [`fp8_halves`]; not
/// 16-level tables: [`levels16`]).
///
/// # Safety
/// The CPU must support AVX2; `K` is `lut`'s kind; every code is below the table's length
/// (`QuantBlock::new` checked that a table has `2^bits` entries).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn levels8<const K: u8>(idx: __m256i, lut: &Lut) -> __m256 {
    if K == CODES {
        _mm256_cvtepi32_ps(idx)
    } else if K == SHIFTED {
        _mm256_cvtepi32_ps(_mm256_sub_epi32(idx, lut.zero))
    } else if K == PERMUTE8 {
        _mm256_permutevar8x32_ps(lut.lo, idx)
    } else {
        // SAFETY: every index is a code, below the table's length (`GATHER`: a table of 256
        // levels).
        unsafe { _mm256_i32gather_ps::<4>(lut.table, idx) }
    }
}

/// The FP8 levels of the 16 byte codes of `v`, as two vectors of 8 floats (codes 0..8 and
/// 8..16). e5m2 is the high byte of an f16, so `code << 8` is the value's f16 bits. For e4m3,
/// `code << 8` shifted right arithmetically by one puts the sign at f16 bits 15 and 14 and the
/// magnitude bits `eeee mmm` at 13..7; with bit 14 cleared that is an f16 of exponent
/// `e − 15 + 7` less than the value's, subnormals included: the value / 2^8, exact. The
/// kernels leave e4m3 levels so and apply the 2^8 once per row, weight or group
/// ([`unit_of`]). Only `E4M3_ANY` looks for the magnitude code 0x7f (NaN in e4m3, a number in
/// f16) and sets bit 14 for it: exponent all ones, mantissa not zero, an f16 NaN; that is four
/// of the nine vector instructions per 8 codes, so blocks without it (every block a quantizer
/// writes) run `E4M3`, which does not look.
///
/// # Safety
/// The CPU must support AVX2 and F16C; `K` is `E4M3`, `E4M3_ANY` or `E5M2`. (`E4M3` decodes
/// the NaN code as a number, 480: callers give it blocks without one.)
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn fp8_halves<const K: u8>(v: __m128i) -> (__m256, __m256) {
    let zero = _mm_setzero_si128();
    let (lo, hi) = (_mm_unpacklo_epi8(zero, v), _mm_unpackhi_epi8(zero, v));
    if K == E5M2 {
        return (_mm256_cvtph_ps(lo), _mm256_cvtph_ps(hi));
    }
    let half = |w: __m128i| {
        let bits = _mm_and_si128(_mm_srai_epi16::<1>(w), _mm_set1_epi16(0xbf80u16 as i16));
        if K == E4M3 {
            return _mm256_cvtph_ps(bits);
        }
        let mag = _mm_set1_epi16(0x3f80);
        let nan = _mm_cmpeq_epi16(_mm_and_si128(bits, mag), mag);
        _mm256_cvtph_ps(_mm_or_si128(bits, _mm_and_si128(nan, _mm_set1_epi16(0x4000))))
    };
    (half(lo), half(hi))
}

/// The levels of the 16 codes of bit-group `k` of a 16-byte chunk of a `bits`-wide plane, as
/// two vectors of 8 floats (codes `16k .. 16k + 8` and `16k + 8 .. 16k + 16` of the chunk),
/// through the block's [`Lut`], of kind `K`. `chunk` holds the 16 bytes in both 128-bit lanes
/// ([`load_pair`]).
///
/// # Safety
/// The CPU must support AVX2; `lut` is the block's, of kind `K`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn codes_f32<const K: u8>(chunk: __m256i, bits: u8, k: i32, lut: &Lut) -> (__m256, __m256) {
    let v = if bits == 8 {
        chunk
    } else {
        // A shift by a count in a register, not a `match` on `k`: where `k` is not a constant
        // (the value kernel's row loop) the match stayed in the loop as a jump table.
        let mask = _mm256_set1_epi8(((1u16 << bits) - 1) as i8);
        _mm256_and_si256(_mm256_srl_epi16(chunk, _mm_cvtsi32_si128(k * bits as i32)), mask)
    };
    // SAFETY: AVX2 is enabled; the codes are below 2^bits, the table's length.
    unsafe { widen_codes::<K>(v, lut) }
}

/// The 16 bytes at `p` in both 128-bit lanes (`vbroadcasti128`: a load, no shuffle).
///
/// # Safety
/// The CPU must support AVX2; `p` points at 16 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn load_pair(p: *const u8) -> __m256i {
    // SAFETY: as this function's.
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast())) }
}

/// The levels of 16 codes (one per byte, the same 16 in both 128-bit lanes of `v`) as two
/// vectors of 8 floats, through `lut` (of kind `K`). The codes become i32 lanes by one
/// in-lane `vpshufb` per 8 (`lut.spread`), not `vpmovzxbd`.
///
/// # Safety
/// The CPU must support AVX2; `K` is `lut`'s kind (or `E4M3` for an `E4m3Any` table: see
/// [`kernel_kind`]); every code is below the length of `lut`'s table.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn widen_codes<const K: u8>(v: __m256i, lut: &Lut) -> (__m256, __m256) {
    if K == E4M3 || K == E4M3_ANY || K == E5M2 {
        // SAFETY: as this function's; F16C comes with the kernels' CPU check.
        return unsafe { fp8_halves::<K>(_mm256_castsi256_si128(v)) };
    }
    if K == PERMUTE16 {
        // SAFETY: as this function's.
        return unsafe { levels16(v, lut) };
    }
    let (lo, hi) = (_mm256_shuffle_epi8(v, lut.spread[0]), _mm256_shuffle_epi8(v, lut.spread[1]));
    // SAFETY: as this function's.
    unsafe { (levels8::<K>(lo, lut), levels8::<K>(hi, lut)) }
}

/// The levels of 16 codes below 16 (one per byte, the same in both lanes of `v`) from a
/// table of 16, as two vectors of 8 floats, by in-lane byte shuffles only: the upper lane's
/// codes moved on by four (`lut.ahead`), each byte of the levels looked up in its plane
/// (`vpshufb`), and the four planes interleaved, bytes then pairs: the low lanes then hold
/// the levels of codes 0..4 and 8..12, the upper ones those of 4..8 and 12..16, in order.
/// Eleven one-µop shuffles, where `vpermps` from two registers and a blend took fourteen µops,
/// eight of them on one pipe of Zen 3.
///
/// # Safety
/// The CPU must support AVX2; `lut` is of kind `Permute16`; every code is below 16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn levels16(v: __m256i, lut: &Lut) -> (__m256, __m256) {
    let idx = _mm256_shuffle_epi8(v, lut.ahead);
    let [b0, b1, b2, b3] = lut.planes.map(|p| _mm256_shuffle_epi8(p, idx));
    let (lo01, lo23) = (_mm256_unpacklo_epi8(b0, b1), _mm256_unpacklo_epi8(b2, b3));
    let (hi01, hi23) = (_mm256_unpackhi_epi8(b0, b1), _mm256_unpackhi_epi8(b2, b3));
    (
        _mm256_castsi256_ps(_mm256_unpacklo_epi16(lo01, lo23)),
        _mm256_castsi256_ps(_mm256_unpacklo_epi16(hi01, hi23)),
    )
}

/// Codes `16t .. 16t + 16` of a 3-bit row of `d` codes (`d` a multiple of 64), one per byte,
/// in both 128-bit lanes. A 3-bit row is a 2-bit plane (`d / 4` bytes, chunks of 64 codes in
/// 16 bytes) followed by a 1-bit plane (chunks of 128 codes in 16 bytes, byte `j` bit `k`
/// holding code `j + 16k`; a last chunk of 64 codes takes 8 bytes, byte `j` bit `k` holding
/// code `j + 8k`). The high bit goes to its place with one shift, left or right by the
/// distance from bit `k` to bit 2.
///
/// # Safety
/// The CPU must support AVX2; `row` points at a packed 3-bit row of `d` codes; `16t < d`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn codes3(row: *const u8, d: usize, t: usize) -> __m256i {
    let i = 16 * t;
    let count = |n: usize| _mm_cvtsi32_si128(n as i32);
    // SAFETY: chunk i / 64 of the 2-bit plane lies within its d / 4 bytes (d % 64 == 0); the
    // 1-bit plane starts after it, and a full chunk's 16 bytes or a last chunk's 8 bytes lie
    // within the row's 3d / 8 bytes.
    unsafe {
        let low = load_pair(row.add(16 * (i / 64)));
        let low = _mm256_and_si256(_mm256_srl_epi16(low, count(2 * ((i % 64) / 16))), _mm256_set1_epi8(3));
        let plane = row.add(d / 4);
        let (c, j) = (i / 128, i % 128);
        let high = if d - 128 * c >= 128 {
            let (h, k) = (load_pair(plane.add(16 * c)), j / 16);
            if k >= 2 { _mm256_srl_epi16(h, count(k - 2)) } else { _mm256_sll_epi16(h, count(2 - k)) }
        } else {
            let x = _mm_loadl_epi64(plane.add(16 * c).cast());
            let (k0, k1) = (j / 8, j / 8 + 1);
            let to2 = |k: usize| {
                if k >= 2 { _mm_srl_epi16(x, count(k - 2)) } else { _mm_sll_epi16(x, count(2 - k)) }
            };
            let h = _mm_unpacklo_epi64(to2(k0), to2(k1));
            _mm256_set_m128i(h, h)
        };
        _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(4)))
    }
}

/// The 16 values `16t .. 16t + 16` of row `r`: levels through `lut` (of kind `K`), with a
/// per-group block's scale and offset `gp` applied (`GROUPED`; [`Groups::at`]). A 3-bit row
/// reads both bit planes ([`codes3`]), a wider one the 16-byte chunk holding the codes.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `supported(b)` with `b.bits == BITS`; `lut` is `b`'s,
/// of kind `K`; `r < b.rows`, `16t < b.dim`; `GROUPED` only for a per-group block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn values16<const BITS: u8, const K: u8, const GROUPED: bool>(
    b: &QuantBlock<'_>,
    lut: &Lut,
    r: usize,
    t: usize,
    gp: (__m256, __m256),
) -> (__m256, __m256) {
    let (lo, hi) = if BITS == 3 {
        // SAFETY: row r is a packed 3-bit row of `dim` codes, a multiple of 64 for supported
        // blocks, and 16t < dim; a table has 8 entries.
        unsafe { widen_codes::<K>(codes3(b.row(r).as_ptr(), b.dim, t), lut) }
    } else {
        let steps = 128 / BITS as usize / 16;
        // SAFETY: the 16-byte chunk holding codes 16t.. lies within row r (row_bytes is a
        // multiple of 16 for supported blocks); a table has 2^BITS entries.
        unsafe {
            let chunk = load_pair(b.row(r).as_ptr().add(16 * (t / steps)));
            codes_f32::<K>(chunk, BITS, (t % steps) as i32, lut)
        }
    };
    if GROUPED {
        let (sv, ov) = gp;
        return (_mm256_fmadd_ps(lo, sv, ov), _mm256_fmadd_ps(hi, sv, ov));
    }
    (lo, hi)
}

/// `dots[i][r] = Σ_d q_i[d] · level[r][d]` for `NQ ≤ 4` query rows (`q`, `NQ × dim`,
/// row-major) against every row of the block (a per-group block's: its values, parameters
/// applied), handed to `emit(i, r, dot)`. Each row is unpacked once into registers and
/// multiplied by every query row while it is there; two rows per pass, so that each query
/// load serves both, with one accumulator per (query row, row) (`2·NQ` independent FMA
/// chains) and the `2·NQ` sums reduced together in registers; an odd last row is paired with
/// itself and emitted once. Rows of 16-level tables go one at a time (their lookup needs the
/// registers the second row's accumulators would take).
///
/// # Safety
/// The CPU must support AVX2 and FMA; `supported(b)` with `b.bits == BITS`; `K` is the kind
/// of `b`'s [`Lut`]; `q.len() == NQ · b.dim`; `GROUPED` only for a per-group block (groups of
/// a multiple of 16).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_dots<const BITS: u8, const NQ: usize, const K: u8, const GROUPED: bool>(
    b: &QuantBlock<'_>,
    q: &[f32],
    mut emit: impl FnMut(usize, usize, f32),
) {
    // SAFETY: AVX2 is enabled by this function's target features.
    let (d, lut, groups) = (b.dim, unsafe { lut_of(b) }, Groups::of(b));
    let zero = (_mm256_setzero_ps(), _mm256_setzero_ps());
    // Rows in pairs, but one at a time where decoding takes many registers (16-level tables:
    // four byte planes), so that the decoding's registers are not spilled.
    let pair = K != PERMUTE16;
    for r in (0..b.rows).step_by(if pair { 2 } else { 1 }) {
        let r1 = if pair { (r + 1).min(b.rows - 1) } else { r };
        // acc[2i + j]: query row i, block row r + j; the unused ones stay zero.
        let mut acc = [_mm256_setzero_ps(); 8];
        // The FMAs of 16 values of both rows at codes 16t..: a macro, not a closure (a closure
        // does not inherit the target features).
        macro_rules! fma16 {
            ($t:expr, $l0:expr, $h0:expr, $l1:expr, $h1:expr) => {
                for i in 0..NQ {
                    // SAFETY: 16t + 16 <= d, and query row i spans q[i·d .. (i + 1)·d].
                    let (q0, q1) = unsafe {
                        let p = q.as_ptr().add(i * d + 16 * $t);
                        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
                    };
                    acc[2 * i] = _mm256_fmadd_ps($h0, q1, _mm256_fmadd_ps($l0, q0, acc[2 * i]));
                    if pair {
                        acc[2 * i + 1] = _mm256_fmadd_ps($h1, q1, _mm256_fmadd_ps($l1, q0, acc[2 * i + 1]));
                    }
                }
            };
        }
        if BITS == 3 || GROUPED {
            for g in 0..groups.per_row {
                let (p0, p1) = if GROUPED {
                    // SAFETY: AVX2 is enabled; a per-group block; r, r1 < rows and g < per_row.
                    unsafe { (groups.at::<K>(r, g), groups.at::<K>(r1, g)) }
                } else {
                    (zero, zero)
                };
                for t in g * groups.steps..(g + 1) * groups.steps {
                    // SAFETY: as this function's; r, r1 < rows and 16t < d.
                    let ((l0, h0), (l1, h1)) = unsafe {
                        let v0 = values16::<BITS, K, GROUPED>(b, &lut, r, t, p0);
                        (v0, if pair { values16::<BITS, K, GROUPED>(b, &lut, r1, t, p1) } else { v0 })
                    };
                    fma16!(t, l0, h0, l1, h1);
                }
            }
        } else {
            // One load of each row's 16-byte chunk for all its runs of 16 codes.
            let steps = 128 / BITS as usize / 16;
            let (row0, row1) = (b.row(r), b.row(r1));
            for ci in 0..b.row_bytes / 16 {
                // SAFETY: chunk `ci` lies within both rows (row_bytes is a multiple of 16).
                let (c0, c1) =
                    unsafe { (load_pair(row0.as_ptr().add(16 * ci)), load_pair(row1.as_ptr().add(16 * ci))) };
                for k in 0..steps {
                    // SAFETY: AVX2 is enabled; a table has 2^BITS entries (`QuantBlock::new`).
                    let ((l0, h0), (l1, h1)) = unsafe {
                        let v0 = codes_f32::<K>(c0, BITS, k as i32, &lut);
                        (v0, if pair { codes_f32::<K>(c1, BITS, k as i32, &lut) } else { v0 })
                    };
                    fma16!(ci * steps + k, l0, h0, l1, h1);
                }
            }
        }
        // SAFETY: AVX2 is enabled by this function's target features.
        unsafe { emit_pairs::<NQ>(&acc, r, r1, &mut emit) };
    }
}

/// A block's runs of 16 codes by parameter group: `per_row` groups a row of `steps` runs each
/// (one group of `dim / 16` runs for blocks that are not per group), and a per-group block's
/// parameters read by row and group through pointers. (Indexed as `r · (dim / group) + 16t /
/// group` per run, the parameters cost two divisions and two bounds checks in the loops.)
struct Groups {
    per_row: usize,
    steps: usize,
    scale: *const f32,
    /// Null without offsets.
    offset: *const f32,
}

impl Groups {
    fn of(b: &QuantBlock<'_>) -> Self {
        match b.params {
            Params::PerGroup { group, scale, offset } => Groups {
                per_row: b.dim / group,
                steps: group / 16,
                scale: scale.as_ptr(),
                offset: offset.map_or(std::ptr::null(), <[f32]>::as_ptr),
            },
            _ => Groups { per_row: 1, steps: b.dim / 16, scale: std::ptr::null(), offset: std::ptr::null() },
        }
    }

    /// The scale and offset (0 without offsets) of group `g` of row `r`, broadcast; for
    /// e4m3 levels (`K`), the scale times 2^8 ([`unit_of`]).
    ///
    /// # Safety
    /// The CPU must support AVX2; the block is per group (`QuantBlock::new` checked its
    /// parameters: `rows · per_row` of each); `r < rows`, `g < per_row`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn at<const K: u8>(&self, r: usize, g: usize) -> (__m256, __m256) {
        let i = r * self.per_row + g;
        // SAFETY: i < rows · per_row, the length of the scales and of the offsets if any.
        unsafe {
            let ov = if self.offset.is_null() {
                _mm256_setzero_ps()
            } else {
                _mm256_broadcast_ss(&*self.offset.add(i))
            };
            let sv = _mm256_broadcast_ss(&*self.scale.add(i));
            (if K == E4M3 || K == E4M3_ANY { _mm256_mul_ps(sv, _mm256_set1_ps(256.0)) } else { sv }, ov)
        }
    }
}

/// `sums[i·dim + d] = Σ_r w[i·rows + r] · level[r][d]` for `NQ ≤ 4` weight rows (a per-group
/// block's values, `GROUPED`: each run of 16 codes decoded with its group's parameters), one
/// 16-channel column of the block at a time with every query's accumulators in registers
/// across all rows.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `supported(b)` with `b.bits == BITS`; `K` is the kind
/// of `b`'s [`Lut`]; `w.len() >= NQ · b.rows`; `sums.len() >= NQ · b.dim`; `GROUPED` only for
/// a per-group block (groups of a multiple of 16).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_axpy<const BITS: u8, const NQ: usize, const K: u8, const GROUPED: bool>(
    b: &QuantBlock<'_>,
    w: &[f32],
    sums: &mut [f32],
) {
    // SAFETY: AVX2 is enabled by this function's target features.
    let (d, rows, lut, groups) = (b.dim, b.rows, unsafe { lut_of(b) }, Groups::of(b));
    for t in 0..d / 16 {
        let mut acc = [[_mm256_setzero_ps(); 2]; NQ];
        let g = if GROUPED { t / groups.steps } else { 0 };
        for r in 0..rows {
            // SAFETY: as this function's; r < rows, 16t < d, so g < per_row.
            let (lo, hi) = unsafe {
                let gp =
                    if GROUPED { groups.at::<K>(r, g) } else { (_mm256_setzero_ps(), _mm256_setzero_ps()) };
                values16::<BITS, K, GROUPED>(b, &lut, r, t, gp)
            };
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: i·rows + r < w.len().
                let wv = unsafe { _mm256_broadcast_ss(w.get_unchecked(i * rows + r)) };
                a[0] = _mm256_fmadd_ps(lo, wv, a[0]);
                a[1] = _mm256_fmadd_ps(hi, wv, a[1]);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: 16t + 16 <= dim, so the 16 floats lie within row i of `sums`.
            unsafe {
                let p = sums.as_mut_ptr().add(i * d + 16 * t);
                _mm256_storeu_ps(p, a[0]);
                _mm256_storeu_ps(p.add(8), a[1]);
            }
        }
    }
}

/// One bit plane of a packed row of `d` codes (`d` a multiple of 8), `w` bits a code, into
/// `dst[..d]`, one code per byte. A full chunk is 16 bytes, byte `j` holding code `j + 16k` in
/// bits `k·w`; a last, shorter chunk of `r` codes takes `s = ceil(r·w / 8)` bytes with `s` in
/// place of 16 (docs/formats.md, "Codes: bit planes"): each of its `8 / w` shifted copies is
/// stored `s` codes after the previous one, overwriting that one's spill.
///
/// # Safety
/// The CPU must support AVX2; `plane` holds the plane's `ceil(d·w / 8)` bytes; `w` is 1, 2, 4
/// or 8; `d <= GENERIC_DIM`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn unpack_plane(plane: &[u8], d: usize, w: usize, dst: &mut [u8; GENERIC_BUF]) {
    let m = 8 / w;
    let full = 16 * m;
    let mask = _mm_set1_epi8(((1u16 << w) - 1) as u8 as i8);
    let (mut c, mut o) = (0, 0);
    while c < d {
        let r = (d - c).min(full);
        let s = if r == full { 16 } else { r.div_ceil(m) };
        let v = if s == 16 {
            // SAFETY: a full chunk is 16 bytes of the plane.
            unsafe { _mm_loadu_si128(plane[o..o + 16].as_ptr().cast()) }
        } else {
            load_short(&plane[o..o + s])
        };
        // SAFETY: the store of copy k writes bytes c + s·k .. c + s·k + 16 <= c + r + 16 <=
        // d + 16, inside `dst`.
        unsafe {
            for k in 0..m {
                let x = _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128((k * w) as i32)), mask);
                _mm_storeu_si128(dst.as_mut_ptr().add(c + s * k).cast(), x);
            }
        }
        c += r;
        o += s;
    }
}

/// The bytes of `x` (at most 16) in the low lanes of a vector, the rest zero: two overlapping
/// 8- or 4-byte reads where `x` has that many, so that no byte outside it is read.
#[inline]
fn load_short(x: &[u8]) -> __m128i {
    let n = x.len();
    let word = |at: usize| u64::from_le_bytes(x[at..at + 8].try_into().expect("8 bytes"));
    let half = |at: usize| u64::from(u32::from_le_bytes(x[at..at + 4].try_into().expect("4 bytes")));
    let (lo, hi) = match n {
        16 => (word(0), word(8)),
        8..=15 => (word(0), if n > 8 { word(n - 8) >> (8 * (16 - n)) } else { 0 }),
        4..=7 => (half(0) | (half(n - 4) >> (8 * (8 - n))) << 32, 0),
        _ => (x.iter().rev().fold(0u64, |a, &b| a << 8 | u64::from(b)), 0),
    };
    // SAFETY: SSE2 is part of x86-64.
    unsafe { _mm_set_epi64x(hi as i64, lo as i64) }
}

/// The codes of a packed row of `d` codes of `bits` bits (`d` a multiple of 8, at most
/// `GENERIC_DIM`) into `out[..d]`, one per byte: each bit plane unpacked ([`unpack_plane`]),
/// the higher ones shifted into place.
///
/// # Safety
/// The CPU must support AVX2; `row` is a whole packed row; `1 <= bits <= 8`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn unpack_any(
    row: &[u8],
    d: usize,
    bits: u8,
    out: &mut [u8; GENERIC_BUF],
    tmp: &mut [u8; GENERIC_BUF],
) {
    let mut at = 0;
    let mut shift = 0;
    for (i, &w) in kvq_quant_core::pack::planes(bits).iter().enumerate() {
        let w = usize::from(w);
        let plane = &row[at..at + (d * w).div_ceil(8)];
        if i == 0 {
            // SAFETY: as this function's.
            unsafe { unpack_plane(plane, d, w, out) };
        } else {
            // SAFETY: as this function's; 16-byte runs up to d + 15 < GENERIC_BUF.
            unsafe {
                unpack_plane(plane, d, w, tmp);
                let sh = _mm_cvtsi32_si128(shift as i32);
                for c in (0..d).step_by(16) {
                    let (o, t) = (out.as_mut_ptr().add(c), tmp.as_ptr().add(c));
                    // Codes of `w` bits shifted under 8 - w: no bit leaves its byte.
                    let x =
                        _mm_or_si128(_mm_loadu_si128(o.cast()), _mm_sll_epi16(_mm_loadu_si128(t.cast()), sh));
                    _mm_storeu_si128(o.cast(), x);
                }
            }
        }
        at += (d * w).div_ceil(8);
        shift += w;
    }
}

/// 8 unpacked codes from `p` as floats.
///
/// # Safety
/// The CPU must support AVX2; `p` points at 8 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn codes8(p: *const u8) -> __m256 {
    // SAFETY: as this function's.
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))) }
}

/// The query rows of `q` (`n_q` rows of `d` floats, `d` a multiple of 8) in the bit order of a
/// packed row, for [`generic_dots`]: plane after plane, one float per code field, in the order
/// of the fields' bits (byte `j` of a chunk of stride `s` holds code `j + s·k` in bits `k·w`,
/// docs/formats.md "Codes: bit planes"), each times `2^shift` of its plane, so that a code's
/// planes are dotted apart and add up to the code. Rows of `planes · d` floats, into `w.q`;
/// the code of each field is computed once per `(d, bits)` and kept in `w`.
fn arrange_query(q: &[f32], n_q: usize, d: usize, bits: u8, w: &mut wide_backend::Arranged) {
    let planes = kvq_quant_core::pack::planes(bits);
    let len = planes.len() * d;
    let at = match w.codes.iter().position(|(shape, _)| *shape == (d, bits)) {
        Some(at) => at,
        None => {
            let mut codes = Vec::with_capacity(len);
            for &pw in planes {
                let m = 8 / usize::from(pw);
                let mut c = 0;
                while c < d {
                    // A chunk of `r` codes in `s` bytes (`r` a multiple of 8: `s = r / m`).
                    let r = (d - c).min(16 * m);
                    let s = r / m;
                    codes.extend((0..s).flat_map(|j| (0..m).map(move |k| (c + s * k + j) as u32)));
                    c += r;
                }
            }
            w.codes.push(((d, bits), codes));
            w.codes.len() - 1
        }
    };
    let codes = &w.codes[at].1;
    w.q.resize(n_q * len, 0.0);
    for (qi, o) in q.chunks_exact(d).zip(w.q.chunks_exact_mut(len)).take(n_q) {
        let mut shift = 0;
        for ((&pw, o), codes) in planes.iter().zip(o.chunks_exact_mut(d)).zip(codes.chunks_exact(d)) {
            let factor = f32::from(1u16 << shift);
            for (x, &c) in o.iter_mut().zip(codes) {
                *x = qi[c as usize] * factor;
            }
            shift += pw;
        }
    }
}

/// [`group_dots`] for the blocks only [`generic`] takes, on the query rows in bit order
/// ([`arrange_query`], `qa`): two rows per pass; each plane read `w` bytes (8 codes) at a time,
/// broadcast, shifted lane by lane (`vpsrlvd`), masked and converted to 8 floats against 8
/// arranged query floats: nothing is unpacked to memory and no lane is idle. One accumulator
/// per (query row, row), the `2·NQ` sums reduced together (as [`group_dots`]).
///
/// # Safety
/// The CPU must support AVX2 and FMA; `generic(b)`; `qa.len() == NQ · planes · b.dim`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn generic_dots<const NQ: usize>(
    b: &QuantBlock<'_>,
    qa: &[f32],
    mut emit: impl FnMut(usize, usize, f32),
) {
    let d = b.dim;
    let planes = kvq_quant_core::pack::planes(b.bits);
    let len = planes.len() * d;
    debug_assert_eq!(qa.len(), NQ * len);
    /// `w` bytes of a plane (8 fields of `w` bits) at `x` as 8 floats: 1-, 2- and 4-bit
    /// fields from one little-endian word broadcast and shifted lane by lane; bytes widened.
    /// Read through a pointer: bounds-checked slices of each row cost as many instructions as
    /// the vector work.
    ///
    /// # Safety
    /// The CPU must support AVX2; `x` points at `w` readable bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn fields(x: *const u8, w: usize, shifts: __m256i, mask: __m256i) -> __m256 {
        // SAFETY: as this function's; unaligned reads of exactly `w` bytes.
        let word = unsafe {
            match w {
                1 => i32::from(*x),
                2 => i32::from(u16::from_le(x.cast::<u16>().read_unaligned())),
                4 => i32::from_le(x.cast::<i32>().read_unaligned()),
                _ => {
                    let b8 = u64::from_le(x.cast::<u64>().read_unaligned());
                    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(b8 as i64)));
                }
            }
        };
        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask))
    }
    // What `QuantBlock::new` checked, restated for the reads through pointers below: whole
    // rows of `row_bytes`, each holding its planes' `d · w / 8` bytes.
    assert!(b.rows.checked_mul(b.row_bytes).is_some_and(|n| n <= b.codes.len()));
    assert_eq!(planes.iter().map(|&w| d * usize::from(w) / 8).sum::<usize>(), b.row_bytes);
    for r in (0..b.rows).step_by(2) {
        let r1 = (r + 1).min(b.rows - 1);
        let (row0, row1) = (b.row(r).as_ptr(), b.row(r1).as_ptr());
        // acc[2i + j]: query row i, block row r + j; the unused ones stay zero.
        let mut acc = [_mm256_setzero_ps(); 8];
        let (mut lane, mut byte) = (0, 0);
        for &w in planes {
            let w = usize::from(w);
            let mask = _mm256_set1_epi32((1 << w) - 1);
            let w32 = w as i32;
            let shifts = _mm256_setr_epi32(0, w32, 2 * w32, 3 * w32, 4 * w32, 5 * w32, 6 * w32, 7 * w32);
            for _ in 0..d / 8 {
                // SAFETY: AVX2 is enabled; byte + w <= row_bytes (the planes' bytes, asserted
                // above), in both rows.
                let (x0, x1) = unsafe {
                    (fields(row0.add(byte), w, shifts, mask), fields(row1.add(byte), w, shifts, mask))
                };
                for i in 0..NQ {
                    // SAFETY: lane + 8 <= len: query row i's 8 floats of these fields.
                    let qv = unsafe { _mm256_loadu_ps(qa.as_ptr().add(i * len + lane)) };
                    acc[2 * i] = _mm256_fmadd_ps(x0, qv, acc[2 * i]);
                    acc[2 * i + 1] = _mm256_fmadd_ps(x1, qv, acc[2 * i + 1]);
                }
                lane += 8;
                byte += w;
            }
        }
        // SAFETY: AVX2 is enabled.
        unsafe { emit_pairs::<NQ>(&acc, r, r1, &mut emit) };
    }
}

/// Hands the totals of a row pair's accumulators to `emit`: `acc[2i + j]` is query row `i`
/// against row `r` (`j = 0`) or `r1` (`j = 1`; emitted only when it is another row).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn emit_pairs<const NQ: usize>(
    acc: &[__m256; 8],
    r: usize,
    r1: usize,
    emit: &mut impl FnMut(usize, usize, f32),
) {
    // SAFETY: AVX2 is enabled.
    let sums = unsafe { reduce8(acc) };
    for i in 0..NQ {
        emit(i, r, sums[2 * i]);
        if r1 != r {
            emit(i, r1, sums[2 * i + 1]);
        }
    }
}

/// The totals of 8 accumulators, lane `k` of the result from `acc[k]`: hadd pairs twice, then
/// the 128-bit halves added crosswise.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn reduce8(acc: &[__m256; 8]) -> [f32; 8] {
    let g0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    let g1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    let sum = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(g0, g1), _mm256_permute2f128_ps::<0x31>(g0, g1));
    let mut sums = [0f32; 8];
    // SAFETY: `sums` holds 8 floats.
    unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), sum) };
    sums
}

/// [`group_axpy`] for the blocks only [`generic`] takes: `sums[i·dim + c] = Σ_r w[i·rows + r] ·
/// code_r[c]`, each row unpacked once.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `generic(b)`; `w.len() >= NQ · b.rows`; `sums.len() >=
/// NQ · b.dim`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn generic_axpy<const NQ: usize>(b: &QuantBlock<'_>, w: &[f32], sums: &mut [f32]) {
    let (d, rows) = (b.dim, b.rows);
    sums[..NQ * d].fill(0.0);
    let (mut codes, mut tmp) = ([0u8; GENERIC_BUF], [0u8; GENERIC_BUF]);
    for r in 0..rows {
        // SAFETY: row r is a whole packed row of d codes; AVX2 is enabled.
        unsafe { unpack_any(b.row(r), d, b.bits, &mut codes, &mut tmp) };
        let wr: [__m256; 4] =
            std::array::from_fn(|i| _mm256_set1_ps(if i < NQ { w[i * rows + r] } else { 0.0 }));
        for c in (0..d).step_by(8) {
            // SAFETY: c + 8 <= d; sums row i spans sums[i·d .. (i + 1)·d].
            unsafe {
                let x = codes8(codes.as_ptr().add(c));
                for (i, wi) in wr.iter().enumerate().take(NQ) {
                    let p = sums.as_mut_ptr().add(i * d + c);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(x, *wi, _mm256_loadu_ps(p)));
                }
            }
        }
    }
}

/// Runs `f(first query, queries in this group)` over the query rows in groups of up to 4.
fn in_groups_of_4(n_q: usize, mut f: impl FnMut(usize, usize)) {
    let mut i = 0;
    while i < n_q {
        let n = (n_q - i).min(4);
        f(i, n);
        i += n;
    }
}

/// Dispatches `$f::<BITS, NQ, K, GROUPED>` on a block's runtime width, query group size (1 to
/// 3, else 4) and [`LutKind`], one monomorphization per layout a [`QuantBlock`] can have: codes
/// and symmetric levels of 2, 3, 4 and 8 bits, tables of `2^bits` levels (8 entries at most:
/// `vpermps`; 16: byte planes, [`levels16`]; 256: a gather) and FP8 (8-bit codes).
macro_rules! by_layout {
    ($f:ident, $grouped:expr, $bits:expr, $kind:expr, $nq:expr, $args:tt) => {
        match $nq {
            1 => by_layout!(@kind $f, $grouped, $bits, $kind, 1, $args),
            2 => by_layout!(@kind $f, $grouped, $bits, $kind, 2, $args),
            3 => by_layout!(@kind $f, $grouped, $bits, $kind, 3, $args),
            _ => by_layout!(@kind $f, $grouped, $bits, $kind, 4, $args),
        }
    };
    (@kind $f:ident, $g:expr, $bits:expr, $kind:expr, $nq:literal, ($($arg:expr),*)) => {
        match ($bits, $kind) {
            (8, LutKind::Codes) => $f::<8, $nq, CODES, $g>($($arg),*),
            (8, LutKind::Shifted) => $f::<8, $nq, SHIFTED, $g>($($arg),*),
            (8, LutKind::Gather) => $f::<8, $nq, GATHER, $g>($($arg),*),
            (8, LutKind::E4m3) => $f::<8, $nq, E4M3, $g>($($arg),*),
            (8, LutKind::E4m3Any) => $f::<8, $nq, E4M3_ANY, $g>($($arg),*),
            (8, LutKind::E5m2) => $f::<8, $nq, E5M2, $g>($($arg),*),
            (4, LutKind::Codes) => $f::<4, $nq, CODES, $g>($($arg),*),
            (4, LutKind::Shifted) => $f::<4, $nq, SHIFTED, $g>($($arg),*),
            (4, LutKind::Permute16) => $f::<4, $nq, PERMUTE16, $g>($($arg),*),
            (3, LutKind::Codes) => $f::<3, $nq, CODES, $g>($($arg),*),
            (3, LutKind::Shifted) => $f::<3, $nq, SHIFTED, $g>($($arg),*),
            (3, LutKind::Permute8) => $f::<3, $nq, PERMUTE8, $g>($($arg),*),
            (2, LutKind::Codes) => $f::<2, $nq, CODES, $g>($($arg),*),
            (2, LutKind::Shifted) => $f::<2, $nq, SHIFTED, $g>($($arg),*),
            (2, LutKind::Permute8) => $f::<2, $nq, PERMUTE8, $g>($($arg),*),
            // `QuantBlock::new` gives a table 2^bits entries and FP8 8-bit codes, and `fast`
            // takes 2, 3, 4 and 8 bits only.
            _ => unreachable!("no {}-bit block has this kind of levels", $bits),
        }
    };
}

/// [`wide_backend::fold_channels`] 8 lanes at a time: `qw = q · scale` row by row, and each row's
/// `Σ q · offset` (0 without offsets) in `cst`.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn fold_channels(
    q: &[f32],
    n_q: usize,
    scale: &[f32],
    offset: Option<&[f32]>,
    qw: &mut Vec<f32>,
    cst: &mut Vec<f32>,
) {
    let d = scale.len();
    assert!(q.len() >= n_q * d && offset.is_none_or(|o| o.len() == d), "one parameter per channel");
    let body = d / 8 * 8;
    qw.resize(n_q * d, 0.0);
    cst.resize(n_q, 0.0);
    for ((qi, wi), c) in q.chunks_exact(d).zip(qw.chunks_exact_mut(d)).zip(cst.iter_mut()).take(n_q) {
        let mut acc = _mm256_setzero_ps();
        for k in (0..body).step_by(8) {
            // SAFETY: k + 8 <= body <= d, the length of `qi`, `wi`, `scale` and `offset`
            // (callers pass a block's parameters: one per channel).
            unsafe {
                let x = _mm256_loadu_ps(qi.as_ptr().add(k));
                _mm256_storeu_ps(
                    wi.as_mut_ptr().add(k),
                    _mm256_mul_ps(x, _mm256_loadu_ps(scale.as_ptr().add(k))),
                );
                if let Some(o) = offset {
                    acc = _mm256_fmadd_ps(x, _mm256_loadu_ps(o.as_ptr().add(k)), acc);
                }
            }
        }
        for k in body..d {
            wi[k] = qi[k] * scale[k];
        }
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        let tail: f32 = offset.map_or(0.0, |o| (body..d).map(|k| qi[k] * o[k]).sum());
        *c = lanes.iter().sum::<f32>() + tail;
    }
}

/// Scores of every query row, up to 4 at a time: see [`scores`]. Compiled with AVX2, so that
/// the per-block work around the kernels (the per-channel scales folded into the query, the
/// parameters applied to the dots) runs 8 lanes wide.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `supported(b)`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_group(
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
    w: &mut wide_backend::Scratch,
) {
    let (d, rows) = (b.dim, b.rows);
    assert!(out.len() >= n_q * rows, "callers checked the output's length");
    // The kernels store raw dots, `out[i · rows + r]`; each block's parameters are applied
    // after, in plain loops over the rows. (A closure that scales each dot as it is emitted
    // costs the kernel its registers: 45% of the INT4 dots' time went to that epilogue.)
    // The sink is a raw pointer, copied into the closure, so the store is one instruction.
    let base = out.as_mut_ptr();
    let raw = |i0: usize| {
        move |i: usize, r: usize, dot: f32| {
            // SAFETY: i0 + i < n_q and r < rows, so the index is below n_q · rows <=
            // out.len(), asserted above; `out` is not otherwise touched meanwhile.
            unsafe { *base.add((i0 + i) * rows + r) = dot }
        }
    };
    let qw;
    let q = match b.params {
        Params::PerChannel { scale, offset } => {
            // SAFETY: AVX2 and FMA are enabled by this function's target features.
            unsafe { fold_channels(q, n_q, scale, offset, &mut w.qw, &mut w.cst) };
            qw = &w.qw;
            qw.as_slice()
        }
        _ => q,
    };
    let any_width = !fast(b);
    let len = kvq_quant_core::pack::planes(b.bits).len() * d;
    if any_width {
        arrange_query(q, n_q, d, b.bits, &mut w.arranged);
    }
    let arranged = &w.arranged.q;
    // SAFETY: AVX2 is enabled by this function's target features.
    let kind = unsafe { kernel_kind(b) };
    in_groups_of_4(n_q, |i0, n| {
        let qg = &q[i0 * d..(i0 + n) * d];
        // SAFETY: callers checked `supported(b)` (per-group blocks: groups of a multiple of
        // 16; blocks the chunked kernels do not take: `generic(b)`); `qg` holds n query rows.
        unsafe {
            if any_width {
                by_group!(generic_dots, n, (b, &arranged[i0 * len..(i0 + n) * len], raw(i0)))
            } else if matches!(b.params, Params::PerGroup { .. }) {
                by_layout!(group_dots, true, b.bits, kind, n, (b, qg, raw(i0)))
            } else {
                by_layout!(group_dots, false, b.bits, kind, n, (b, qg, raw(i0)))
            }
        }
    });
    // e4m3 levels came as their value / 2^8 (a per-group block's scales carried the factor).
    let unit = unit_of(b);
    if unit != 1.0 && !matches!(b.params, Params::PerGroup { .. }) {
        out[..n_q * rows].iter_mut().for_each(|x| *x *= unit);
    }
    match b.params {
        Params::PerRow { scale, offset } => {
            for (qi, o) in q.chunks_exact(d).zip(out.chunks_exact_mut(rows)) {
                match offset {
                    Some(off) => {
                        // In 8 lanes: a serial sum would cost more than the block's dots.
                        let qsum = wide_backend::sum_lanes(qi);
                        for ((x, &s), &f) in o.iter_mut().zip(scale).zip(off) {
                            *x = s * *x + f * qsum;
                        }
                    }
                    None => o.iter_mut().zip(scale).for_each(|(x, &s)| *x *= s),
                }
            }
        }
        Params::PerChannel { .. } => {
            for (o, &c) in out.chunks_exact_mut(rows).zip(&w.cst).take(n_q) {
                o.iter_mut().for_each(|x| *x += c);
            }
        }
        Params::PerGroup { .. } => {}
    }
}

/// Value accumulation of every query row, up to 4 at a time (see [`axpy`]), compiled with
/// AVX2 so that the weights' and the epilogue's loops (once per block in decode) vectorize 8
/// wide.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `supported(b)`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_group_with(
    b: &QuantBlock<'_>,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
    sums: &mut Vec<f32>,
    w: &mut Vec<f32>,
) {
    let (d, rows) = (b.dim, b.rows);
    sums.resize(4 * d, 0.0);
    w.resize(4 * rows, 0.0);
    let any_width = !fast(b);
    // SAFETY: AVX2 is enabled by this function's target features.
    let kind = unsafe { kernel_kind(b) };
    // e4m3 levels come as their value / 2^8: the factor goes into the weights or the
    // per-channel scales (a per-group block's scales carry it in the kernel).
    let unit = unit_of(b);
    // A loop rather than `in_groups_of_4`: the body stays in this function's AVX2 code.
    let mut i0 = 0;
    while i0 < n_q {
        let n = (n_q - i0).min(4);
        let pg = &p[i0 * rows..(i0 + n) * rows];
        match b.params {
            // o_i += Σ_r (p_ir · scale_r) · code_r + Σ_r p_ir · offset_r.
            Params::PerRow { scale, offset } => {
                for (wi, pi) in w.chunks_exact_mut(rows).zip(pg.chunks_exact(rows)) {
                    for ((x, &pr), &s) in wi.iter_mut().zip(pi).zip(scale) {
                        *x = pr * (s * unit);
                    }
                }
                // SAFETY: callers checked `supported(b)` (`generic(b)` where not `fast(b)`);
                // `w` holds n · rows weights and `sums` 4 · dim floats.
                unsafe {
                    if any_width {
                        by_group!(generic_axpy, n, (b, w, sums))
                    } else {
                        by_layout!(group_axpy, false, b.bits, kind, n, (b, w, sums))
                    }
                }
                for (i, pi) in pg.chunks_exact(rows).enumerate() {
                    let bias: f32 = offset.map_or(0.0, |o| wide_backend::dot_lanes(pi, o));
                    for (o, &x) in
                        out[(i0 + i) * d..(i0 + i + 1) * d].iter_mut().zip(&sums[i * d..(i + 1) * d])
                    {
                        *o += x + bias;
                    }
                }
            }
            // o_i[c] += scale[c] · Σ_r p_ir · code_r[c] + offset[c] · Σ_r p_ir.
            Params::PerChannel { scale, offset } => {
                // SAFETY: as above, with the probabilities themselves as weights.
                unsafe {
                    if any_width {
                        by_group!(generic_axpy, n, (b, pg, sums))
                    } else {
                        by_layout!(group_axpy, false, b.bits, kind, n, (b, pg, sums))
                    }
                }
                for (i, pi) in pg.chunks_exact(rows).enumerate() {
                    let psum: f32 = wide_backend::sum_lanes(pi);
                    let o = &mut out[(i0 + i) * d..(i0 + i + 1) * d];
                    for (c, (o, &x)) in o.iter_mut().zip(&sums[i * d..(i + 1) * d]).enumerate() {
                        *o += x * (scale[c] * unit) + offset.map_or(0.0, |f| f[c]) * psum;
                    }
                }
            }
            // o_i += Σ_r p_ir · x̂_r, the rows decoded with their groups' parameters.
            Params::PerGroup { .. } => {
                // SAFETY: callers checked `supported(b)` (groups of a multiple of 16).
                unsafe { by_layout!(group_axpy, true, b.bits, kind, n, (b, pg, sums)) }
                for (i, o) in out[i0 * d..(i0 + n) * d].chunks_exact_mut(d).enumerate() {
                    for (o, &x) in o.iter_mut().zip(&sums[i * d..(i + 1) * d]) {
                        *o += x;
                    }
                }
            }
        }
        i0 += n;
    }
}

/// See [`crate::scalar::scores`]. Falls back to the `wide` kernels for layouts it does not cover.
pub(crate) fn scores_in(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &mut [f32], w: &mut crate::Scratch) {
    if !supported(b) {
        return wide_backend::scores_in(b, q, n_q, out, &mut w.wide);
    }
    // SAFETY: `supported(b)` checked the CPU (AVX2, FMA, F16C) and the layout.
    unsafe { scores_group(b, q, n_q, out, &mut w.wide) }
}

/// See [`crate::scalar::axpy`]. Falls back to the `wide` kernels for layouts it does not cover.
pub(crate) fn axpy_in(b: &QuantBlock<'_>, p: &[f32], n_q: usize, out: &mut [f32], w: &mut crate::Scratch) {
    if !supported(b) {
        return wide_backend::axpy_in(b, p, n_q, out, &mut w.wide);
    }
    // The kernel walks a block column by column, reading every row once per 16 channels: right
    // for a cache block (its rows stay in L1), a re-read of memory for a block of millions of
    // rows. Those go through in slices of `AXPY_ROWS`.
    const AXPY_ROWS: usize = 64;
    let crate::Scratch { sums, w, weights, .. } = w;
    if b.rows <= AXPY_ROWS {
        // SAFETY: `supported(b)` checked AVX2 and FMA.
        return unsafe { axpy_group_with(b, p, n_q, out, sums, w) };
    }
    let mut r0 = 0;
    while r0 < b.rows {
        let r = r0..(r0 + AXPY_ROWS).min(b.rows);
        weights.clear();
        for i in 0..n_q {
            weights.extend_from_slice(&p[i * b.rows + r.start..i * b.rows + r.end]);
        }
        // SAFETY: as above.
        unsafe { axpy_group_with(&b.sub_rows(r.clone()), weights, n_q, out, sums, w) };
        r0 = r.end;
    }
}

/// `Σ a · b` over `n` floats with FMA in 16 lanes, then the lanes, then a scalar tail.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `a` and `b` hold `n` floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn fma_dot(a: *const f32, b: *const f32, n: usize) -> f32 {
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut c = 0;
    // SAFETY: every load reads floats c .. c + 16 (or + 8) < n of both slices.
    unsafe {
        while c + 16 <= n {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(c)), _mm256_loadu_ps(b.add(c)), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(c + 8)), _mm256_loadu_ps(b.add(c + 8)), s1);
            c += 16;
        }
        if c + 8 <= n {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(c)), _mm256_loadu_ps(b.add(c)), s0);
            c += 8;
        }
    }
    let s = _mm256_add_ps(s0, s1);
    let h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let mut sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
    while c < n {
        // SAFETY: c < n.
        sum += unsafe { *a.add(c) * *b.add(c) };
        c += 1;
    }
    sum
}

/// The first multiple of 8 of `out`'s values widened from the f16 `bytes` with `vcvtph2ps`
/// when the CPU has F16C (the count returned; 0 without it): [`crate::widen_f16`]'s fast part.
pub(crate) fn widen_f16(bytes: &[u8], out: &mut [f32]) -> usize {
    if !cpu_ok() {
        return 0;
    }
    // SAFETY: F16C (which implies AVX) was detected (`cpu_ok`).
    unsafe { widen_f16_f16c(bytes, out) }
}

/// # Safety
/// The CPU must support F16C.
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16_f16c(bytes: &[u8], out: &mut [f32]) -> usize {
    let n = out.len().min(bytes.len() / 2) / 8 * 8;
    for (o, b) in out[..n].chunks_exact_mut(8).zip(bytes.chunks_exact(16)) {
        // SAFETY: `b` holds 16 bytes (unaligned load) and `o` 8 floats (unaligned store).
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().cast()))) };
    }
    n
}

/// The first multiple of 8 of the one-byte parameter pairs `(mins[i], maxs[i])` widened on
/// their grid into `scales` and `offsets` with AVX2 (the count returned; 0 without it):
/// [`crate::widen_grid`]'s fast part, the same operations per value as
/// [`ParamGrid::widen`] (a product, then a sum: not fused), so the same bits.
pub(crate) fn widen_grid(
    grid: &ParamGrid,
    mins: &[u8],
    maxs: &[u8],
    levels: f32,
    scales: &mut [f32],
    offsets: &mut [f32],
) -> usize {
    if !cpu_ok() {
        return 0;
    }
    // SAFETY: AVX2 was checked just above.
    unsafe { widen_grid_avx2(grid, mins, maxs, levels, scales, offsets) }
}

/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
unsafe fn widen_grid_avx2(
    grid: &ParamGrid,
    mins: &[u8],
    maxs: &[u8],
    levels: f32,
    scales: &mut [f32],
    offsets: &mut [f32],
) -> usize {
    let n = mins.len().min(maxs.len()).min(scales.len()).min(offsets.len()) / 8 * 8;
    let (lo, step) = grid.origin_step();
    let (lov, stepv, unit) = (_mm256_set1_ps(lo), _mm256_set1_ps(step), _mm256_set1_ps(step / levels));
    for i in (0..n).step_by(8) {
        // SAFETY: i + 8 <= n: eight bytes of `mins` and `maxs` (unaligned loads), eight floats
        // of `scales` and `offsets` (unaligned stores).
        unsafe {
            let a = _mm_loadl_epi64(mins.as_ptr().add(i).cast());
            let b = _mm_loadl_epi64(maxs.as_ptr().add(i).cast());
            // `b.saturating_sub(a)` on the bytes, then each byte to i32 and to float (exact).
            let width = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_subs_epu8(b, a)));
            let a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
            _mm256_storeu_ps(offsets.as_mut_ptr().add(i), _mm256_add_ps(lov, _mm256_mul_ps(stepv, a)));
            _mm256_storeu_ps(scales.as_mut_ptr().add(i), _mm256_mul_ps(width, unit));
        }
    }
    n
}

/// Whether the AVX2 turn kernels take `t`: the CPU features, rows of a multiple of 32
/// channels, codes of 8 bits (a byte each) or 4 (two per byte, in whole 32-code chunks).
fn turn_supported(t: &crate::TurnRows<'_>) -> bool {
    cpu_ok() && t.dim.is_multiple_of(32) && matches!(t.bits, 4 | 8)
}

/// [`crate::decode_turn_with`] with AVX2 and FMA, reading 4- and 8-bit rows where they are
/// packed; false (nothing written) when [`turn_supported`] says no. The caller checked the
/// lengths.
pub(crate) fn decode_turn(t: &crate::TurnRows<'_>, out: &mut [f32]) -> bool {
    if !turn_supported(t) {
        return false;
    }
    let (d, rb) = (t.dim, t.row_bytes());
    let rows = out.len() / d;
    assert!(
        t.codes.len() == rows * rb
            && t.scale.len() == d
            && t.offset.len() == d
            && t.table.len() >= rows * 2 * d
    );
    let half = matches!(t.pairing, kvq_quant_core::RopePairing::Half);
    for (r, y) in out.chunks_exact_mut(d).enumerate() {
        let (c, tab) = (t.codes[r * rb..].as_ptr(), t.table[r * 2 * d..].as_ptr());
        for j in (0..if half { d / 2 } else { d }).step_by(8) {
            // SAFETY: AVX2, FMA and F16C were checked; channels j..j+8 (and h+j..h+j+8 for
            // rotate-half rows) lie within the row's codes, its parameters, its table and `y`.
            unsafe {
                let (s, o) = (t.scale.as_ptr(), t.offset.as_ptr());
                let (lo, hi) = match (t.bits == 4, half) {
                    (true, true) => turned8::<true, true>(c, s, o, tab, d, j),
                    (true, false) => turned8::<true, false>(c, s, o, tab, d, j),
                    (false, true) => turned8::<false, true>(c, s, o, tab, d, j),
                    (false, false) => turned8::<false, false>(c, s, o, tab, d, j),
                };
                _mm256_storeu_ps(y.as_mut_ptr().add(j), lo);
                if half {
                    _mm256_storeu_ps(y.as_mut_ptr().add(d / 2 + j), hi);
                }
            }
        }
    }
    true
}

/// [`crate::scores_turn_with`] with AVX2 and FMA: two rows against four query rows at a time,
/// each row decoded and turned in registers and never stored; false (nothing written) when
/// [`turn_supported`] says no.
pub(crate) fn scores_turn(t: &crate::TurnRows<'_>, q: &[f32], n_q: usize, out: &mut [f32]) -> bool {
    if !turn_supported(t) {
        return false;
    }
    let (d, rb, n) = (t.dim, t.row_bytes(), t.rows());
    assert!(
        t.codes.len() == n * rb && t.scale.len() == d && t.offset.len() == d && t.table.len() >= n * 2 * d
    );
    assert!(q.len() == n_q * d && out.len() == n_q * n);
    let half = matches!(t.pairing, kvq_quant_core::RopePairing::Half);
    for i0 in (0..n_q).step_by(4) {
        let m = (n_q - i0).min(4);
        // Missing query rows repeat the first; their sums are dropped.
        let qs: [&[f32]; 4] = std::array::from_fn(|k| &q[(i0 + if k < m { k } else { 0 }) * d..][..d]);
        for r0 in (0..n).step_by(2) {
            let r1 = if r0 + 1 < n { r0 + 1 } else { r0 };
            let row = |r: usize| (&t.codes[r * rb..(r + 1) * rb], &t.table[r * 2 * d..(r + 1) * 2 * d]);
            // SAFETY: AVX2, FMA and F16C were checked; each row holds its packed codes of d
            // channels (a multiple of 32) and 2d table values, each query row and the
            // parameters d values.
            let sums = unsafe {
                match (t.bits == 4, half) {
                    (true, true) => turn_dot2::<true, true>(row(r0), row(r1), t.scale, t.offset, qs, d),
                    (true, false) => turn_dot2::<true, false>(row(r0), row(r1), t.scale, t.offset, qs, d),
                    (false, true) => turn_dot2::<false, true>(row(r0), row(r1), t.scale, t.offset, qs, d),
                    (false, false) => turn_dot2::<false, false>(row(r0), row(r1), t.scale, t.offset, qs, d),
                }
            };
            for k in 0..m {
                out[(i0 + k) * n + r0] = sums[k];
                if r1 != r0 {
                    out[(i0 + k) * n + r1] = sums[4 + k];
                }
            }
        }
    }
    true
}

/// Channels `at..at + 8` of a packed row decoded as `code · scale + offset`: bytes
/// (`NIB = false`), or 4-bit codes (`NIB = true`: chunks of 32 codes in 16 bytes, code
/// `j < 16` in the low nibble of byte `j`, code `16 + j` in its high nibble).
///
/// # Safety
/// AVX2 and FMA; `at` is a multiple of 8 and the row holds channel `at + 7` (in whole 32-code
/// chunks for nibbles); `s` and `o` hold 8 values from `at`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode8<const NIB: bool>(c: *const u8, s: *const f32, o: *const f32, at: usize) -> __m256 {
    // SAFETY: as this function's; 8 bytes from `at` (bytes) or from the chunk's byte `at % 16`
    // (nibbles, which stays within the chunk's 16 bytes).
    unsafe {
        let bytes = if NIB {
            let within = at % 32;
            let raw = _mm_loadl_epi64(c.add(at / 32 * 16 + within % 16).cast());
            let raw = if within >= 16 { _mm_srli_epi16::<4>(raw) } else { raw };
            _mm_and_si128(raw, _mm_set1_epi8(0x0f))
        } else {
            _mm_loadl_epi64(c.add(at).cast())
        };
        let codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        _mm256_fmadd_ps(codes, _mm256_loadu_ps(s.add(at)), _mm256_loadu_ps(o.add(at)))
    }
}

/// Eight channels from `j` of a row decoded and turned: `(lo, hi)` for rotate-half pairs (the
/// channels `j..j+8` and `h+j..h+j+8`), or the eight channels `j..j+8` twice for interleaved
/// pairs (`HALF` false).
///
/// # Safety
/// As [`decode8`] for every channel read; `t` holds the row's `2d` table values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn turned8<const NIB: bool, const HALF: bool>(
    c: *const u8,
    s: *const f32,
    o: *const f32,
    t: *const f32,
    d: usize,
    j: usize,
) -> (__m256, __m256) {
    // SAFETY: as this function's.
    unsafe {
        if HALF {
            let h = d / 2;
            let (lo, hi) = (decode8::<NIB>(c, s, o, j), decode8::<NIB>(c, s, o, h + j));
            let (cl, ch) = (_mm256_loadu_ps(t.add(j)), _mm256_loadu_ps(t.add(h + j)));
            let (sl, sh) = (_mm256_loadu_ps(t.add(d + j)), _mm256_loadu_ps(t.add(d + h + j)));
            (_mm256_fmadd_ps(hi, sl, _mm256_mul_ps(lo, cl)), _mm256_fmadd_ps(lo, sh, _mm256_mul_ps(hi, ch)))
        } else {
            let x = decode8::<NIB>(c, s, o, j);
            let swapped = _mm256_permute_ps::<0b10_11_00_01>(x);
            let (cos, sin) = (_mm256_loadu_ps(t.add(j)), _mm256_loadu_ps(t.add(d + j)));
            let y = _mm256_fmadd_ps(swapped, sin, _mm256_mul_ps(x, cos));
            (y, y)
        }
    }
}

/// The dots of two decoded and turned rows (`(packed codes, table)` each) with four query
/// rows: `[row 0 · q0..q3, row 1 · q0..q3]`.
///
/// # Safety
/// AVX2, FMA and F16C; each row holds the packed codes of `d` channels (a multiple of 32) and
/// `2d` table values; `scale`, `offset` and every query row `d` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn turn_dot2<const NIB: bool, const HALF: bool>(
    a: (&[u8], &[f32]),
    b: (&[u8], &[f32]),
    scale: &[f32],
    offset: &[f32],
    qs: [&[f32]; 4],
    d: usize,
) -> [f32; 8] {
    let (s, o) = (scale.as_ptr(), offset.as_ptr());
    let q = qs.map(|x| x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    // Rotate-half rows take 8 channels of each half per step; interleaved rows 8 in a row.
    let (end, h) = if HALF { (d / 2, d / 2) } else { (d, 0) };
    let mut j = 0;
    while j < end {
        // SAFETY: j + 8 <= end: every channel read lies within the rows, the parameters, the
        // tables and the query rows.
        unsafe {
            let (lo0, hi0) = turned8::<NIB, HALF>(a.0.as_ptr(), s, o, a.1.as_ptr(), d, j);
            let (lo1, hi1) = turned8::<NIB, HALF>(b.0.as_ptr(), s, o, b.1.as_ptr(), d, j);
            for k in 0..4 {
                let ql = _mm256_loadu_ps(q[k].add(j));
                acc[k] = _mm256_fmadd_ps(lo0, ql, acc[k]);
                acc[4 + k] = _mm256_fmadd_ps(lo1, ql, acc[4 + k]);
                if HALF {
                    let qh = _mm256_loadu_ps(q[k].add(h + j));
                    acc[k] = _mm256_fmadd_ps(hi0, qh, acc[k]);
                    acc[4 + k] = _mm256_fmadd_ps(hi1, qh, acc[4 + k]);
                }
            }
        }
        j += 8;
    }
    // SAFETY: AVX2 is enabled.
    unsafe { reduce8(&acc) }
}

/// Eight floats of a full-precision row from element `at` of `x`: f32 (`HALF = false`) or f16
/// widened in the register (`vcvtph2ps`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; elements `at .. at + 8` of `x` (f32 or f16 as
/// `HALF` says) lie within its allocation.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<const HALF: bool>(x: *const u8, at: usize) -> __m256 {
    // SAFETY: as this function's.
    unsafe {
        if HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(x.add(at * 2).cast()))
        } else {
            _mm256_loadu_ps(x.cast::<f32>().add(at))
        }
    }
}

/// Scores against full-precision rows: see [`crate::scalar::dense_scores`]. Rows of a
/// multiple of 8 go through [`dense_scores_tile`], up to four query rows against two rows at a
/// time; other lengths dot row by row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the slices have the lengths the caller checked.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_scores_fma(x: &[f32], rows: usize, dim: usize, q: &[f32], n_q: usize, out: &mut [f32]) {
    if !dim.is_multiple_of(8) {
        for r in 0..rows {
            for i in 0..n_q {
                // SAFETY: row r of x and query row i of q each hold dim floats.
                out[i * rows + r] = unsafe { fma_dot(x.as_ptr().add(r * dim), q.as_ptr().add(i * dim), dim) };
            }
        }
        return;
    }
    // SAFETY: dim is a multiple of 8; x holds rows · dim floats.
    unsafe { dense_scores_tiles::<false>(x.as_ptr().cast(), rows, dim, q, n_q, out) }
}

/// [`dense_scores_tile`] over the query rows four at a time.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `dim % 8 == 0`; `x` holds `rows · dim` elements
/// (f32 or f16 as `HALF` says), `q` `n_q · dim` floats, `out` `n_q · rows`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_scores_tiles<const HALF: bool>(
    x: *const u8,
    rows: usize,
    dim: usize,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) {
    let mut i0 = 0;
    while i0 < n_q {
        let (qs, o) = (&q[i0 * dim..], &mut out[i0 * rows..]);
        // SAFETY: as this function's; `qs` holds the query rows from i0 on, `o` their scores.
        unsafe {
            match n_q - i0 {
                1 => dense_scores_tile::<1, HALF>(x, rows, dim, qs, o),
                2 => dense_scores_tile::<2, HALF>(x, rows, dim, qs, o),
                3 => dense_scores_tile::<3, HALF>(x, rows, dim, qs, o),
                _ => dense_scores_tile::<4, HALF>(x, rows, dim, qs, o),
            }
        }
        i0 += 4;
    }
}

/// `out[i · rows + r] = q_i · x_r` for the first `NQ` query rows of `q`: two rows of `x` at a
/// time, each 8-value chunk of them loaded (and widened) once and multiplied by the `NQ` query
/// chunks, so that `2 · NQ` FMA chains run side by side and each row is read once for the group.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `dim % 8 == 0`; `x` holds `rows · dim` elements,
/// `q` at least `NQ · dim` floats, `out` at least `(NQ - 1) · rows + rows`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_scores_tile<const NQ: usize, const HALF: bool>(
    x: *const u8,
    rows: usize,
    dim: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let sum = |v: __m256| {
        let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)))
    };
    let qp = q.as_ptr();
    let mut r = 0;
    while r + 2 <= rows {
        let mut acc = [[_mm256_setzero_ps(); NQ]; 2];
        for c in (0..dim).step_by(8) {
            // SAFETY: c + 8 <= dim; rows r and r + 1 lie within x, query rows i < NQ within q.
            unsafe {
                let (x0, x1) = (load8::<HALF>(x, r * dim + c), load8::<HALF>(x, (r + 1) * dim + c));
                let [a0, a1] = &mut acc;
                for (i, (s0, s1)) in a0.iter_mut().zip(a1.iter_mut()).enumerate() {
                    let qv = _mm256_loadu_ps(qp.add(i * dim + c));
                    *s0 = _mm256_fmadd_ps(x0, qv, *s0);
                    *s1 = _mm256_fmadd_ps(x1, qv, *s1);
                }
            }
        }
        for i in 0..NQ {
            out[i * rows + r] = sum(acc[0][i]);
            out[i * rows + r + 1] = sum(acc[1][i]);
        }
        r += 2;
    }
    if r < rows {
        let mut acc = [_mm256_setzero_ps(); NQ];
        for c in (0..dim).step_by(8) {
            // SAFETY: as above, for the last row.
            unsafe {
                let x0 = load8::<HALF>(x, r * dim + c);
                for (i, s0) in acc.iter_mut().enumerate() {
                    *s0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(qp.add(i * dim + c)), *s0);
                }
            }
        }
        for (i, &a) in acc.iter().enumerate() {
            out[i * rows + r] = sum(a);
        }
    }
}

/// Values from full-precision rows: see [`crate::scalar::dense_axpy`]. Rows of a multiple of
/// 16 go through [`dense_axpy_tile`]; other lengths row by row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the slices have the lengths the caller checked.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_axpy_fma(x: &[f32], rows: usize, dim: usize, p: &[f32], n_q: usize, out: &mut [f32]) {
    if dim.is_multiple_of(16) {
        // SAFETY: dim is a multiple of 16; x holds rows · dim floats.
        unsafe { dense_axpy_tiles::<false>(x.as_ptr().cast(), rows, dim, p, n_q, out) };
        return;
    }
    for i in 0..n_q {
        let o = &mut out[i * dim..(i + 1) * dim];
        for r in 0..rows {
            let (w, xr) = (p[i * rows + r], &x[r * dim..(r + 1) * dim]);
            let wv = _mm256_set1_ps(w);
            let mut c = 0;
            while c + 8 <= dim {
                // SAFETY: floats c .. c + 8 lie within `o` and `xr` (both dim long).
                unsafe {
                    let po = o.as_mut_ptr().add(c);
                    _mm256_storeu_ps(
                        po,
                        _mm256_fmadd_ps(_mm256_loadu_ps(xr.as_ptr().add(c)), wv, _mm256_loadu_ps(po)),
                    );
                }
                c += 8;
            }
            for (ov, &xv) in o[c..].iter_mut().zip(&xr[c..]) {
                *ov += w * xv;
            }
        }
    }
}

/// [`dense_axpy_tile`] over the query rows four at a time.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `dim % 16 == 0`; `x` holds `rows · dim` elements
/// (f32 or f16 as `HALF` says), `p` `n_q · rows` floats, `out` `n_q · dim`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_axpy_tiles<const HALF: bool>(
    x: *const u8,
    rows: usize,
    dim: usize,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
) {
    let mut i0 = 0;
    while i0 < n_q {
        let (ps, o) = (&p[i0 * rows..], &mut out[i0 * dim..]);
        // SAFETY: as this function's; `ps` holds the weights of the query rows from i0 on,
        // `o` their outputs.
        unsafe {
            match n_q - i0 {
                1 => dense_axpy_tile::<1, HALF>(x, rows, dim, ps, o),
                2 => dense_axpy_tile::<2, HALF>(x, rows, dim, ps, o),
                3 => dense_axpy_tile::<3, HALF>(x, rows, dim, ps, o),
                _ => dense_axpy_tile::<4, HALF>(x, rows, dim, ps, o),
            }
        }
        i0 += 4;
    }
}

/// Rows per span of [`dense_axpy_tile`].
const DENSE_SPAN: usize = 32;

/// `out[i · dim + c] += Σ_r p[i · rows + r] · x[r · dim + c]` for the first `NQ` query rows:
/// 16 output columns of every query row held in registers while a span of rows passes, so that
/// each part of a row is loaded (and widened) once for the whole group. Spans of
/// [`DENSE_SPAN`] rows (16 KiB of f32 at head_dim 128) keep the column passes in L1.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `dim % 16 == 0`; `x` holds `rows · dim` elements,
/// `p` at least `(NQ - 1) · rows + rows` floats, `out` at least `NQ · dim`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_axpy_tile<const NQ: usize, const HALF: bool>(
    x: *const u8,
    rows: usize,
    dim: usize,
    p: &[f32],
    out: &mut [f32],
) {
    let (pp, op) = (p.as_ptr(), out.as_mut_ptr());
    for r0 in (0..rows).step_by(DENSE_SPAN) {
        for c in (0..dim).step_by(16) {
            // SAFETY: c + 16 <= dim; output rows i < NQ lie within out.
            let mut acc: [[__m256; 2]; NQ] = std::array::from_fn(|i| unsafe {
                [_mm256_loadu_ps(op.add(i * dim + c)), _mm256_loadu_ps(op.add(i * dim + c + 8))]
            });
            for r in r0..rows.min(r0 + DENSE_SPAN) {
                // SAFETY: row r lies within x, weight i · rows + r within p.
                unsafe {
                    let (x0, x1) = (load8::<HALF>(x, r * dim + c), load8::<HALF>(x, r * dim + c + 8));
                    for (i, a) in acc.iter_mut().enumerate() {
                        let w = _mm256_broadcast_ss(&*pp.add(i * rows + r));
                        a[0] = _mm256_fmadd_ps(x0, w, a[0]);
                        a[1] = _mm256_fmadd_ps(x1, w, a[1]);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe {
                    _mm256_storeu_ps(op.add(i * dim + c), a[0]);
                    _mm256_storeu_ps(op.add(i * dim + c + 8), a[1]);
                }
            }
        }
    }
}

/// [`dense_scores_fma`] when the CPU has AVX2, FMA and F16C, else the `wide` kernel.
pub(crate) fn dense_scores(x: &[f32], rows: usize, dim: usize, q: &[f32], n_q: usize, out: &mut [f32]) {
    if cpu_ok() {
        // SAFETY: cpu_ok() checked AVX2, FMA and F16C; lib.rs checked the lengths.
        unsafe { dense_scores_fma(x, rows, dim, q, n_q, out) }
    } else {
        wide_backend::dense_scores(x, rows, dim, q, n_q, out)
    }
}

/// [`dense_axpy_fma`] when the CPU has AVX2, FMA and F16C, else the `wide` kernel.
pub(crate) fn dense_axpy(x: &[f32], rows: usize, dim: usize, p: &[f32], n_q: usize, out: &mut [f32]) {
    if cpu_ok() {
        // SAFETY: as above.
        unsafe { dense_axpy_fma(x, rows, dim, p, n_q, out) }
    } else {
        wide_backend::dense_axpy(x, rows, dim, p, n_q, out)
    }
}

/// f16 rows of a multiple of 8 widened in registers, when the CPU has AVX2, FMA and F16C;
/// else the portable kernel.
pub(crate) fn dense_scores_f16(
    x: &[half::f16],
    rows: usize,
    dim: usize,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) {
    if cpu_ok() && dim.is_multiple_of(8) {
        // SAFETY: the CPU checks and dim % 8 above; lib.rs checked the lengths (x holds
        // rows · dim f16).
        unsafe { dense_scores_tiles::<true>(x.as_ptr().cast(), rows, dim, q, n_q, out) }
    } else {
        wide_backend::dense_scores_f16(x, rows, dim, q, n_q, out)
    }
}

/// f16 rows of a multiple of 16 widened in registers, when the CPU has AVX2, FMA and F16C;
/// else the portable kernel.
pub(crate) fn dense_axpy_f16(
    x: &[half::f16],
    rows: usize,
    dim: usize,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
) {
    if cpu_ok() && dim.is_multiple_of(16) {
        // SAFETY: as above, with dim % 16.
        unsafe { dense_axpy_tiles::<true>(x.as_ptr().cast(), rows, dim, p, n_q, out) }
    } else {
        wide_backend::dense_axpy_f16(x, rows, dim, p, n_q, out)
    }
}

/// The AVX2 integer kernel: 4-bit codes meet the int8 query in `vpmaddubsw` (u8 × i8, pairs
/// summed), 8-bit codes are widened to i16 and meet an i16 query in `vpmaddwd`.
pub(crate) struct Avx2Int;

impl int8::IntKernel for Avx2Int {
    fn round_query(q: &[f32], out: &mut Vec<i8>) -> f32 {
        // SAFETY: this kernel is only used by `scores_int8` after `int8_supported` checked AVX2.
        unsafe { round_query(q, out) }
    }

    fn round_query_scaled(q: &[f32], scale: &[f32], _: &mut Vec<f32>, out: &mut Vec<i8>) -> f32 {
        // SAFETY: as above.
        unsafe { round_query_by::<true>(q, scale, out) }
    }

    fn round_queries_scaled(
        q: &[f32],
        scale: &[f32],
        _: &mut Vec<f32>,
        out: &mut Vec<i8>,
        scales: &mut [f32],
    ) {
        // SAFETY: as above.
        unsafe { round_queries_grouped(q, scale, out, scales) }
    }

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: as above.
        unsafe { dot_lanes(a, b) }
    }

    fn sum(a: &[f32]) -> f32 {
        // SAFETY: as above.
        unsafe { sum_lanes(a) }
    }

    fn arrange(b: &QuantBlock<'_>, q8: &[i8], out: &mut Vec<u8>) {
        if b.bits == 4 {
            // SAFETY: as above.
            unsafe { arrange4_32(q8, int8::appended(out, q8.len() / 64 * 64)) }
        } else {
            int8::arrange_i16(q8, out)
        }
    }

    fn dots(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], n: usize, dots: &mut [i32]) {
        // SAFETY: `int8_supported(b)` (checked by `scores_int8`, the only caller) covers the
        // CPU, the bit width and the row length (per group: 4-bit, groups of whole 32-code
        // runs); the driver passes n arranged rows of equal length and n · rows.len() dots
        // (per group, that times dim / run_len, `segment`'s runs).
        unsafe {
            if matches!(b.params, Params::PerGroup { .. }) {
                by_group!(run_dots, n, (b, rows, q, dots))
            } else {
                by_4_or_8_and_group!(idots, b.bits, n, (b, rows, q, dots))
            }
        }
    }

    fn segment(b: &QuantBlock<'_>) -> usize {
        match b.params {
            Params::PerGroup { .. } => run_len(b),
            _ => b.dim,
        }
    }
}

/// [`int8::quantize_query`] in AVX2, 32 values per step: the same maximum, scale, clamp and
/// rounding (by 1.5 · 2^23), so the same bytes; the packing to bytes is two saturating packs
/// (exact for −127..=127) and one lane permutation.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn round_query(q: &[f32], out: &mut Vec<i8>) -> f32 {
    // SAFETY: as this function's.
    unsafe { round_query_by::<false>(q, &[], out) }
}

/// [`round_query`] of `q` (`SCALED = false`, `scale` unused) or of the products
/// `q[d] · scale[d]` (`SCALED`, `scale` as long as `q`), computed in registers in both passes
/// instead of stored: the same products, so the same bytes as rounding a stored copy.
///
/// # Safety
/// The CPU must support AVX2; with `SCALED`, `scale.len() >= q.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn round_query_by<const SCALED: bool>(q: &[f32], scale: &[f32], out: &mut Vec<i8>) -> f32 {
    assert!(!SCALED || scale.len() >= q.len(), "a scale per query value");
    // Eight values from `at`, scaled when asked (a macro, so that the intrinsics sit in this
    // function's AVX2 code).
    macro_rules! load {
        ($at:expr) => {{
            let at: usize = $at;
            // SAFETY: every use has at + 8 <= q.len() (<= scale.len() when scaled).
            unsafe {
                let x = _mm256_loadu_ps(q.as_ptr().add(at));
                if SCALED { _mm256_mul_ps(x, _mm256_loadu_ps(scale.as_ptr().add(at))) } else { x }
            }
        }};
    }
    let value = |k: usize| if SCALED { q[k] * scale[k] } else { q[k] };
    let body = q.len() / 8 * 8;
    let sign = _mm256_set1_ps(-0.0);
    // NaN told by the sum of |x|, as in `round_queries_by`.
    let (mut m, mut abs_sum) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for at in (0..body).step_by(8) {
        let a = _mm256_andnot_ps(sign, load!(at));
        m = _mm256_max_ps(m, a);
        abs_sum = _mm256_add_ps(abs_sum, a);
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    let mut rest = [0f32; 8];
    for k in body..q.len() {
        rest[k - body] = value(k);
    }
    let rest = &rest[..q.len() - body];
    let any_nan = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(abs_sum, abs_sum)) != 0
        || rest.iter().any(|v| v.is_nan());
    let (scale_q, inv) = int8::scale_of(int8::lane_max(&lanes, rest), any_nan, 127.0);
    // SAFETY: as this function's.
    unsafe { round_pass::<SCALED>(q, scale, inv, int8::appended(out, q.len())) };
    scale_q
}

/// The second pass of [`round_query_by`]: `q` (times `scale` when `SCALED`) times `inv`,
/// clamped, rounded and written to `dst` (`q.len()` values).
///
/// # Safety
/// As [`round_query_by`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn round_pass<const SCALED: bool>(q: &[f32], scale: &[f32], inv: f32, dst: &mut [i8]) {
    let value = |k: usize| if SCALED { q[k] * scale[k] } else { q[k] };
    let dst = &mut dst[..q.len()];
    let (invv, lo, hi) = (_mm256_set1_ps(inv), _mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let full = q.len() / 32 * 32;
    for (c, o) in dst[..full].chunks_exact_mut(32).enumerate() {
        let mut v = [_mm256_setzero_si256(); 4];
        for (k, v) in v.iter_mut().enumerate() {
            let at = 32 * c + 8 * k;
            // SAFETY: at + 8 <= full <= q.len() (<= scale.len() when scaled).
            let x = unsafe {
                let x = _mm256_loadu_ps(q.as_ptr().add(at));
                if SCALED { _mm256_mul_ps(x, _mm256_loadu_ps(scale.as_ptr().add(at))) } else { x }
            };
            // Clamped (a NaN becomes 127: `vminps` returns its second operand), then rounded
            // to nearest, ties to even, as `int8::round_code`'s MAGIC addition does.
            let x = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(x, invv), hi), lo);
            *v = _mm256_cvtps_epi32(x);
        }
        let packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        // SAFETY: `o` is 32 bytes.
        unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), _mm256_permutevar8x32_epi32(packed, order)) };
    }
    for (k, o) in dst.iter_mut().enumerate().skip(full) {
        *o = int8::round_code(value(k), inv, 127.0) as i8;
    }
}

/// [`int8::IntKernel::round_queries_scaled`] through [`round_queries_by`] for up to four rows
/// of whole 8-value lanes, row by row ([`round_query_by`]) otherwise.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn round_queries_grouped(q: &[f32], scale: &[f32], out: &mut Vec<i8>, scales: &mut [f32]) {
    let d = scale.len();
    let n = if d > 0 && d.is_multiple_of(8) && q.len().is_multiple_of(d) { q.len() / d } else { 0 };
    // SAFETY: the CPU supports AVX2 (this function's contract); q holds n rows of d values.
    unsafe {
        match n {
            1..=4 => {
                let out = int8::appended(out, q.len());
                match n {
                    1 => round_queries_by::<1>(q, scale, out, scales),
                    2 => round_queries_by::<2>(q, scale, out, scales),
                    3 => round_queries_by::<3>(q, scale, out, scales),
                    _ => round_queries_by::<4>(q, scale, out, scales),
                }
            }
            _ => {
                for (s, qi) in scales.iter_mut().zip(q.chunks_exact(scale.len().max(1))) {
                    *s = round_query_by::<true>(qi, scale, out);
                }
            }
        }
    }
}

/// [`round_query_by`]`::<true>` of the `NQ` rows of `q` (each `scale.len()` long, a multiple of
/// 8) against the same channel scales, written row after row to `out` (`q.len()` bytes, so
/// that the fused kernel's buffer is not cleared first), their scales into `scales`: the
/// maxima of all rows in one pass, whose independent chains overlap, and one load of the
/// scales for all rows. The same bytes and scales as row by row.
///
/// # Safety
/// The CPU must support AVX2; `q.len() == NQ · scale.len()`, `scales.len() >= NQ`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn round_queries_by<const NQ: usize>(
    q: &[f32],
    scale: &[f32],
    out: &mut [i8],
    scales: &mut [f32],
) {
    let d = scale.len();
    assert!(
        q.len() == NQ * d && out.len() >= q.len() && d.is_multiple_of(8) && scales.len() >= NQ,
        "NQ rows of whole lanes"
    );
    let sign = _mm256_set1_ps(-0.0);
    // The maxima of |x| and, to tell NaN, the sums of |x|: non-negative terms, so a sum is NaN
    // exactly when one of them is (Inf + Inf stays Inf), one add where a compare and an or
    // were two vector µops.
    let (mut m, mut abs_sum) = ([_mm256_setzero_ps(); NQ], [_mm256_setzero_ps(); NQ]);
    for at in (0..d).step_by(8) {
        // SAFETY: at + 8 <= d, and row i's values lie at i · d + at.
        unsafe {
            let s = _mm256_loadu_ps(scale.as_ptr().add(at));
            for i in 0..NQ {
                let a = _mm256_andnot_ps(sign, _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(i * d + at)), s));
                m[i] = _mm256_max_ps(m[i], a);
                abs_sum[i] = _mm256_add_ps(abs_sum[i], a);
            }
        }
    }
    for i in 0..NQ {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m[i]) };
        let any_nan = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(abs_sum[i], abs_sum[i])) != 0;
        let (scale_q, inv) = int8::scale_of(int8::lane_max(&lanes, &[]), any_nan, 127.0);
        scales[i] = scale_q;
        // SAFETY: as this function's.
        unsafe { round_pass::<true>(&q[i * d..(i + 1) * d], scale, inv, &mut out[i * d..(i + 1) * d]) };
    }
}

/// [`crate::wide_backend::dot_lanes`] in AVX2: the same 8 lanes (multiply, then add: not fused),
/// the same order of the final sum, so the same bits.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let (mut ac, mut bc) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ac).zip(&mut bc) {
        // SAFETY: `x` and `y` are 8 floats each.
        let p = unsafe { _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr())) };
        acc = _mm256_add_ps(acc, p);
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

/// [`crate::wide_backend::sum_lanes`] in AVX2, bit for bit as [`dot_lanes`].
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sum_lanes(a: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut ac = a.chunks_exact(8);
    for x in &mut ac {
        // SAFETY: `x` is 8 floats.
        acc = _mm256_add_ps(acc, unsafe { _mm256_loadu_ps(x.as_ptr()) });
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    lanes.iter().sum::<f32>() + ac.remainder().iter().sum::<f32>()
}

/// The sums of the 8 lanes of each of 4 accumulators, in one vector (lane `i` from `acc[i]`):
/// two rounds of `vphaddd` and one add.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn hsum4_i32(v: &[__m256i; 4]) -> [i32; 4] {
    let s = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    let mut out = [0i32; 4];
    // SAFETY: `out` holds 4 i32.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), s) };
    out
}

/// Stores the four reduced sums of `4 / NQ` rows starting at `r` (or of one row, `rr == 1`):
/// `sums[j · NQ + i]` is row `r + j`, query `i`. Without bounds checks (with them, and the
/// row slice's, a fifth of the dots loop's instructions): the callers check once per call.
///
/// # Safety
/// `r + rr <= m`, `rr · NQ <= 4`, and `dots` holds `NQ · m` values.
#[inline]
pub(crate) unsafe fn store_dots<const NQ: usize>(
    sums: [i32; 4],
    rr: usize,
    r: usize,
    m: usize,
    dots: &mut [i32],
) {
    for j in 0..rr {
        for i in 0..NQ {
            // SAFETY: i < NQ and r + j < m, so i · m + r + j < NQ · m <= dots.len().
            unsafe { *dots.get_unchecked_mut(i * m + r + j) = sums[j * NQ + i] };
        }
    }
}

/// Adds the integer dots of `NQ` arranged 4-bit query rows with one row of codes into
/// `acc[..NQ]` (8 lanes each, summed later). Two 32-byte chunks (128 values) at a time meet in
/// i16 before one widening `vpmaddwd`: each `vpmaddubsw` lane is at most `2 · 15 · 127 = 3810`
/// in size, four of them 15240.
///
/// # Safety
/// The CPU must support AVX2; the row holds `d / 2` bytes, `d` a multiple of 64; `q` holds
/// `NQ` arranged rows of `d` bytes ([`int8::arrange4`], 32-byte chunks).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn acc4<const NQ: usize>(row: &[u8], q: &[u8], d: usize, acc: &mut [__m256i]) {
    let ones = _mm256_set1_epi16(1);
    let mut pairs = row.chunks_exact(64);
    for (c, code) in (&mut pairs).enumerate() {
        // SAFETY: `code` is 64 bytes; query row i spans q[i·d .. (i + 1)·d] and the pair's
        // 128 values lie inside it (128 · (c + 1) ≤ d).
        unsafe {
            let (lo0, hi0) = nibbles(code.as_ptr());
            let (lo1, hi1) = nibbles(code.as_ptr().add(32));
            for (i, a) in acc.iter_mut().enumerate().take(NQ) {
                let p = q.as_ptr().add(i * d + 128 * c);
                let s = _mm256_add_epi16(chunk_dots(lo0, hi0, p), chunk_dots(lo1, hi1, p.add(64)));
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(s, ones));
            }
        }
    }
    let done = row.len() / 64;
    if let Some(code) = pairs.remainder().get(..32) {
        // SAFETY: `code` is the row's last 32 bytes; their 64 values at 128 · done lie inside
        // each query row (d = 2 · row.len()).
        unsafe {
            let (lo, hi) = nibbles(code.as_ptr());
            for (i, a) in acc.iter_mut().enumerate().take(NQ) {
                let s = chunk_dots(lo, hi, q.as_ptr().add(i * d + 128 * done));
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(s, ones));
            }
        }
    }
}

/// The low and high nibbles of the 32 bytes at `code`, as bytes.
///
/// # Safety
/// The CPU must support AVX2; `code` points to 32 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles(code: *const u8) -> (__m256i, __m256i) {
    let mask = _mm256_set1_epi8(0x0f);
    // SAFETY: 32 readable bytes (this function's contract).
    let v = unsafe { _mm256_loadu_si256(code.cast()) };
    (_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask))
}

/// The 64 codes of one chunk (`lo`, `hi`: [`nibbles`]) times the 64 arranged int8 query
/// values at `q`, adjacent pairs summed into i16 (each at most 2 · 2 · 15 · 127 = 7620 in
/// size).
///
/// # Safety
/// The CPU must support AVX2; `q` points to 64 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn chunk_dots(lo: __m256i, hi: __m256i, q: *const u8) -> __m256i {
    // SAFETY: 64 readable bytes (this function's contract).
    unsafe {
        let (ql, qh) = (_mm256_loadu_si256(q.cast()), _mm256_loadu_si256(q.add(32).cast()));
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, ql), _mm256_maddubs_epi16(hi, qh))
    }
}

/// As [`acc4`] for a 16-level table block: each chunk's nibbles looked up in `tab` (the
/// levels rounded to int8, [`table_vector`]), one 32-byte chunk at a time ([`table_dots`]).
///
/// # Safety
/// As [`acc4`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn acc4_table<const NQ: usize>(row: &[u8], q: &[u8], d: usize, tab: __m256i, acc: &mut [__m256i]) {
    for (c, code) in row.chunks_exact(32).enumerate() {
        // SAFETY: `code` is 32 bytes; the chunk's 64 values at 64c lie inside each query row.
        unsafe {
            let t = table_chunk(code.as_ptr(), tab);
            for (i, a) in acc.iter_mut().enumerate().take(NQ) {
                *a = _mm256_add_epi32(*a, table_dots(&t, q.as_ptr().add(i * d + 64 * c)));
            }
        }
    }
}

/// The 64 levels of the 32 code bytes at `code` looked up in `tab` ([`table_vector`]): low
/// nibbles' levels, their magnitudes, high nibbles' levels, their magnitudes.
///
/// # Safety
/// The CPU must support AVX2; `code` points to 32 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn table_chunk(code: *const u8, tab: __m256i) -> [__m256i; 4] {
    // SAFETY: 32 readable bytes (this function's contract).
    let (lo, hi) = unsafe { nibbles(code) };
    let (l, h) = (_mm256_shuffle_epi8(tab, lo), _mm256_shuffle_epi8(tab, hi));
    [l, _mm256_abs_epi8(l), h, _mm256_abs_epi8(h)]
}

/// A chunk's 64 table levels ([`table_chunk`]) times the 64 arranged int8 query values at `q`,
/// as eight i32 (per 128-bit lane, its 32 codes). `vpmaddubsw` takes the levels' magnitudes
/// and the query with their signs (`vpsignb`): a pair is at most `2 · 127 · 127 = 32258`, so
/// each plane is widened on its own.
///
/// # Safety
/// The CPU must support AVX2; `q` points to 64 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn table_dots(t: &[__m256i; 4], q: *const u8) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    // SAFETY: 64 readable bytes (this function's contract).
    let (ql, qh) = unsafe { (_mm256_loadu_si256(q.cast()), _mm256_loadu_si256(q.add(32).cast())) };
    let lo = _mm256_maddubs_epi16(t[1], _mm256_sign_epi8(ql, t[0]));
    let hi = _mm256_maddubs_epi16(t[3], _mm256_sign_epi8(qh, t[2]));
    _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
}

/// As [`acc4`] for 8-bit codes and i16 queries ([`int8::arrange_i16`]).
///
/// # Safety
/// The CPU must support AVX2; the row holds `d` bytes, `d` a multiple of 16; `q` holds `NQ`
/// rows of `d` i16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn acc8<const NQ: usize>(row: &[u8], q: &[u8], d: usize, acc: &mut [__m256i]) {
    for (c, code) in row.chunks_exact(16).enumerate() {
        // SAFETY: `code` is 16 bytes; the 16 i16 of query row i at channel 16c lie inside
        // q[2·i·d .. 2·(i + 1)·d].
        unsafe {
            let codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(code.as_ptr().cast()));
            for (i, a) in acc.iter_mut().enumerate().take(NQ) {
                let qv = _mm256_loadu_si256(q.as_ptr().add(2 * (i * d + 16 * c)).cast());
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(codes, qv));
            }
        }
    }
}

/// The dots of `STEP` rows from `rows.start + r` with `NQ` queries (`STEP · NQ ≤ 4`), reduced
/// together and stored.
///
/// # Safety
/// As [`idots`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn idot_step<const BITS: u8, const NQ: usize, const STEP: usize, const TABLE: bool>(
    b: &QuantBlock<'_>,
    rows: &Range<usize>,
    r: usize,
    q: &[u8],
    tab: __m256i,
    dots: &mut [i32],
) {
    let mut acc = [_mm256_setzero_si256(); 4];
    for j in 0..STEP {
        // SAFETY: row rows.start + r + j < rows.end, whose rows `idots` checked lie in `b`.
        let (row, a) = (unsafe { b.row_unchecked(rows.start + r + j) }, &mut acc[j * NQ..(j + 1) * NQ]);
        // SAFETY: forwarded from the caller.
        unsafe {
            if TABLE {
                acc4_table::<NQ>(row, q, b.dim, tab, a)
            } else if BITS == 4 {
                acc4::<NQ>(row, q, b.dim, a)
            } else {
                acc8::<NQ>(row, q, b.dim, a)
            }
        }
    }
    // SAFETY: AVX2 is enabled by this function's target features; r + STEP <= rows.len() and
    // `dots` holds NQ · rows.len() values (checked by `idots`).
    unsafe { store_dots::<NQ>(hsum4_i32(&acc), STEP, r, rows.len(), dots) };
}

/// Integer dots of `NQ` arranged query rows with rows `rows` of `b`, its codes or (16-level
/// tables) their levels rounded to int8 ([`int8::table8`]): [`idots_in`].
///
/// # Safety
/// As [`idots_in`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn idots<const BITS: u8, const NQ: usize>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    dots: &mut [i32],
) {
    // SAFETY: forwarded.
    unsafe {
        match int8::table8(b) {
            Some((t, _)) if BITS == 4 => {
                idots_in::<4, NQ, true>(b, rows, q, table_vector(&t), dots, &mut Ahead::default())
            }
            _ => idots_in::<BITS, NQ, false>(b, rows, q, _mm256_setzero_si256(), dots, &mut Ahead::default()),
        }
    }
}

/// A 16-level table's int8 levels as a `vpshufb` table in both 128-bit lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn table_vector(t: &[i8; 16]) -> __m256i {
    // SAFETY: `t` holds 16 bytes.
    _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(t.as_ptr().cast()) })
}

/// Integer dots of `NQ` arranged query rows with rows `rows` of `b`: `4 / NQ` rows at a time
/// (a constant trip count, so the accumulators stay in registers), so that one 4-way
/// reduction serves four (row, query) pairs; then single rows.
///
/// # Safety
/// The CPU must support AVX2; `BITS == b.bits` and the block and `q` as [`acc4`] / [`acc8`]
/// require (`TABLE`: a 16-level table block, `tab` its [`table_vector`]); `dots` holds `NQ ·
/// rows.len()` values. `ahead` is stepped every four rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn idots_in<const BITS: u8, const NQ: usize, const TABLE: bool>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    tab: __m256i,
    dots: &mut [i32],
    ahead: &mut Ahead,
) {
    let (m, rr) = (rows.len(), 4 / NQ);
    // Once per call, so that the steps read rows and store dots without bounds checks.
    let held = b.rows.checked_mul(b.row_bytes).is_some_and(|n| n <= b.codes.len());
    assert!(rows.end <= b.rows && held && dots.len() >= NQ * m);
    if rr == 1 {
        // Three or four query rows: one row a step, one call site (so that the step is
        // inlined and the accumulators stay in registers).
        for r in 0..m {
            if r % 4 == 0 {
                ahead.step();
            }
            // SAFETY: the CPU features and bounds are forwarded from the caller.
            unsafe { idot_step::<BITS, NQ, 1, TABLE>(b, &rows, r, q, tab, dots) };
        }
        return;
    }
    let mut r = 0;
    while r + rr <= m {
        if r % 4 == 0 {
            ahead.step();
        }
        match NQ {
            // SAFETY: the CPU features and bounds are forwarded from the caller.
            1 => unsafe { idot_step::<BITS, NQ, 4, TABLE>(b, &rows, r, q, tab, dots) },
            // SAFETY: the CPU features and bounds are forwarded from the caller.
            2 => unsafe { idot_step::<BITS, NQ, 2, TABLE>(b, &rows, r, q, tab, dots) },
            // SAFETY: the CPU features and bounds are forwarded from the caller.
            _ => unsafe { idot_step::<BITS, NQ, 1, TABLE>(b, &rows, r, q, tab, dots) },
        }
        r += rr;
    }
    while r < m {
        // SAFETY: the CPU features and bounds are forwarded from the caller.
        unsafe { idot_step::<BITS, NQ, 1, TABLE>(b, &rows, r, q, tab, dots) };
        r += 1;
    }
}

/// The codes of a run of [`run_dots`] for the per-group block `b`: 64 in groups of a multiple
/// of 64 (a 32-byte chunk is then one run), 32 otherwise.
fn run_len(b: &QuantBlock<'_>) -> usize {
    match b.params {
        Params::PerGroup { group, .. } if group.is_multiple_of(64) => 64,
        _ => 32,
    }
}

/// Integer dots of `NQ` arranged query rows with each run of `len` = [`run_len`] codes of rows
/// `rows` of the 4-bit per-group block `b` (groups of a multiple of 32 values; codes, or a
/// 16-level table's int8 levels, [`int8::table8`]): run `s` of row `r` into `dots[(i · m + r)
/// · d / len + s]` (the epilogue adds a group's runs and scales them). The rows' codes lie back to back, so the kernel walks them as one run of 32-byte
/// chunks, four at a time whatever the row length, each against the query values of its place
/// in a row. A chunk holds two runs of 32 (one a 128-bit lane, [`int8::arrange4`]'s order) or
/// one of 64; one reduction of four chunks' sums gives eight dots or four, in order.
///
/// # Safety
/// The CPU must support AVX2; `b.bits == 4`, `b.dim` a multiple of 64; `q` holds `NQ` rows
/// arranged by [`int8::arrange4`] with 32-byte chunks and `dots` `NQ · rows.len() · b.dim /
/// run_len(b)` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_dots<const NQ: usize>(b: &QuantBlock<'_>, rows: Range<usize>, q: &[u8], dots: &mut [i32]) {
    // SAFETY: forwarded.
    unsafe {
        let zero = _mm256_setzero_si256();
        match (run_len(b) == 64, int8::table8(b)) {
            (true, None) => runs::<NQ, true, false>(b, rows, q, zero, dots),
            (false, None) => runs::<NQ, false, false>(b, rows, q, zero, dots),
            (true, Some((t, _))) => runs::<NQ, true, true>(b, rows, q, table_vector(&t), dots),
            (false, Some((t, _))) => runs::<NQ, false, true>(b, rows, q, table_vector(&t), dots),
        }
    }
}

/// [`run_dots`], a 32-byte chunk one run (`WHOLE`, runs of 64) or two; `TABLE`: a 16-level
/// table block, `tab` its [`table_vector`].
///
/// # Safety
/// As [`run_dots`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn runs<const NQ: usize, const WHOLE: bool, const TABLE: bool>(
    b: &QuantBlock<'_>,
    rows: Range<usize>,
    q: &[u8],
    tab: __m256i,
    dots: &mut [i32],
) {
    let (d, m) = (b.dim, rows.len());
    let runs_per_chunk = if WHOLE { 1 } else { 2 };
    let chunks_per_row = d / 64;
    let per_row = chunks_per_row * runs_per_chunk;
    let held = b.rows.checked_mul(b.row_bytes).is_some_and(|n| n <= b.codes.len());
    assert!(
        held && rows.end <= b.rows
            && b.bits == 4
            && d.is_multiple_of(64)
            && b.row_bytes == 32 * chunks_per_row
            && q.len() >= NQ * d
            && dots.len() >= NQ * m * per_row,
        "4-bit rows of whole chunks, inside the block, the query and the dots"
    );
    // SAFETY: rows.start <= b.rows, and the block holds b.rows · row_bytes bytes.
    let base = unsafe { b.codes.as_ptr().add(rows.start * b.row_bytes) };
    let total = m * chunks_per_row;
    // Blocks streamed from memory: each step's lines asked for early, as the VNNI dots do.
    let ahead = crate::stream_prefetch(b.rows * b.row_bytes);
    let (mut k, mut at) = (0, 0);
    while k + 4 <= total {
        if let Some(ahead) = ahead {
            crate::prefetch_l1(base.wrapping_add(32 * k + ahead), 128);
        }
        // SAFETY: chunks k..k + 4 lie in rows `rows` (total chunks), run `at + 4 · runs a
        // chunk` of each query's dots is at most m · per_row, and the query offsets stay in a
        // row.
        unsafe {
            run_step::<NQ, WHOLE, TABLE, true>(base, k, 4, chunks_per_row, q, tab, dots, m * per_row, at)
        };
        k += 4;
        at += 4 * runs_per_chunk;
    }
    if k < total {
        // SAFETY: as above, for the last total − k < 4 chunks.
        unsafe {
            run_step::<NQ, WHOLE, TABLE, false>(
                base,
                k,
                total - k,
                chunks_per_row,
                q,
                tab,
                dots,
                m * per_row,
                at,
            )
        };
    }
}

/// Chunks `k..k + n` (`n ≤ 4`; `FULL`: `n == 4`, each instance then has one call site and is
/// inlined) of the code run at `base` against the `NQ` arranged query rows of `q` (`d =
/// 64 · chunks_per_row` bytes each), their dots written from `at` in each query row's `len`
/// dots.
///
/// # Safety
/// The CPU must support AVX2; the chunks lie in the block; `at + n · runs a chunk ≤ len` and
/// `dots` holds `NQ · len` values; `q` holds `NQ` rows.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn run_step<const NQ: usize, const WHOLE: bool, const TABLE: bool, const FULL: bool>(
    base: *const u8,
    k: usize,
    n: usize,
    chunks_per_row: usize,
    q: &[u8],
    tab: __m256i,
    dots: &mut [i32],
    len: usize,
    at: usize,
) {
    let n = if FULL { 4 } else { n.min(4) };
    let zero = _mm256_setzero_si256();
    let mut code = [[zero; 4]; 4];
    let mut offset = [0usize; 4];
    for j in 0..n {
        // SAFETY: chunk k + j (32 bytes) lies in the block (this function's contract).
        code[j] = unsafe {
            let p = base.add(32 * (k + j));
            if TABLE {
                table_chunk(p, tab)
            } else {
                let (lo, hi) = nibbles(p);
                [lo, hi, zero, zero]
            }
        };
        offset[j] = 64 * ((k + j) % chunks_per_row);
    }
    let (ones, q_row) = (_mm256_set1_epi16(1), 64 * chunks_per_row);
    for i in 0..NQ {
        let mut v = [zero; 4];
        for j in 0..n {
            // SAFETY: query row i's 64 bytes at the chunk's place in a row.
            v[j] = unsafe {
                let p = q.as_ptr().add(i * q_row + offset[j]);
                if TABLE {
                    table_dots(&code[j], p)
                } else {
                    _mm256_madd_epi16(chunk_dots(code[j][0], code[j][1], p), ones)
                }
            };
        }
        // SAFETY: `at + runs <= len` and `dots` holds NQ · len values (the contract).
        unsafe {
            let out = dots.as_mut_ptr().add(i * len + at);
            if WHOLE {
                let sums = hsum4_i32(&v);
                std::ptr::copy_nonoverlapping(sums.as_ptr(), out, n);
            } else {
                // Lanes 0..4 of a chunk's sums are its first run, 4..8 its second: two rounds
                // of `vphaddd` leave [run 0 of chunks 0..4 | run 1 of chunks 0..4].
                let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                let h = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                if n == 4 {
                    _mm256_storeu_si256(out.cast(), h);
                } else {
                    let mut tmp = [0i32; 8];
                    _mm256_storeu_si256(tmp.as_mut_ptr().cast(), h);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, 2 * n);
                }
            }
        }
    }
}

/// [`int8::arrange4`] with 32-byte chunks in AVX2: per 64 values, their first 16 and their
/// 16 from 32 side by side, then the other two runs (two 128-bit lane permutations). The
/// same bytes, into the first `q8.len() / 64 · 64` bytes of `out`; tails of fewer than 64
/// values as `arrange4` leaves them (dropped).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn arrange4_32(q8: &[i8], out: &mut [u8]) {
    let whole = q8.len() / 64 * 64;
    for (g, o) in q8[..whole].chunks_exact(64).zip(out[..whole].chunks_exact_mut(64)) {
        // SAFETY: `g` and `o` are 64 bytes.
        unsafe {
            let a = _mm256_loadu_si256(g.as_ptr().cast());
            let b = _mm256_loadu_si256(g.as_ptr().add(32).cast());
            _mm256_storeu_si256(o.as_mut_ptr().cast(), _mm256_permute2x128_si256::<0x20>(a, b));
            _mm256_storeu_si256(o.as_mut_ptr().add(32).cast(), _mm256_permute2x128_si256::<0x31>(a, b));
        }
    }
}

/// [`idots`] of every row of the 4-bit block `b` with `NQ` query rows arranged by
/// [`int8::arrange4`] with 32-byte chunks, for the fused kernel (`crate::fused_avx2`).
///
/// # Safety
/// The CPU must support AVX2; `b.bits == 4` with `b.dim` a multiple of 64; `q` holds `NQ`
/// arranged rows of `b.dim` bytes and `dots` `NQ · b.rows` values. `ahead` is stepped every
/// four rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn int_dots_4bit<const NQ: usize>(
    b: &QuantBlock<'_>,
    q: &[u8],
    dots: &mut [i32],
    ahead: &mut Ahead,
) {
    // SAFETY: forwarded from the caller.
    unsafe { idots_in::<4, NQ, false>(b, 0..b.rows, q, _mm256_setzero_si256(), dots, ahead) }
}

/// Whether [`scores_int8_in`] has an integer kernel for this block: affine 4-bit rows of a
/// multiple of 64 codes or 8-bit rows of a multiple of 16, parameters per row or per channel,
/// and 4-bit rows with parameters per group of a multiple of 32 values; 4-bit rows of a
/// 16-level table (NF4, 4-bit codebooks) or of symmetric levels as affine 4-bit ones; on a CPU
/// with AVX2 and FMA.
pub fn int8_supported(b: &QuantBlock<'_>) -> bool {
    let ok_dim = match b.bits {
        4 => b.dim.is_multiple_of(64),
        8 => b.dim.is_multiple_of(16),
        _ => false,
    };
    // Per group: 4-bit codes in whole 32-code runs a group (`run_dots`). 8-bit groups keep
    // the float kernels: an integer kernel took as long (i16 products), and the query's int8
    // rounding would cost them most of their precision.
    let ok_params = match b.params {
        Params::PerGroup { group, .. } => b.bits == 4 && group.is_multiple_of(32),
        _ => true,
    };
    let ok_levels = matches!(b.levels, Levels::Affine) || int8::has_table8(b);
    ok_dim && ok_params && ok_levels && b.dim > 0 && cpu_ok()
}

/// Scores through the integer path: the query (per-channel: the query times the scales) is
/// quantized to int8 per row, codes and query meet in `vpmaddubsw`/`vpmaddwd`, and one float
/// multiply per row restores the scale. Offsets use the exact float sum of the query. Equal,
/// bit for bit, to [`crate::scalar::scores_int8`].
///
/// Tolerance against the float scores: each score is off by at most
/// `scale_q / 2 · Σ_d |level_d| · scale` (the query's rounding), `scale_q = max|q| / 127`.
/// Returns `false`, computing nothing, when [`int8_supported`] is false.
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
    // SAFETY: `int8_supported` checked AVX2 and FMA.
    unsafe { by_block_avx2::<Avx2Int>(b, q, n_q, out, scratch) };
    true
}

/// [`int8::scores_by_block`] compiled with AVX2: the query's rounding and the epilogue (once
/// per block in decode) vectorize 8 wide. The compiler neither reassociates nor fuses float
/// operations, so the scores are the same as the baseline build's, bit for bit.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn by_block_avx2<K: int8::IntKernel + 'static>(
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
    scratch: &mut int8::Scratch,
) {
    int8::scores_by_block::<K>(b, q, n_q, out, scratch)
}
