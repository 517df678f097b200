//! Dense bit packing of codes, laid out for SIMD unpacking.
//!
//! A row of `n` codes of `b` bits is stored as one or more *bit planes* of width 8, 4, 2 or 1:
//! `b` is split into powers of two, low bits first (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2,
//! 7 = 4 + 2 + 1), and the planes follow each other. A plane of width `w` holds `m = 8 / w`
//! codes per byte and is cut into chunks of `16 m` codes that fill 16 bytes: byte `j` of a chunk
//! holds code `j + 16 k` of the chunk in bits `k w .. (k + 1) w`. One 16-byte load, a shift by
//! `k w` and a mask thus give 16 consecutive codes, with no shuffles. A last, shorter chunk of
//! `r` codes uses `s = ceil(r / m)` bytes with the same rule and stride `s` in place of 16.
//!
//! A plane of `n` codes takes `ceil(n w / 8)` bytes, so a row takes exactly `n b / 8` bytes
//! when `n` is a multiple of 8 (every head_dim in use), and at most one byte per extra plane
//! more otherwise. `docs/formats.md` draws the layout.

use crate::error::{QuantError, Result};

/// The plane widths of a `bits`-wide code, low bits first.
pub fn planes(bits: u8) -> &'static [u8] {
    match bits {
        1 => &[1],
        2 => &[2],
        3 => &[2, 1],
        4 => &[4],
        5 => &[4, 1],
        6 => &[4, 2],
        7 => &[4, 2, 1],
        _ => &[8],
    }
}

fn check_bits(bits: u8) -> Result<()> {
    if (1..=8).contains(&bits) {
        Ok(())
    } else {
        Err(QuantError::BitsOutOfRange { format: "packing", bits, min: 1, max: 8 })
    }
}

/// Bytes a row of `n` codes of `bits` bits packs into.
///
/// # Errors
/// [`QuantError::BitsOutOfRange`] outside 1..=8.
pub fn packed_len(n: usize, bits: u8) -> Result<usize> {
    check_bits(bits)?;
    Ok(packed_len_unchecked(n, bits))
}

pub(crate) fn packed_len_unchecked(n: usize, bits: u8) -> usize {
    planes(bits).iter().map(|&w| (n * w as usize).div_ceil(8)).sum()
}

/// Packs `codes` (each below `2^bits`) into a new buffer of [`packed_len`] bytes.
///
/// # Errors
/// [`QuantError::BitsOutOfRange`] outside 1..=8, [`QuantError::InvalidArgument`] for a code
/// that does not fit in `bits` bits.
pub fn pack(codes: &[u8], bits: u8) -> Result<Vec<u8>> {
    check_bits(bits)?;
    if let Some(i) = codes.iter().position(|&c| u32::from(c) >> bits != 0) {
        return Err(QuantError::InvalidArgument(format!(
            "code {} at {i} does not fit in {bits} bits",
            codes[i]
        )));
    }
    let mut out = vec![0; packed_len_unchecked(codes.len(), bits)];
    pack_into(codes, bits, &mut out);
    Ok(out)
}

/// Unpacks `n` codes of `bits` bits from `packed`.
///
/// # Errors
/// [`QuantError::BitsOutOfRange`] outside 1..=8, [`QuantError::ShapeMismatch`] when `packed`
/// is not exactly [`packed_len`]`(n, bits)` bytes long.
pub fn unpack(packed: &[u8], bits: u8, n: usize) -> Result<Vec<u8>> {
    check_bits(bits)?;
    let want = packed_len_unchecked(n, bits);
    if packed.len() != want {
        return Err(QuantError::ShapeMismatch {
            expected: format!("{want} bytes for {n} codes of {bits} bits"),
            got: format!("{} bytes", packed.len()),
        });
    }
    let mut out = vec![0; n];
    unpack_into(packed, bits, &mut out);
    Ok(out)
}

