//! Checks shared by the region kernels' unit tests (`regions_avx2`, `regions_neon`): their
//! unpacking against quant-core's packing, and their scores, bit for bit against the
//! reference, on codes that end where an unreadable page begins.

use crate::memory::Guarded;
use crate::{KeyRegion, Levels, Params, QuantBlock, scalar};

/// A small generator of test bytes (xorshift32).
pub(crate) fn xorshift(mut seed: u32) -> impl FnMut() -> u32 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed
    }
}

/// Rows of every width and every multiple of 8 codes up to 256, packed by quant-core and
/// ending where an unreadable page begins (a read past them faults), come back from `unpack`
/// (the bytes and the width of a row) as their codes, zero in the padding to a multiple of
/// `pad`.
pub(crate) fn check_unpacking(pad: usize, mut unpack: impl FnMut(&[KeyRegion<'_>]) -> (Vec<u8>, usize)) {
    let mut next = xorshift(0x1234_5677);
    for bits in 1..=8u8 {
        for c in (8..=256).step_by(8) {
            let rows = 5;
            let codes: Vec<u8> = (0..rows * c).map(|_| (next() % (1 << bits)) as u8).collect();
            let mut packed = Vec::new();
            for row in codes.chunks_exact(c) {
                packed.extend(kvq_quant_core::pack::pack(row, bits).unwrap());
            }
            let (scale, offset) = (vec![1f32; c], vec![0f32; c]);
            let params = Params::PerChannel { scale: &scale, offset: Some(&offset) };
            let packed = Guarded::new(&packed);
            let keys = QuantBlock::new(packed.bytes(), rows, c, bits, Levels::Affine, params).unwrap();
            let (got, width) = unpack(&[KeyRegion { first: 0, keys }]);
            assert_eq!(width, c.next_multiple_of(pad));
            for (r, want) in codes.chunks_exact(c).enumerate() {
                let row = &got[r * width..(r + 1) * width];
                assert_eq!(&row[..c], want, "{bits} bits, {c} codes, row {r}");
                assert!(row[c..].iter().all(|&x| x == 0), "{bits} bits, {c} codes: padding");
            }
        }
    }
}

/// Regions whose codes end where an unreadable page begins, rows of 1 to 256 bytes (an
/// 8-channel 1-bit region: one byte a row): `scores` (four query rows) must read the last
/// rows' windows from a copy, never from past the codes, and give the reference's scores
/// bit for bit.
pub(crate) fn check_guarded_scores(mut scores: impl FnMut(&[KeyRegion<'_>], &[f32], &mut [f32]) -> bool) {
    let layouts: [&[(usize, u8)]; 3] = [
        &[(8, 1), (8, 2), (8, 3), (8, 4), (8, 5), (8, 6), (8, 7), (8, 8)],
        &[(24, 3), (40, 4), (64, 1)],
        &[(200, 4), (56, 8)],
    ];
    let mut next = xorshift(0x9e37_79b9);
    for shapes in layouts {
        let d: usize = shapes.iter().map(|s| s.0).sum();
        for rows in [1usize, 2, 3, 17] {
            let data: Vec<(Guarded, Vec<f32>, Vec<f32>)> = shapes
                .iter()
                .map(|&(c, bits)| {
                    let codes: Vec<u8> =
                        (0..rows * c * usize::from(bits) / 8).map(|_| next() as u8).collect();
                    let scale = (0..c).map(|_| (next() % 1000) as f32 / 1000.0 + 0.01).collect();
                    let offset = (0..c).map(|_| (next() % 2000) as f32 / 1000.0 - 1.0).collect();
                    (Guarded::new(&codes), scale, offset)
                })
                .collect();
            let mut first = 0;
            let regions: Vec<KeyRegion<'_>> = shapes
                .iter()
                .zip(&data)
                .map(|(&(c, bits), (g, scale, offset))| {
                    let params = Params::PerChannel { scale, offset: Some(offset) };
                    let keys = QuantBlock::new(g.bytes(), rows, c, bits, Levels::Affine, params).unwrap();
                    let r = KeyRegion { first, keys };
                    first += c;
                    r
                })
                .collect();
            let q: Vec<f32> = (0..4 * d).map(|_| (next() % 2000) as f32 / 1000.0 - 1.0).collect();
            let (mut got, mut want) = (vec![0f32; 4 * rows], vec![0f32; 4 * rows]);
            assert!(scores(&regions, &q, &mut got), "{shapes:?}");
            assert!(scalar::scores_int8_regions(&regions, &q, 4, &mut want));
            for (g, x) in got.iter().zip(&want) {
                assert_eq!(g.to_bits(), x.to_bits(), "{shapes:?} rows {rows}: {g} vs {x}");
            }
        }
    }
}
