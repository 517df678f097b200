//! Reproducible synthetic data: a small, fixed pseudo-random generator (xoshiro256++ seeded
//! by SplitMix64) and standard normal samples (Box–Muller), so that benchmarks and snapshot
//! tests give the same numbers on every machine and every version of every dependency.

use crate::tensor::{Shape, Tensor};

/// xoshiro256++ (Blackman and Vigna), seeded through SplitMix64.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose whole stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Self { s: [next(), next(), next(), next()] }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A standard normal sample.
    pub fn normal(&mut self) -> f64 {
        // Box–Muller; 1 - u keeps the logarithm's argument in (0, 1].
        let u = 1.0 - self.uniform();
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// A tensor of standard normal values.
pub fn normal_tensor(shape: Shape, seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let data = (0..shape.len()).map(|_| rng.normal() as f32).collect();
    Tensor::new(shape, data).expect("length matches shape")
}
