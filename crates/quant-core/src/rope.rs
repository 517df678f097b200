//! Which channels of a head rotate together under rotary position embeddings (RoPE).
//!
//! After RoPE, channels `a` and `b` of a pair are the two coordinates of one rotating 2-D
//! vector: a quantizer that works on pairs (bits per frequency, 2-D codebooks) must know which
//! channels those are. Checkpoints differ: Hugging Face Llama checkpoints (and the shared
//! captures of this project) rotate the halves of a head, `(i, i + d/2)`; GGUF Llama weights
//! are permuted for llama.cpp's interleaved pairs, `(2i, 2i + 1)`.

/// How a head's channels pair under RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RopePairing {
    /// Pair `i` is channels `(2i, 2i + 1)` (llama.cpp's "normal" RoPE, GGUF Llama weights).
    Interleaved,
    /// Pair `i` is channels `(i, i + d/2)` (rotate-half, "NeoX"; Hugging Face checkpoints).
    Half,
}

impl RopePairing {
    /// The two channels of pair `i` in a head of `head_dim` channels (`i < head_dim / 2`).
    pub fn channels(self, i: usize, head_dim: usize) -> (usize, usize) {
        match self {
            RopePairing::Interleaved => (2 * i, 2 * i + 1),
            RopePairing::Half => (i, i + head_dim / 2),
        }
    }

    /// The lower-case name used in configs (`"interleaved"`, `"half"`).
    pub fn name(self) -> &'static str {
        match self {
            RopePairing::Interleaved => "interleaved",
            RopePairing::Half => "half",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_cover_every_channel_once() {
        for pairing in [RopePairing::Interleaved, RopePairing::Half] {
            let mut seen = [0u8; 64];
            for i in 0..32 {
                let (a, b) = pairing.channels(i, 64);
                seen[a] += 1;
                seen[b] += 1;
            }
            assert!(seen.iter().all(|&n| n == 1), "{pairing:?}");
        }
        assert_eq!(RopePairing::Half.channels(3, 64), (3, 35));
        assert_eq!(RopePairing::Interleaved.channels(3, 64), (6, 7));
    }
}
