//! GGML's K-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 values each) read as eight blocks of
//! 32 values with f32 parameters, for [`crate::ggml_packed`] to repack. The reading is exact:
//! every parameter is an f16 (`d`, `dmin`) times a small integer (a 6-bit scale or minimum, or
//! Q6_K's signed 8-bit scale), at most 19 significant bits, which an f32 holds; the codes are
//! the stored ones.

use half::f16;

use crate::ggml::{GgmlType, QK, QK_K};

/// Blocks of 32 per super-block.
pub(crate) const BLOCKS: usize = QK_K / QK;

/// One block of 32 values of a super-block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Block32 {
    /// Q4_K and Q5_K: the scale and the offset, value `params[0] * code + params[1]`; Q6_K:
    /// the scales of values 0..16 and 16..32, value `params[h] * code`.
    pub params: [f32; 2],
    /// The codes in the order of the values: Q4_K's 0..16 and Q5_K's 0..32 as they are,
    /// Q6_K's `q - 32` as a signed byte.
    pub codes: [u8; QK],
}

impl Default for Block32 {
    fn default() -> Self {
        Self { params: [0.0; 2], codes: [0; QK] }
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and minimum of block `j` of a Q4_K or Q5_K super-block, from its 12 bytes
/// of packed scales: blocks 0..4 in the low six bits of bytes `j` and `j + 4`; blocks 4..8 in
/// the nibbles of byte `j + 4` with their top two bits in the spare bits of bytes `j - 4`
/// and `j`.
fn scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Reads one super-block of `ty` (a K-quant; `sb` is its [`GgmlType::block_bytes`] bytes)
/// into `out`.
pub(crate) fn decode(ty: GgmlType, sb: &[u8], out: &mut [Block32; BLOCKS]) {
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => {
            // d, dmin, 12 bytes of scales, then (Q5_K) 32 bytes of fifth bits, then 128 bytes
            // of nibbles: bytes 32c..32c + 32 hold blocks 2c (low) and 2c + 1 (high).
            let (d, dmin) = (half(sb, 0), half(sb, 2));
            let scales = &sb[4..16];
            let (high, low) =
                if ty == GgmlType::Q5K { (Some(&sb[16..48]), &sb[48..176]) } else { (None, &sb[16..144]) };
            for (j, block) in out.iter_mut().enumerate() {
                let (sc, m) = scale_min(j, scales);
                block.params = [d * f32::from(sc), -(dmin * f32::from(m))];
                let bytes = &low[32 * (j / 2)..32 * (j / 2) + 32];
                for (l, c) in block.codes.iter_mut().enumerate() {
                    let nibble = if j % 2 == 0 { bytes[l] & 0x0F } else { bytes[l] >> 4 };
                    *c = nibble + high.map_or(0, |h| ((h[l] >> j) & 1) << 4);
                }
            }
        }
        GgmlType::Q6K => {
            // 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, d. Each half of
            // 128 values takes 64 nibble bytes and 32 pair bytes: its block s (of 4) takes the
            // low (s = 0, 1) or high (s = 2, 3) nibbles of bytes 0..32 (s even) or 32..64, and
            // the pair at bits 2s of the pair bytes.
            let d = half(sb, 208);
            for (j, block) in out.iter_mut().enumerate() {
                let (h, s) = (j / 4, j % 4);
                let ql = &sb[64 * h + 32 * (s % 2)..64 * h + 32 * (s % 2) + 32];
                let qh = &sb[128 + 32 * h..128 + 32 * h + 32];
                let sc = &sb[192 + 8 * h + 2 * s..192 + 8 * h + 2 * s + 2];
                block.params = [d * f32::from(sc[0] as i8), d * f32::from(sc[1] as i8)];
                for (l, c) in block.codes.iter_mut().enumerate() {
                    let low = if s < 2 { ql[l] & 0x0F } else { ql[l] >> 4 };
                    let q = low | (((qh[l] >> (2 * s)) & 3) << 4);
                    *c = (q as i8 - 32) as u8;
                }
            }
        }
        _ => unreachable!("{ty:?} is not a K-quant"),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Random super-blocks of `ty`: any bytes are valid codes and scales; `d` and `dmin` small
    /// finite f16s (`extreme`: every code and scale at its largest).
    pub(crate) fn superblocks(ty: GgmlType, count: usize, seed: u64, extreme: bool) -> Vec<u8> {
        let mut next = crate::ggml::tests::xorshift(seed);
        let mut out = Vec::new();
        for _ in 0..count {
            let mut sb: Vec<u8> =
                (0..ty.block_bytes()).map(|_| if extreme { 0xFF } else { next() as u8 }).collect();
            let d = f16::from_f32((next() % 1000) as f32 / 2e6 + 1e-5).to_le_bytes();
            let dmin = f16::from_f32((next() % 1000) as f32 / 4e6).to_le_bytes();
            if ty == GgmlType::Q6K {
                sb[208..210].copy_from_slice(&d);
                if extreme {
                    // The scale of largest magnitude, -128, on every sub-block.
                    sb[192..208].fill(0x80);
                }
            } else {
                sb[0..2].copy_from_slice(&d);
                sb[2..4].copy_from_slice(&dmin);
            }
            out.extend_from_slice(&sb);
        }
        out
    }

    /// ggml's own dequantization loops (`dequantize_row_q4_K`, `_q5_K`, `_q6_K`), written
    /// from the format rather than from [`decode`], in f64.
    pub(crate) fn dequantize(ty: GgmlType, sb: &[u8]) -> Vec<f64> {
        let mut y = Vec::with_capacity(QK_K);
        let h = |at: usize| f64::from(f16::from_le_bytes([sb[at], sb[at + 1]]).to_f32());
        match ty {
            GgmlType::Q4K | GgmlType::Q5K => {
                let (d, min) = (h(0), h(2));
                let q5 = ty == GgmlType::Q5K;
                let ql = if q5 { &sb[48..] } else { &sb[16..] };
                let (mut u1, mut u2) = (1u8, 2u8);
                for c in 0..4 {
                    let (sc1, m1) = scale_min(2 * c, &sb[4..16]);
                    let (sc2, m2) = scale_min(2 * c + 1, &sb[4..16]);
                    let q = &ql[32 * c..32 * c + 32];
                    for (l, &b) in q.iter().enumerate() {
                        let hi = if q5 && sb[16 + l] & u1 != 0 { 16.0 } else { 0.0 };
                        y.push(d * f64::from(sc1) * (f64::from(b & 0x0F) + hi) - min * f64::from(m1));
                    }
                    for (l, &b) in q.iter().enumerate() {
                        let hi = if q5 && sb[16 + l] & u2 != 0 { 16.0 } else { 0.0 };
                        y.push(d * f64::from(sc2) * (f64::from(b >> 4) + hi) - min * f64::from(m2));
                    }
                    u1 <<= 2;
                    u2 <<= 2;
                }
            }
            GgmlType::Q6K => {
                let d = h(208);
                for half in 0..2 {
                    let (ql, qh, sc) = (&sb[64 * half..], &sb[128 + 32 * half..], &sb[192 + 8 * half..]);
                    let mut part = [0f64; 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = i32::from((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
                        let q2 = i32::from((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                        let s = |i: usize| d * f64::from(sc[i] as i8);
                        part[l] = s(is) * f64::from(q1);
                        part[l + 32] = s(is + 2) * f64::from(q2);
                        part[l + 64] = s(is + 4) * f64::from(q3);
                        part[l + 96] = s(is + 6) * f64::from(q4);
                    }
                    y.extend_from_slice(&part);
                }
            }
            _ => unreachable!(),
        }
        y
    }

    #[test]
    fn decoding_gives_ggml_s_values_exactly() {
        for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
            for extreme in [false, true] {
                let raw = superblocks(ty, 5, 11 + ty.block_bytes() as u64, extreme);
                for sb in raw.chunks_exact(ty.block_bytes()) {
                    let mut blocks = [Block32::default(); BLOCKS];
                    decode(ty, sb, &mut blocks);
                    let want = dequantize(ty, sb);
                    for (j, b) in blocks.iter().enumerate() {
                        for (l, &c) in b.codes.iter().enumerate() {
                            let got = if ty == GgmlType::Q6K {
                                f64::from(b.params[l / 16]) * f64::from(c as i8)
                            } else {
                                f64::from(b.params[0]) * f64::from(c) + f64::from(b.params[1])
                            };
                            // The same f16 times integers, exact in f32 and in f64.
                            assert_eq!(got, want[j * QK + l], "{ty:?} extreme {extreme} block {j} value {l}");
                        }
                    }
                }
            }
        }
    }
}
