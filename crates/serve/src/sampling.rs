//! Choosing the next token from a row of logits: greedy, or temperature with top-k, top-p and
//! min-p, after repetition, frequency and presence penalties, from a seeded generator.
//!
//! The order is llama.cpp's default chain: penalties, top-k, temperature, then top-p and min-p
//! on the softmax of what is left, then a draw. A temperature of 0 is greedy (the first
//! largest logit after penalties), whatever the other settings.

use std::collections::HashMap;

/// How one request samples; [`SamplingParams::default`] is greedy with no penalty.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 for greedy; otherwise logits are divided by it. 0 to 2.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (0 to 1].
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one, [0, 1).
    pub min_p: f32,
    /// Logits of tokens already in the context (prompt and output) are divided by it when
    /// positive and multiplied when negative (1: off), as llama.cpp and HF transformers do.
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted once per earlier occurrence in the output, -2 to 2.
    pub frequency_penalty: f32,
    /// OpenAI's: subtracted once from every token the output already holds, -2 to 2.
    pub presence_penalty: f32,
    /// The generator's seed (a request without one gets a fresh seed).
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks every value's range.
    ///
    /// # Errors
    /// A message naming the parameter and its range.
    pub fn validate(&self) -> Result<(), String> {
        let checks: [(&str, f32, bool, &str); 6] = [
            ("temperature", self.temperature, (0.0..=2.0).contains(&self.temperature), "0 to 2"),
            ("top_p", self.top_p, self.top_p > 0.0 && self.top_p <= 1.0, "greater than 0, at most 1"),
            ("min_p", self.min_p, (0.0..1.0).contains(&self.min_p), "0 to under 1"),
            (
                "repetition_penalty",
                self.repetition_penalty,
                self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0,
                "greater than 0, at most 10",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                (-2.0..=2.0).contains(&self.frequency_penalty),
                "-2 to 2",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                (-2.0..=2.0).contains(&self.presence_penalty),
                "-2 to 2",
            ),
        ];
        for (name, value, ok, range) in checks {
            if !ok {
                return Err(format!("{name} is {value}; it must be {range}"));
            }
        }
        Ok(())
    }

    /// Whether this is greedy decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A small, fast, seedable generator (SplitMix64); sampling needs no cryptographic quality,