/// Packs a row of `codes` into `out` (exactly [`packed_len`] bytes), without allocating.
/// Bits of a code above `bits` are ignored.
///
/// # Errors
/// [`QuantError::BitsOutOfRange`], or [`QuantError::ShapeMismatch`] for a wrong `out` length.
pub fn pack_row(codes: &[u8], bits: u8, out: &mut [u8]) -> Result<()> {
    check_pack(codes.len(), bits, out.len())?;
    pack_into(codes, bits, out);
    Ok(())
}

/// The checks of [`pack_row`].
pub(crate) fn check_pack(n: usize, bits: u8, bytes: usize) -> Result<()> {
    check_bits(bits)?;
    check_len(n, bits, bytes)
}

/// Unpacks a row of `out.len()` codes from `packed` (exactly [`packed_len`] bytes).
///
/// # Errors
/// [`QuantError::BitsOutOfRange`], or [`QuantError::ShapeMismatch`] for a wrong `packed` length.
pub fn unpack_row(packed: &[u8], bits: u8, out: &mut [u8]) -> Result<()> {
    check_bits(bits)?;
    check_len(out.len(), bits, packed.len())?;
    unpack_into(packed, bits, out);
    Ok(())
}

fn check_len(n: usize, bits: u8, bytes: usize) -> Result<()> {
    let want = packed_len_unchecked(n, bits);
    if bytes == want {
        Ok(())
    } else {
        Err(QuantError::ShapeMismatch {
            expected: format!("{want} bytes for {n} codes of {bits} bits"),
            got: format!("{bytes} bytes"),
        })
    }
}

/// Packs `codes` into `out`, which must be [`packed_len`] bytes long. Bits of a code above
/// `bits` are ignored. Internal fast path: lengths are the caller's invariant.
pub(crate) fn pack_into(codes: &[u8], bits: u8, out: &mut [u8]) {
    debug_assert_eq!(out.len(), packed_len_unchecked(codes.len(), bits));
    if bits == 8 {
        out.copy_from_slice(codes);
        return;
    }
    let mut shift = 0;
    let mut rest = out;
    for &w in planes(bits) {
        let (plane, tail) = rest.split_at_mut((codes.len() * w as usize).div_ceil(8));
        pack_plane(codes, shift, w, plane);
        shift += w;
        rest = tail;
    }
}

/// Unpacks `out.len()` codes from `packed`, the inverse of [`pack_into`].
pub(crate) fn unpack_into(packed: &[u8], bits: u8, out: &mut [u8]) {
    debug_assert_eq!(packed.len(), packed_len_unchecked(out.len(), bits));
    if bits == 8 {
        out.copy_from_slice(packed);
        return;
    }
    out.fill(0);
    let mut shift = 0;
    let mut rest = packed;
    for &w in planes(bits) {
        let (plane, tail) = rest.split_at((out.len() * w as usize).div_ceil(8));
        unpack_plane(plane, shift, w, out);
        shift += w;
        rest = tail;
    }
}

fn pack_plane(codes: &[u8], shift: u8, w: u8, out: &mut [u8]) {
    // Plane widths are compile-time constants in each instance, so the per-byte shifts and
    // masks are constants and the full-chunk loop vectorizes.
    match w {
        1 => pack_plane_w::<1>(codes, shift, out),
        2 => pack_plane_w::<2>(codes, shift, out),
        _ => pack_plane_w::<4>(codes, shift, out),
    }
}

fn unpack_plane(plane: &[u8], shift: u8, w: u8, out: &mut [u8]) {
    match w {
        1 => unpack_plane_w::<1>(plane, shift, out),
        2 => unpack_plane_w::<2>(plane, shift, out),
        _ => unpack_plane_w::<4>(plane, shift, out),
    }
}

