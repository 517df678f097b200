//! Reading K/V/Q tensors from safetensors files (f32, f16 or bf16).
//!
//! A rank-3 tensor is read as `[heads, tokens, head_dim]`, a rank-4 one as
//! `[batch, heads, tokens, head_dim]`. The whole file is held in memory; the header and every
//! tensor's extent are validated when the file is opened.

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::tensor::{Shape, Tensor};

/// Why a tensor file could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TensorFileError {
    /// The file could not be read from disk.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not valid safetensors (corrupt, truncated or not safetensors at all).
    #[error("{file}: not a valid safetensors file: {reason}")]
    Corrupt {
        /// The file.
        file: String,
        /// What the parser said.
        reason: String,
    },
    /// No tensor of that name.
    #[error("{file}: no tensor named {name:?} (the file has {available} tensors)")]
    MissingTensor {
        /// The file.
        file: String,
        /// The requested name.
        name: String,
        /// How many tensors the file does have.
        available: usize,
    },
    /// The tensor's element type is not f32, f16 or bf16.
    #[error("{file}: tensor {name:?} has dtype {dtype}; expected F32, F16 or BF16")]
    UnsupportedDtype {
        /// The file.
        file: String,
        /// The tensor.
        name: String,
        /// Its dtype, as safetensors names it.
        dtype: String,
    },
    /// The tensor is not of rank 3 or 4.
    #[error(
        "{file}: tensor {name:?} has shape {shape:?}; expected [heads, tokens, head_dim] or [batch, heads, tokens, head_dim]"
    )]
    WrongRank {
        /// The file.
        file: String,
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
    },
}

/// The largest safetensors file [`TensorFile::open`] reads (it holds the whole file in memory).
pub const MAX_TENSOR_FILE_BYTES: u64 = 1 << 38;

/// Reads a whole file that must be a regular file of at most `max_bytes` bytes. Devices,
/// FIFOs and directories are refused before they are opened (`/dev/zero` would otherwise be
/// read until memory runs out, a FIFO would block), and so is a file larger than `max_bytes`;
/// the buffer is reserved fallibly.
///
/// # Errors
/// [`std::io::ErrorKind::InvalidInput`] for a file that is not regular or too large,
/// [`std::io::ErrorKind::OutOfMemory`] when its buffer cannot be had, and the I/O errors of
/// reading it.
pub fn read_regular_file(path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind, Read};
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    if meta.len() > max_bytes {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("{} bytes is over the limit of {max_bytes}", meta.len()),
        ));
    }
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(meta.len() as usize)
        .map_err(|_| Error::new(ErrorKind::OutOfMemory, format!("cannot hold {} bytes", meta.len())))?;
    // `take` bounds the read even if the file grows while it is read.
    std::fs::File::open(path)?.take(max_bytes + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(Error::new(ErrorKind::InvalidInput, format!("over the limit of {max_bytes} bytes")));
    }
    Ok(bytes)
}

/// Writes `bytes` to `path` atomically: into a temporary file in the same directory, flushed
/// to disk, then renamed over `path` (and the directory flushed), so that a crash or a full
/// disk leaves either the previous file or the new one, never a torn file.
///
/// # Errors
/// The I/O errors of creating, writing, flushing or renaming; `path` is unchanged then.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new().prefix(".kvq-").suffix(".tmp").tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    // The rename itself is durable once the directory is flushed (not possible everywhere).
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Name, dtype and shape of one tensor of a file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TensorInfo {
    /// The tensor's name.
    pub name: String,
    /// Its dtype as safetensors names it (`F16`, `BF16`, `F32`, ...).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
}

/// A safetensors file held in memory.
#[derive(Debug, Clone)]
pub struct TensorFile {
    label: String,
    bytes: Vec<u8>,
}

impl TensorFile {
    /// Reads and validates a file.
    ///
    /// # Errors
    /// [`TensorFileError::Io`] or [`TensorFileError::Corrupt`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TensorFileError> {
        let path = path.as_ref();
        let label = path.display().to_string();
        let bytes = read_regular_file(path, MAX_TENSOR_FILE_BYTES)
            .map_err(|source| TensorFileError::Io { file: label.clone(), source })?;
        Self::from_bytes(label, bytes)
    }

    /// Validates bytes already in memory; `label` names them in errors.
    ///
    /// # Errors
    /// [`TensorFileError::Corrupt`].
    pub fn from_bytes(label: impl Into<String>, bytes: Vec<u8>) -> Result<Self, TensorFileError> {
        let label = label.into();
        SafeTensors::deserialize(&bytes)
            .map_err(|e| TensorFileError::Corrupt { file: label.clone(), reason: e.to_string() })?;
        Ok(Self { label, bytes })
    }

    /// What errors call this file.
    pub fn label(&self) -> &str {
        &self.label
    }

    fn parsed(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("validated when the file was opened")
    }

    /// Every tensor of the file, sorted by name.
    pub fn list(&self) -> Vec<TensorInfo> {
        let mut out: Vec<TensorInfo> = self
            .parsed()
            .iter()
            .map(|(name, view)| TensorInfo {
                name: name.to_string(),
                dtype: format!("{:?}", view.dtype()),
                shape: view.shape().to_vec(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// True when the file has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.parsed().tensor(name).is_ok()
    }

    /// The string metadata of the header (`__metadata__`).
    pub fn metadata(&self) -> BTreeMap<String, String> {
        SafeTensors::read_metadata(&self.bytes)
            .ok()
            .and_then(|(_, m)| m.metadata().clone())
            .map(|m| m.into_iter().collect())
            .unwrap_or_default()
    }

    /// Tensor `name`'s values as f32 and its shape.
    fn values(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), TensorFileError> {
        let st = self.parsed();
        let view = st.tensor(name).map_err(|_| TensorFileError::MissingTensor {
            file: self.label.clone(),
            name: name.to_string(),
            available: st.len(),
        })?;
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::F16 => raw.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::BF16 => raw.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => {
                return Err(TensorFileError::UnsupportedDtype {
                    file: self.label.clone(),
                    name: name.into(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        Ok((data, view.shape().to_vec()))
    }

    /// Reads the one-dimensional tensor `name` as f32 (`rope.inv_freq`, say).
    ///
    /// # Errors
    /// As [`TensorFile::read`], [`TensorFileError::WrongRank`] for any other rank.
    pub fn read_vector(&self, name: &str) -> Result<Vec<f32>, TensorFileError> {
        let (data, dims) = self.values(name)?;
        if dims.len() != 1 {
            return Err(TensorFileError::WrongRank {
                file: self.label.clone(),
                name: name.into(),
                shape: dims,
            });
        }
        Ok(data)
    }

    /// Reads tensor `name` as f32 in `[batch, heads, tokens, head_dim]` layout.
    ///
    /// # Errors
    /// [`TensorFileError::MissingTensor`], [`TensorFileError::UnsupportedDtype`],
    /// [`TensorFileError::WrongRank`].
    pub fn read(&self, name: &str) -> Result<Tensor, TensorFileError> {
        let (data, dims) = self.values(name)?;
        let shape = match *dims.as_slice() {
            [h, t, d] => Shape::new(h, t, d),
            [b, h, t, d] => Shape::with_batch(b, h, t, d),
            _ => {
                return Err(TensorFileError::WrongRank {
                    file: self.label.clone(),
                    name: name.into(),
                    shape: dims,
                });
            }
        };
        // safetensors checked that the byte length matches the shape and dtype.
        Ok(Tensor::new(shape, data).expect("safetensors validated the tensor's extent"))
    }
}
