//! The randomized Hadamard rotation of `-rot` specs: `y = H · D · x / √d` per row of `d`
//! values, `D` a fixed diagonal of ±1 signs and `H` the Walsh–Hadamard matrix (`d` a power of
//! two).
//!
//! The rotation is orthonormal, so it keeps a row's norm and inner products, and it spreads
//! a few large channels over all of them: a row's values become close to Gaussian and its
//! range shrinks towards its norm, which is what a per-token grid wants. Attention reads
//! rotated values unchanged (`Σ p_t · R v_t = R · Σ p_t v_t`), so a cache stores rotated value
//! rows and applies [`unrotate_row`] to each output row once per step.
//!
//! The signs are part of the format: sign `i` is bit 0 of SplitMix64 of `i`, the same for
//! every model, head and version. Nothing is fitted or stored.

/// Whether rows of `d` values can be rotated (`d` a power of two, at least 2).
pub fn rotatable(d: usize) -> bool {
    d >= 2 && d.is_power_of_two()
}

/// The sign of channel `i`: bit 0 of SplitMix64(i).
#[inline]
fn sign(i: usize) -> f32 {
    let mut z = (i as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    if z & 1 == 0 { 1.0 } else { -1.0 }
}

/// The in-place Walsh–Hadamard transform of `x`, scaled by `1/√len` (orthonormal, its own
/// inverse).
fn hadamard(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (s, t) = (*u + *v, *u - *v);
                *u = s;
                *v = t;
            }
        }
        h *= 2;
    }
    let scale = 1.0 / (n as f32).sqrt();
    for v in x {
        *v *= scale;
    }
}

/// Rotates one row in place: `x ← H · D · x / √d`. Rows whose length is not a power of two
/// are left as they are (specs check [`rotatable`] first).
pub fn rotate_row(x: &mut [f32]) {
    if !rotatable(x.len()) {
        return;
    }
    for (i, v) in x.iter_mut().enumerate() {
        *v *= sign(i);
    }
    hadamard(x);
}

/// The inverse of [`rotate_row`]: `x ← D · H · x / √d`.
pub fn unrotate_row(x: &mut [f32]) {
    if !rotatable(x.len()) {
        return;
    }
    hadamard(x);
    for (i, v) in x.iter_mut().enumerate() {
        *v *= sign(i);
    }
}

/// Rotates every row of `d` values of `data`.
pub fn rotate_rows(data: &mut [f32], d: usize) {
    for row in data.chunks_exact_mut(d) {
        rotate_row(row);
    }
}

/// Unrotates every row of `d` values of `data`.
pub fn unrotate_rows(data: &mut [f32], d: usize) {
    for row in data.chunks_exact_mut(d) {
        unrotate_row(row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Rng;

    #[test]
    fn round_trips_and_keeps_norms_and_inner_products() {
        let mut rng = Rng::new(3);
        for d in [2usize, 4, 8, 64, 128, 256] {
            let x: Vec<f32> = (0..d).map(|_| rng.normal() as f32).collect();
            let y: Vec<f32> = (0..d).map(|_| rng.normal() as f32).collect();
            let (mut rx, mut ry) = (x.clone(), y.clone());
            rotate_row(&mut rx);
            rotate_row(&mut ry);
            let dot = |a: &[f32], b: &[f32]| {
                a.iter().zip(b).map(|(&u, &v)| f64::from(u) * f64::from(v)).sum::<f64>()
            };
            assert!((dot(&rx, &ry) - dot(&x, &y)).abs() < 1e-4 * d as f64, "d {d}");
            assert!((dot(&rx, &rx) - dot(&x, &x)).abs() < 1e-4 * d as f64, "d {d}");
            unrotate_row(&mut rx);
            for (a, b) in rx.iter().zip(&x) {
                assert!((a - b).abs() < 1e-5, "d {d}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn spreads_an_outlier_channel() {
        // One channel 100× the rest: after rotation no value is more than a few times the
        // row's RMS, where before one was 8× it (at d = 64).
        let mut x = vec![0.01f32; 64];
        x[5] = 1.0;
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / 64.0).sqrt();
        let before = x.iter().fold(0f32, |m, v| m.max(v.abs())) / rms;
        rotate_row(&mut x);
        let after = x.iter().fold(0f32, |m, v| m.max(v.abs())) / rms;
        assert!(before > 7.0 && after < 1.5, "{before} -> {after}");
    }

    #[test]
    fn the_signs_are_fixed_and_mixed() {
        let s: Vec<f32> = (0..64).map(sign).collect();
        let plus = s.iter().filter(|&&v| v > 0.0).count();
        assert!((20..=44).contains(&plus), "{plus} of 64 positive");
        // Part of the format: a change here changes what every rotated cache holds.
        let head: Vec<i8> = s[..16].iter().map(|&v| v as i8).collect();
        assert_eq!(head, [-1, -1, 1, -1, 1, 1, 1, -1, 1, 1, 1, -1, -1, -1, 1, -1]);
    }

    #[test]
    fn other_lengths_are_left_alone() {
        let mut x = vec![1.0f32, 2.0, 3.0];
        rotate_row(&mut x);
        assert_eq!(x, [1.0, 2.0, 3.0]);
        assert!(!rotatable(0) && !rotatable(1) && !rotatable(48) && rotatable(64));
    }
}