/// and a fixed algorithm keeps a seed's output the same across releases of any crate.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// The generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One request's sampler: its parameters, generator and the counts its penalties need.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    /// Occurrences in the output (frequency and presence penalties).
    output_counts: HashMap<u32, u32>,
    /// Tokens of the prompt and output (repetition penalty).
    seen: HashMap<u32, ()>,
    /// Scratch: (token, logit) candidates.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for a request whose context starts with `prompt`.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = SplitMix64::new(params.seed);
        let seen = prompt.iter().map(|&t| (t, ())).collect();
        Self { params, rng, output_counts: HashMap::new(), seen, candidates: Vec::new() }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token (for the penalties).
    pub fn accept(&mut self, token: u32) {
        *self.output_counts.entry(token).or_default() += 1;
        self.seen.insert(token, ());
    }

    /// The next token for `logits` (one row, the vocabulary). Non-finite logits are never
    /// chosen; a row with no finite logit is `None`.
    pub fn sample(&mut self, logits: &[f32]) -> Option<u32> {
        let p = &self.params;
        self.candidates.clear();
        self.candidates.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        // The penalties, on the few tokens they touch (not a lookup per vocabulary entry).
        let row = &mut self.candidates;
        if p.repetition_penalty != 1.0 {
            for &t in self.seen.keys() {
                if let Some(c) = row.get_mut(t as usize) {
                    let l = c.1;
                    c.1 = if l > 0.0 { l / p.repetition_penalty } else { l * p.repetition_penalty };
                }
            }
        }
        for (&t, &n) in &self.output_counts {
            if let Some(c) = row.get_mut(t as usize) {
                c.1 -= p.frequency_penalty * n as f32 + p.presence_penalty;
            }
        }
        // Tokens whose logit (as given) is not finite are never candidates.
        let mut i = 0;
        row.retain(|_| {
            i += 1;
            logits[i - 1].is_finite()
        });
        if self.candidates.is_empty() {
            return None;
        }
        if p.is_greedy() {
            // The first of the largest, as an argmax over the row.
            let best = self.candidates.iter().fold(self.candidates[0], |b, &c| if c.1 > b.1 { c } else { b });
            return Some(best.0);
        }
        // Largest first; ties by token id so that a seed always gives the same draw.
        self.candidates.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            self.candidates.truncate(p.top_k);
        }
        let t = p.temperature;
        let max = self.candidates[0].1 / t;
        let mut sum = 0f64;
        for c in &mut self.candidates {
            c.1 = ((c.1 / t - max) as f64).exp() as f32;
            sum += f64::from(c.1);
        }
        // Top-p: the smallest head whose mass reaches top_p; min-p: relative to the largest.
        let mut keep = self.candidates.len();
        if p.top_p < 1.0 {
            let mut acc = 0f64;
            for (i, c) in self.candidates.iter().enumerate() {
                acc += f64::from(c.1) / sum;
                if acc >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * self.candidates[0].1;
            keep = keep.min(self.candidates.iter().take_while(|c| c.1 >= floor).count().max(1));
        }
        self.candidates.truncate(keep);
        let total: f64 = self.candidates.iter().map(|c| f64::from(c.1)).sum();
        let mut r = self.rng.next_f64() * total;
        for c in &self.candidates {
            r -= f64::from(c.1);
            if r < 0.0 {
                return Some(c.0);
            }
        }
        self.candidates.last().map(|c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, seed: 7, ..SamplingParams::default() }
    }

    #[test]
    fn greedy_takes_the_first_largest_and_skips_non_finite_logits() {
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        assert_eq!(s.sample(&[0.1, 3.0, f32::NAN, 3.0, f32::INFINITY]), Some(1));
        assert_eq!(s.sample(&[f32::NAN, f32::NEG_INFINITY]), None);
    }

    #[test]
    fn a_seed_gives_the_same_draws_and_draws_follow_the_probabilities() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params(1.0) }, &[]);
            (0..4000).map(|_| s.sample(&logits).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        let counts = draw(5).iter().fold([0usize; 4], |mut c, &t| {
            c[t as usize] += 1;
            c
        });
        // softmax: 0.032, 0.087, 0.237, 0.644.
        let expect = [0.032, 0.087, 0.237, 0.644];
        for (c, e) in counts.iter().zip(expect) {
            let got = *c as f64 / 4000.0;
            assert!((got - e).abs() < 0.03, "{counts:?}");
        }
    }

    #[test]
    fn top_k_top_p_and_min_p_cut_the_tail() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let seen = |p: SamplingParams| {
            let mut s = Sampler::new(p, &[]);
            let mut seen: Vec<u32> = (0..2000).map(|_| s.sample(&logits).unwrap()).collect();
            seen.sort_unstable();
            seen.dedup();
            seen
        };
        assert_eq!(seen(SamplingParams { top_k: 2, ..params(1.0) }), [2, 3]);
        // 0.644 < 0.8 <= 0.644 + 0.237.
        assert_eq!(seen(SamplingParams { top_p: 0.8, ..params(1.0) }), [2, 3]);
        // 0.3 * 0.644 = 0.19: keeps 0.237 and 0.644.
        assert_eq!(seen(SamplingParams { min_p: 0.3, ..params(1.0) }), [2, 3]);
        assert_eq!(seen(SamplingParams { top_k: 1, ..params(1.0) }), [3]);
    }

    #[test]
    fn penalties_lower_what_was_seen() {
        let logits = [2.0f32, 1.9, -1.0];
        let mut s =
            Sampler::new(SamplingParams { repetition_penalty: 1.2, ..SamplingParams::default() }, &[0]);
        assert_eq!(s.sample(&logits), Some(1), "2.0 / 1.2 < 1.9");
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 0.2, ..SamplingParams::default() }, &[]);
        assert_eq!(s.sample(&logits), Some(0));
        s.accept(0);
        assert_eq!(s.sample(&logits), Some(1), "2.0 - 0.2 < 1.9");
        let mut s = Sampler::new(SamplingParams { presence_penalty: 2.0, ..SamplingParams::default() }, &[]);
        s.accept(0);
        s.accept(0);
        assert_eq!(s.sample(&logits), Some(1), "once per token: 2.0 - 2.0 < 1.9");
        // Negative logits are multiplied; a seen token with a non-finite logit stays out; the
        // penalties add up (repetition first).
        let p =
            SamplingParams { repetition_penalty: 1.2, presence_penalty: 0.5, ..SamplingParams::default() };
        let mut s = Sampler::new(p, &[0, 1, 5]);
        assert_eq!(s.sample(&[-1.0, -1.1, -1.15]), Some(2), "-1.2 and -1.32 < -1.15");
        assert_eq!(s.sample(&[f32::NAN, -3.0, f32::NEG_INFINITY]), Some(1));
        s.accept(2);
        assert_eq!(s.sample(&[-1.0, -1.3, -0.6]), Some(0), "-1.2 > -0.6 · 1.2 - 0.5 and -1.56");
    }

    #[test]
    fn out_of_range_parameters_are_named() {
        for (p, name) in [
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { temperature: f32::NAN, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { min_p: 1.0, ..Default::default() }, "min_p"),
            (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty"),
            (SamplingParams { frequency_penalty: 3.0, ..Default::default() }, "frequency_penalty"),
            (SamplingParams { presence_penalty: f32::INFINITY, ..Default::default() }, "presence_penalty"),
        ] {
            assert!(p.validate().unwrap_err().starts_with(name), "{name}");
        }
        assert!(SamplingParams::default().validate().is_ok());
    }
}
