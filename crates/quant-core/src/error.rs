//! Typed errors for every public entry point of the crate.

use crate::Shape;

/// Why a quantization, packing or metric call refused its input.
///
/// Every public function of this crate that can see bad input returns this type (or
/// [`TensorFileError`](crate::io::TensorFileError) for files); none of them panics on input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantError {
    /// The tensor has no elements.
    #[error("empty tensor: shape {0} holds no elements")]
    EmptyTensor(Shape),
    /// NaN or ±Inf in the input, at `[batch, head, token, channel]`.
    #[error("non-finite value {value} at [batch {}, head {}, token {}, channel {}]", .position[0], .position[1], .position[2], .position[3])]
    NonFinite {
        /// `[batch, head, token, channel]` of the first bad element.
        position: [usize; 4],
        /// The offending value.
        value: f32,
    },
    /// The bit width is outside what the format supports.
    #[error("{format} supports {min}..={max} bits, got {bits}")]
    BitsOutOfRange {
        /// Name of the format family.
        format: &'static str,
        /// Requested bit width.
        bits: u8,
        /// Smallest supported width.
        min: u8,
        /// Largest supported width.
        max: u8,
    },
    /// A group size of zero, or one that does not divide `head_dim`.
    #[error("group size {group} does not divide head_dim {head_dim}")]
    GroupSize {
        /// Requested group size.
        group: usize,
        /// The tensor's head dimension.
        head_dim: usize,
    },
    /// Two tensors (or a tensor and its data) disagree on their shape.
    #[error("shape mismatch: expected {expected}, got {got}")]
    ShapeMismatch {
        /// What the call needed.
        expected: String,
        /// What it was given.
        got: String,
    },
    /// A quantization parameter does not fit the chosen storage type (e.g. a range above
    /// 65504 stored as f16).
    #[error("parameter {value} overflows {dtype} storage")]
    ParamOverflow {
        /// The parameter that did not fit.
        value: f32,
        /// Storage type name.
        dtype: &'static str,
    },
    /// A spec string or codebook that cannot be used.
    #[error("invalid spec: {0}")]
    InvalidSpec(String),
    /// Arguments that make no sense together (e.g. a query position past the end).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Shorthand for results of this crate.
pub type Result<T, E = QuantError> = std::result::Result<T, E>;