fn pack_plane_w<const W: u8>(codes: &[u8], shift: u8, out: &mut [u8]) {
    let m = (8 / W) as usize;
    let mask = (1u8 << W) - 1;
    let chunk = 16 * m;
    let mut src_chunks = codes.chunks_exact(chunk);
    for (src, dst) in (&mut src_chunks).zip(out.chunks_exact_mut(16)) {
        let mut acc = [0u8; 16];
        for (k, part) in src.chunks_exact(16).enumerate() {
            let part: &[u8; 16] = part.try_into().expect("16-byte part");
            for j in 0..16 {
                acc[j] |= ((part[j] >> shift) & mask) << (k as u8 * W);
            }
        }
        dst.copy_from_slice(&acc);
    }
    // A last, shorter chunk: stride ceil(r / m) instead of 16.
    let src = src_chunks.remainder();
    if !src.is_empty() {
        let stride = src.len().div_ceil(m);
        let done = codes.len() / chunk * 16;
        let dst = &mut out[done..done + stride];
        dst.fill(0);
        for (k, part) in src.chunks(stride).enumerate() {
            for (d, &c) in dst.iter_mut().zip(part) {
                *d |= ((c >> shift) & mask) << (k as u8 * W);
            }
        }
    }
}

fn unpack_plane_w<const W: u8>(plane: &[u8], shift: u8, out: &mut [u8]) {
    let m = (8 / W) as usize;
    let mask = (1u8 << W) - 1;
    let chunk = 16 * m;
    let full = out.len() / chunk;
    for (dst, src) in out.chunks_exact_mut(chunk).zip(plane.chunks_exact(16)) {
        let src: &[u8; 16] = src.try_into().expect("16-byte chunk");
        for (k, part) in dst.chunks_exact_mut(16).enumerate() {
            for j in 0..16 {
                part[j] |= ((src[j] >> (k as u8 * W)) & mask) << shift;
            }
        }
    }
    let dst = &mut out[full * chunk..];
    if !dst.is_empty() {
        let src = &plane[full * 16..];
        let stride = dst.len().div_ceil(m);
        for (k, part) in dst.chunks_mut(stride).enumerate() {
            for (o, &b) in part.iter_mut().zip(src) {
                *o |= ((b >> (k as u8 * W)) & mask) << shift;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_dense() {
        assert_eq!(packed_len(128, 4).unwrap(), 64);
        assert_eq!(packed_len(128, 2).unwrap(), 32);
        assert_eq!(packed_len(8, 3).unwrap(), 3);
        assert_eq!(packed_len(128, 3).unwrap(), 48);
        assert_eq!(packed_len(64, 5).unwrap(), 40);
        assert_eq!(packed_len(7, 4).unwrap(), 4);
        assert!(packed_len(8, 0).is_err());
        assert!(packed_len(8, 9).is_err());
    }

    #[test]
    fn four_bit_layout_pairs_i_with_i_plus_16() {
        let codes: Vec<u8> = (0..32).map(|i| i % 16).collect();
        let packed = pack(&codes, 4).unwrap();
        for j in 0..16 {
            assert_eq!(packed[j] & 0xf, codes[j]);
            assert_eq!(packed[j] >> 4, codes[j + 16]);
        }
    }

    #[test]
    fn two_bit_layout_strides_by_16() {
        let codes: Vec<u8> = (0..64).map(|i| (i / 16) as u8).collect();
        let packed = pack(&codes, 2).unwrap();
        assert!(packed.iter().all(|&b| b == 0b11_10_01_00));
    }

    #[test]
    fn round_trips_every_length_and_width() {
        for bits in 1..=8u8 {
            for n in 0..300usize {
                let codes: Vec<u8> = (0..n).map(|i| ((i * 37 + n) % (1 << bits)) as u8).collect();
                let packed = pack(&codes, bits).unwrap();
                assert_eq!(packed.len(), packed_len(n, bits).unwrap());
                assert_eq!(unpack(&packed, bits, n).unwrap(), codes, "bits {bits} n {n}");
            }
        }
    }

    #[test]
    fn rejects_bad_input() {
        assert!(pack(&[16], 4).is_err());
        assert!(unpack(&[0; 3], 4, 8).is_err());
    }
}
