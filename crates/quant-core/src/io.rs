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
/// disk leaves either the previous file or the new one, never a torn file. A replaced file's
/// permissions are kept; a new file gets those the umask gives (as `File::create` would).
///
/// This is the library's primitive: it follows no rule about what `path` may be. Tools'
/// outputs go through [`write_output`].
///
/// # Errors
/// The I/O errors of creating, writing, flushing or renaming; `path` is unchanged then.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temp = write_temp(path, bytes)?;
    finish(&temp, path)
}

/// The directory a file is written in (`.` for a bare name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// `bytes` in a new temporary file beside `path`, flushed, with `path`'s permissions when it
/// exists; removed again on error.
fn write_temp(path: &Path, bytes: &[u8]) -> std::io::Result<std::path::PathBuf> {
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = parent_dir(path);
    let (temp, mut file) = loop {
        // Unique within the process; a stale file of a process that had the same id is
        // stepped over (`create_new` refuses it).
        let name = format!(".kvq-{}-{}.tmp", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let temp = dir.join(name);
        // `create_new` makes the file with the umask's permissions, never over another.
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&temp) {
            Ok(f) => break (temp, f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    };
    let written =
        file.write_all(bytes).and_then(|()| file.sync_all()).and_then(|()| match std::fs::metadata(path) {
            Ok(old) if old.is_file() => std::fs::set_permissions(&temp, old.permissions()),
            _ => Ok(()),
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(e);
    }
    Ok(temp)
}

/// Renames a temporary file of [`write_temp`] over `path` and flushes the directory.
fn finish(temp: &Path, path: &Path) -> std::io::Result<()> {
    if let Err(e) = std::fs::rename(temp, path) {
        let _ = std::fs::remove_file(temp);
        return Err(e);
    }
    // The rename itself is durable once the directory is flushed (not possible everywhere).
    if let Ok(d) = std::fs::File::open(parent_dir(path)) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Whether two paths name the same file (device and inode on Unix; canonical paths
/// elsewhere). Paths that do not exist name no file.
fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
    }
}

/// The rules for a tool's output path, checked before anything is computed or written:
/// - a target that exists must be a regular file (not a directory, device, FIFO or socket);
/// - it must not be one of the command's `inputs` (the same file by device and inode, whatever
///   the path's spelling or links);
/// - a file the user cannot write (read-only, or refused when opened for writing) is replaced
///   only with `force`.
///
/// # Errors
/// [`std::io::ErrorKind::InvalidInput`] for the first two, [`std::io::ErrorKind::PermissionDenied`]
/// for the third, each with a message naming the rule.
pub fn check_output(path: &Path, inputs: &[&Path], force: bool) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.is_file() {
        let what =
            if meta.is_dir() { "a directory" } else { "not a regular file (a device, FIFO or socket)" };
        return Err(Error::new(ErrorKind::InvalidInput, format!("the output exists and is {what}; refused")));
    }
    if let Some(input) = inputs.iter().find(|i| same_file(path, i)) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("the output is the command's input {}; refused", input.display()),
        ));
    }
    if !force {
        let writable =
            !meta.permissions().readonly() && std::fs::OpenOptions::new().write(true).open(path).is_ok();
        if !writable {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                "the output exists and is not writable; --force replaces it",
            ));
        }
    }
    Ok(())
}

/// A tool's output: [`check_output`], then [`write_atomic`].
///
/// # Errors
/// As [`check_output`] and [`write_atomic`]; `path` is unchanged on error.
pub fn write_output(path: &Path, bytes: &[u8], inputs: &[&Path], force: bool) -> std::io::Result<()> {
    check_output(path, inputs, force)?;
    write_atomic(path, bytes)
}

/// Several outputs, all or none: every path checked ([`check_output`]), every file written to
/// a temporary beside it, and only then all renamed into place. A failure before the renames
/// leaves every target as it was. Returns the path that failed with the error.
///
/// # Errors
/// The first path refused or failed, with its error.
pub fn write_outputs(
    files: &[(std::path::PathBuf, Vec<u8>)],
    inputs: &[&Path],
    force: bool,
) -> Result<(), (std::path::PathBuf, std::io::Error)> {
    for (path, _) in files {
        check_output(path, inputs, force).map_err(|e| (path.clone(), e))?;
    }
    let mut temps = Vec::with_capacity(files.len());
    for (path, bytes) in files {
        match write_temp(path, bytes) {
            Ok(t) => temps.push(t),
            Err(e) => {
                for t in &temps {
                    let _ = std::fs::remove_file(t);
                }
                return Err((path.clone(), e));
            }
        }
    }
    let mut renames = temps.iter().zip(files);
    for (temp, (path, _)) in renames.by_ref() {
        if let Err(e) = finish(temp, path) {
            for (t, _) in renames {
                let _ = std::fs::remove_file(t);
            }
            return Err((path.clone(), e));
        }
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
