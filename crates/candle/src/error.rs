//! Why a call of this crate failed.

/// Errors of `kvq-candle`: every bad input (model file, tokens, shapes, cache config) is one of
/// these, never a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A candle operation failed (tensor shapes, dtypes, GGUF parsing inside candle).
    #[error("candle: {}", candle_message(.0))]
    Candle(#[from] candle_core::Error),
    /// kvq's cache refused a call or a config.
    #[error(transparent)]
    Kvq(#[from] kvq::cache::KvqError),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The model file is malformed: missing or inconsistent metadata, tensors of the wrong
    /// shape, data past the end of the file.
    #[error("model {path}: {reason}")]
    Model {
        /// The file (or `"<memory>"`).
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The model uses something this crate does not implement (architecture, weight type,
    /// partial RoPE, ...).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A token id outside the vocabulary.
    #[error("token {token} at position {position} is outside the vocabulary of {vocab} tokens")]
    Token {
        /// The id.
        token: u32,
        /// Its index in the input.
        position: usize,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A tensor or slice of the wrong shape, dtype or device.
    #[error("shape: {0}")]
    Shape(String),
    /// A cache config that does not fit the model (layers, heads, head_dim).
    #[error("cache config does not fit the model: {0}")]
    ConfigMismatch(String),
    /// Invalid evaluation input (too few tokens for the protocol, bad options).
    #[error("eval: {0}")]
    Eval(String),
    /// The model's hidden state overflowed (a non-finite value after a layer): a broken
    /// model file, or weights this input drives out of range.
    #[error("the model produced a non-finite value in layer {layer} at position {position}")]
    NonFinite {
        /// The decoder layer (0-based); the number of layers for the output head.
        layer: usize,
        /// The token's position in its sequence.
        position: usize,
    },
    /// Tokenization failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// A candle error's message without the backtrace candle appends when `RUST_BACKTRACE` is
/// set: one line for the user, the backtrace stays in the error for a debugger.
pub(crate) fn candle_message(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => candle_message(inner),
        other => other.to_string(),
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
