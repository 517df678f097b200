//! Owned f32 tensors laid out as `[batch, heads, tokens, head_dim]`, row-major.
//!
//! Every K/V/Q tensor of this crate has this layout: a *row* is one token of one head
//! (`head_dim` contiguous values), and rows are ordered by batch, then head, then token.

use std::fmt;

use crate::error::{QuantError, Result};

/// The shape of a K/V/Q tensor: `[batch, heads, tokens, head_dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Independent sequences (1 for a single sequence).
    pub batch: usize,
    /// Attention heads (KV heads for K and V, query heads for Q).
    pub heads: usize,
    /// Tokens (sequence positions).
    pub tokens: usize,
    /// Channels per head.
    pub head_dim: usize,
}

impl Shape {
    /// A `[heads, tokens, head_dim]` shape (batch 1).
    pub const fn new(heads: usize, tokens: usize, head_dim: usize) -> Self {
        Self { batch: 1, heads, tokens, head_dim }
    }

    /// A `[batch, heads, tokens, head_dim]` shape.
    pub const fn with_batch(batch: usize, heads: usize, tokens: usize, head_dim: usize) -> Self {
        Self { batch, heads, tokens, head_dim }
    }

    /// Number of elements, or `None` if it overflows `usize`.
    pub fn checked_len(&self) -> Option<usize> {
        self.batch.checked_mul(self.heads)?.checked_mul(self.tokens)?.checked_mul(self.head_dim)
    }

    /// Number of elements (saturating; use [`Shape::checked_len`] on untrusted shapes).
    pub fn len(&self) -> usize {
        self.checked_len().unwrap_or(usize::MAX)
    }

    /// True when any axis is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of rows (`batch × heads × tokens`).
    pub fn rows(&self) -> usize {
        self.batch * self.heads * self.tokens
    }

    /// `[batch, head, token, channel]` of flat element index `i`.
    pub fn position(&self, i: usize) -> [usize; 4] {
        let d = i % self.head_dim.max(1);
        let row = i / self.head_dim.max(1);
        let t = row % self.tokens.max(1);
        let bh = row / self.tokens.max(1);
        [bh / self.heads.max(1), bh % self.heads.max(1), t, d]
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.batch == 1 {
            write!(f, "[{}, {}, {}]", self.heads, self.tokens, self.head_dim)
        } else {
            write!(f, "[{}, {}, {}, {}]", self.batch, self.heads, self.tokens, self.head_dim)
        }
    }
}

/// An owned, validated f32 tensor in `[batch, heads, tokens, head_dim]` layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Shape,
    data: Vec<f32>,
}

impl Tensor {
    /// Wraps `data` as a tensor of `shape`.
    ///
    /// # Errors
    /// [`QuantError::ShapeMismatch`] when `data.len()` differs from the shape's element count.
    /// Empty and non-finite data are accepted here and refused by the operations that
    /// cannot handle them, so that a tensor can be inspected before it is used.
    pub fn new(shape: Shape, data: Vec<f32>) -> Result<Self> {
        if shape.checked_len() != Some(data.len()) {
            return Err(QuantError::ShapeMismatch {
                expected: format!("{} elements for shape {shape}", shape.len()),
                got: format!("{} elements", data.len()),
            });
        }
        Ok(Self { shape, data })
    }

    /// The tensor's shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// All elements, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// Consumes the tensor, returning its elements.
    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    /// One row: `head_dim` channels of token `token` of head `head` of sequence `batch`.
    ///
    /// # Panics
    /// When an index is out of range (an internal-use accessor; bounds are the caller's).
    pub fn row(&self, batch: usize, head: usize, token: usize) -> &[f32] {
        let s = self.shape;
        assert!(batch < s.batch && head < s.heads && token < s.tokens, "row index out of range");
        let start = ((batch * s.heads + head) * s.tokens + token) * s.head_dim;
        &self.data[start..start + s.head_dim]
    }

    /// The first `tokens` tokens of every head (a causal prefix of the sequence).
    ///
    /// # Errors
    /// [`QuantError::InvalidArgument`] when `tokens` exceeds the tensor's length.
    pub fn prefix(&self, tokens: usize) -> Result<Tensor> {
        let s = self.shape;
        if tokens > s.tokens {
            return Err(QuantError::InvalidArgument(format!(
                "prefix of {tokens} tokens from a tensor of {}",
                s.tokens
            )));
        }
        let mut data = Vec::with_capacity(s.batch * s.heads * tokens * s.head_dim);
        for bh in 0..s.batch * s.heads {
            let start = bh * s.tokens * s.head_dim;
            data.extend_from_slice(&self.data[start..start + tokens * s.head_dim]);
        }
        Tensor::new(Shape { tokens, ..s }, data)
    }

    /// Checks that the tensor is non-empty and finite.
    ///
    /// # Errors
    /// [`QuantError::EmptyTensor`], or [`QuantError::NonFinite`] naming the first bad element.
    pub fn validate(&self) -> Result<()> {
        if self.data.is_empty() {
            return Err(QuantError::EmptyTensor(self.shape));
        }
        check_finite(self.shape, &self.data)
    }
}

/// Errors with the position of the first NaN or ±Inf of `data`, interpreted with `shape`.
pub(crate) fn check_finite(shape: Shape, data: &[f32]) -> Result<()> {
    // An f32 is NaN or infinite exactly when its exponent bits are all ones. OR-ing a flag per
    // element over fixed-size chunks vectorizes; the slow search runs only when one is found.
    const EXP: u32 = 0x7f80_0000;
    let mut chunks = data.chunks_exact(16);
    let mut bad = 0u32;
    for c in &mut chunks {
        for &x in c {
            bad |= u32::from(x.to_bits() & EXP == EXP);
        }
    }
    for &x in chunks.remainder() {
        bad |= u32::from(x.to_bits() & EXP == EXP);
    }
    if bad == 0 {
        return Ok(());
    }
    match data.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(QuantError::NonFinite { position: shape.position(i), value: data[i] }),
        None => Ok(()),
    }
}
