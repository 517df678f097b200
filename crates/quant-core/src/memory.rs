//! Exact memory accounting: every code byte, every parameter and every stored codebook counts.

/// Bytes a quantized tensor occupies, split by purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct MemoryReport {
    /// Number of values represented.
    pub elements: usize,
    /// Bytes of packed codes.
    pub code_bytes: usize,
    /// Bytes of scales and offsets.
    pub param_bytes: usize,
    /// Bytes of codebook levels stored with the data (fitted codebooks; built-in tables such as
    /// NF4 or the FP8 decode table are part of the format and cost nothing per tensor).
    pub codebook_bytes: usize,
}

impl MemoryReport {
    /// All bytes.
    pub fn total_bytes(&self) -> usize {
        self.code_bytes + self.param_bytes + self.codebook_bytes
    }

    /// Bits per element, metadata included.
    pub fn bits_per_element(&self) -> f64 {
        if self.elements == 0 { 0.0 } else { self.total_bytes() as f64 * 8.0 / self.elements as f64 }
    }

    /// How many times smaller than the same values in f16.
    pub fn ratio_vs_f16(&self) -> f64 {
        self.ratio_vs(2)
    }

    /// How many times smaller than the same values in f32.
    pub fn ratio_vs_f32(&self) -> f64 {
        self.ratio_vs(4)
    }

    fn ratio_vs(&self, bytes_per_element: usize) -> f64 {
        let total = self.total_bytes();
        if total == 0 { 0.0 } else { (self.elements * bytes_per_element) as f64 / total as f64 }
    }

    /// The sum of two reports (e.g. K and V).
    pub fn combine(&self, other: &MemoryReport) -> MemoryReport {
        MemoryReport {
            elements: self.elements + other.elements,
            code_bytes: self.code_bytes + other.code_bytes,
            param_bytes: self.param_bytes + other.param_bytes,
            codebook_bytes: self.codebook_bytes + other.codebook_bytes,
        }
    }
}
