//! A GGUF file checked as llama.cpp checks it, before candle's parser reads any of it.
//!
//! candle-core's `gguf_file::Content::read` trusts the file: a count it allocates by, a
//! dimension it divides by or an offset it seeks to comes straight from the bytes. [`check`]
//! walks the same structure first with every size bounded by what is left of the file:
//!
//! - the magic, and version 2 or 3 (a byte-swapped, big-endian file is named as such);
//! - metadata: value types known, strings and arrays no longer than the bytes left, arrays
//!   nested at most two deep, no key twice, `general.alignment` a power of two;
//! - tensors: names of at most 63 bytes and none twice, 1 to 4 dimensions each at least 1,
//!   a type candle knows, a row length that is whole blocks, the byte size computed with
//!   checked arithmetic, each offset aligned and equal to the running total of the ones
//!   before (so no two overlap), all of them inside the file;
//! - the architecture's blocks: no `blk.N` tensor at or past `{arch}.block_count`, none of
//!   the blocks below it without tensors, and the token embedding as many rows as the
//!   tokenizer has tokens.
//!
//! Names and strings from the file appear in messages escaped (`escape_debug`) and cut short,
//! so no terminal control byte is echoed.

use std::collections::HashSet;
use std::io::{Read, Seek, SeekFrom};

use crate::error::{Error, Result};

/// What [`check`] found: enough for a caller to trust candle's parser with the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The GGUF version (2 or 3).
    pub version: u32,
    /// The data section's alignment.
    pub alignment: u64,
    /// Tensors in the file.
    pub tensors: usize,
    /// Bytes of tensor data (padded to the alignment).
    pub data_bytes: u64,
    /// `general.architecture`.
    pub architecture: Option<String>,
}

/// The most tensors a file may declare.
const MAX_TENSORS: u64 = 1 << 20;
/// The longest metadata key.
const MAX_KEY: u64 = 1 << 16;
/// The longest tensor name, as llama.cpp's `GGML_MAX_NAME` allows (64 with the terminator).
const MAX_NAME: u64 = 63;
/// Arrays inside arrays, at most.
const MAX_DEPTH: usize = 2;

/// `s` for a message: escaped, at most 80 characters.
pub(crate) fn escape(s: &str) -> String {
    let e: String = s.escape_debug().collect();
    if e.chars().count() > 80 { format!("{}...", e.chars().take(80).collect::<String>()) } else { e }
}

fn bad(reason: String) -> Error {
    Error::Model { path: "<memory>".into(), reason }
}

/// The element count and bytes of a block of each GGML type candle knows (id, values per
/// block, bytes per block, name).
const TYPES: &[(u32, u64, u64, &str)] = &[
    (0, 1, 4, "F32"),
    (1, 1, 2, "F16"),
    (2, 32, 18, "Q4_0"),
    (3, 32, 20, "Q4_1"),
    (6, 32, 22, "Q5_0"),
    (7, 32, 24, "Q5_1"),
    (8, 32, 34, "Q8_0"),
    (9, 32, 36, "Q8_1"),
    (10, 256, 84, "Q2_K"),
    (11, 256, 110, "Q3_K"),
    (12, 256, 144, "Q4_K"),
    (13, 256, 176, "Q5_K"),
    (14, 256, 210, "Q6_K"),
    (15, 256, 292, "Q8_K"),
    (30, 1, 2, "BF16"),
];

/// A reader that knows how many bytes are left and refuses to read past them.
struct Bounded<'a, R> {
    r: &'a mut R,
    at: u64,
    len: u64,
}

impl<R: Read> Bounded<'_, R> {
    fn left(&self) -> u64 {
        self.len - self.at
    }

    fn take<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        if (N as u64) > self.left() {
            return Err(bad(format!(
                "truncated: {what} at byte {} runs past the end ({} bytes)",
                self.at, self.len
            )));
        }
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|e| bad(format!("reading {what} at byte {}: {e}", self.at)))?;
        self.at += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(what)?))
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<()> {
        if n > self.left() {
            return Err(bad(format!("truncated: {what} of {n} bytes at byte {} runs past the end", self.at)));
        }
        let copied = std::io::copy(&mut (&mut *self.r).take(n), &mut std::io::sink())
            .map_err(|e| bad(format!("reading {what}: {e}")))?;
        if copied != n {
            return Err(bad(format!("truncated: {what} at byte {}", self.at)));
        }
        self.at += n;
        Ok(())
    }

    /// A string of at most `max` bytes (and never more than are left), read only when short
    /// enough to keep; longer ones are skipped and reported as `None`.
    fn string(&mut self, max: u64, keep: bool, what: &str) -> Result<Option<String>> {
        let n = self.u64(what)?;
        if n > max || n > self.left() {
            return Err(bad(format!("{what}: a string of {n} bytes (at most {max}, {} left)", self.left())));
        }
        if !keep {
            self.skip(n, what)?;
            return Ok(None);
        }
        let mut b = vec![0u8; n as usize];
        self.r.read_exact(&mut b).map_err(|e| bad(format!("reading {what}: {e}")))?;
        self.at += n;
        Ok(Some(String::from_utf8_lossy(&b).into_owned()))
    }
}

/// A metadata value's contents that the checks need.
enum Value {
    Int(u64),
    Str(String),
    /// An array: its element type and count.
    Array(u32, u64),
    Other,
}

/// Bytes of one value of a fixed-size metadata type.
fn fixed_size(ty: u32) -> Option<u64> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

fn value<R: Read>(b: &mut Bounded<'_, R>, ty: u32, depth: usize, key: &str) -> Result<Value> {
    let what = format!("the value of {}", escape(key));
    Ok(match ty {
        0 | 1 | 7 => Value::Int(u64::from(b.take::<1>(&what)?[0])),
        2 | 3 => Value::Int(u64::from(u16::from_le_bytes(b.take(&what)?))),
        4 | 5 => {
            let v = b.u32(&what)?;
            // Signed values stay signed: a negative count is not a large one.
            if ty == 5 && (v as i32) < 0 { Value::Other } else { Value::Int(u64::from(v)) }
        }
        10 | 11 => {
            let v = b.u64(&what)?;
            if ty == 11 && (v as i64) < 0 { Value::Other } else { Value::Int(v) }
        }
        6 | 12 => {
            b.skip(fixed_size(ty).expect("a fixed type"), &what)?;
            Value::Other
        }
        8 => Value::Str(b.string(b.left(), true, &what)?.expect("kept")),
        9 => {
            if depth >= MAX_DEPTH {
                return Err(bad(format!("{what}: arrays nested more than {MAX_DEPTH} deep")));
            }
            let (elem, n) = (b.u32(&what)?, b.u64(&what)?);
            // Every element takes at least one byte (a string eight, an array twelve): a
            // count beyond what is left cannot be true.
            let least = match elem {
                8 => 8,
                9 => 12,
                t => fixed_size(t).ok_or_else(|| bad(format!("{what}: an array of unknown type {t}")))?,
            };
            if n.checked_mul(least).is_none_or(|need| need > b.left()) {
                return Err(bad(format!("{what}: an array of {n} elements in {} bytes left", b.left())));
            }
            match fixed_size(elem) {
                Some(size) => b.skip(n * size, &what)?,
                None => {
                    for _ in 0..n {
                        if elem == 8 {
                            b.string(b.left(), false, &what)?;
                        } else {
                            let inner = b.u32(&what)?;
                            value_array_body(b, inner, depth + 1, key)?;
                        }
                    }
                }
            }
            Value::Array(elem, n)
        }
        t => return Err(bad(format!("{what}: unknown metadata type {t}"))),
    })
}

/// An array's count and elements, its element type read already (arrays inside arrays).
fn value_array_body<R: Read>(b: &mut Bounded<'_, R>, elem: u32, depth: usize, key: &str) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(bad(format!("the value of {}: arrays nested more than {MAX_DEPTH} deep", escape(key))));
    }
    let n = b.u64("an array's count")?;
    match fixed_size(elem) {
        Some(size) => {
            let bytes = n.checked_mul(size).filter(|&x| x <= b.left());
            b.skip(
                bytes.ok_or_else(|| bad(format!("an array of {n} elements in {} bytes left", b.left())))?,
                key,
            )
        }
        None if elem == 8 => {
            if n.checked_mul(8).is_none_or(|x| x > b.left()) {
                return Err(bad(format!("an array of {n} strings in {} bytes left", b.left())));
            }
            for _ in 0..n {
                b.string(b.left(), false, key)?;
            }
            Ok(())
        }
        None if elem == 9 => {
            if n.checked_mul(12).is_none_or(|x| x > b.left()) {
                return Err(bad(format!("an array of {n} arrays in {} bytes left", b.left())));
            }
            for _ in 0..n {
                let inner = b.u32(key)?;
                value_array_body(b, inner, depth + 1, key)?;
            }
            Ok(())
        }
        None => Err(bad(format!("the value of {}: an array of unknown type {elem}", escape(key)))),
    }
}

/// Checks the GGUF `reader` holds (`len` bytes from its start), leaving its position
/// anywhere: seek back before reading it again.
///
/// # Errors
/// [`Error::Model`] naming the first problem (its path is `"<memory>"`: callers that know the
/// file put its name in).
pub fn check<R: Read + Seek>(reader: &mut R, len: u64) -> Result<Summary> {
    reader.seek(SeekFrom::Start(0)).map_err(|e| bad(format!("seeking to the start: {e}")))?;
    let mut b = Bounded { r: reader, at: 0, len };
    let magic = b.take::<4>("the magic")?;
    if &magic != b"GGUF" {
        return Err(bad(format!("not a GGUF file (magic {:?})", String::from_utf8_lossy(&magic))));
    }
    let version = b.u32("the version")?;
    if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
        return Err(bad(format!(
            "a big-endian GGUF (version {} byte-swapped): only little-endian files are read",
            version.swap_bytes()
        )));
    }
    if !(2..=3).contains(&version) {
        return Err(bad(format!("GGUF version {version} (versions 2 and 3 are read)")));
    }
    let (n_tensors, n_kv) = (b.u64("the tensor count")?, b.u64("the metadata count")?);
    // A tensor's entry takes at least 24 bytes, a metadata entry 13.
    if n_tensors > MAX_TENSORS || n_tensors.saturating_mul(24) > b.left() {
        return Err(bad(format!("{n_tensors} tensors declared in a file of {len} bytes")));
    }
    if n_kv.saturating_mul(13) > b.left() {
        return Err(bad(format!("{n_kv} metadata entries declared in a file of {len} bytes")));
    }
    let mut keys = HashSet::new();
    let (mut alignment, mut architecture, mut tokens) = (32u64, None, None);
    let mut block_counts = std::collections::HashMap::new();
    for _ in 0..n_kv {
        let key = b.string(MAX_KEY, true, "a metadata key")?.expect("kept");
        if !keys.insert(key.clone()) {
            return Err(bad(format!("the metadata key {} appears twice", escape(&key))));
        }
        let ty = b.u32("a metadata type")?;
        let v = value(&mut b, ty, 0, &key)?;
        match (key.as_str(), v) {
            ("general.alignment", Value::Int(a)) if ty == 4 && a.is_power_of_two() => alignment = a,
            ("general.alignment", _) => {
                return Err(bad("general.alignment is not a power of two held in a u32".into()));
            }
            ("general.architecture", Value::Str(s)) => architecture = Some(s),
            ("tokenizer.ggml.tokens", Value::Array(8, n)) => tokens = Some(n),
            // Matched with the architecture once every key is read (they come in any order).
            (k, Value::Int(n)) if k.ends_with(".block_count") => {
                block_counts.insert(key.clone(), n);
            }
            _ => {}
        }
    }
    let mut names = HashSet::new();
    let mut infos = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = b.string(MAX_NAME, true, "a tensor name")?.expect("kept");
        let n_dims = b.u32("a tensor's dimension count")?;
        if !(1..=4).contains(&n_dims) {
            return Err(bad(format!("tensor {}: {n_dims} dimensions (1 to 4)", escape(&name))));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(b.u64("a tensor dimension")?);
        }
        let (ty, offset) = (b.u32("a tensor type")?, b.u64("a tensor offset")?);
        if !names.insert(name.clone()) {
            return Err(bad(format!("tensor {} appears twice", escape(&name))));
        }
        infos.push((name, dims, ty, offset));
    }
    let data_start = b.at.div_ceil(alignment).checked_mul(alignment).filter(|&s| s <= len);
    let data_start =
        data_start.ok_or_else(|| bad(format!("no tensor data after the header ({len} bytes)")))?;
    let mut total = 0u64;
    for (name, dims, ty, offset) in &infos {
        let name = escape(name);
        let &(_, per_block, block_bytes, tname) = TYPES
            .iter()
            .find(|t| t.0 == *ty)
            .ok_or_else(|| bad(format!("tensor {name}: unknown type {ty}")))?;
        if dims.contains(&0) {
            return Err(bad(format!("tensor {name}: a dimension of 0 in {dims:?}")));
        }
        let elems = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).filter(|&e| e <= i64::MAX as u64);
        let elems = elems.ok_or_else(|| bad(format!("tensor {name}: dimensions {dims:?} overflow")))?;
        if !dims[0].is_multiple_of(per_block) {
            return Err(bad(format!(
                "tensor {name}: rows of {} values are not whole {tname} blocks",
                dims[0]
            )));
        }
        let bytes = (elems / per_block)
            .checked_mul(block_bytes)
            .ok_or_else(|| bad(format!("tensor {name}: {dims:?} of {tname} overflow")))?;
        if !offset.is_multiple_of(alignment) || *offset != total {
            return Err(bad(format!(
                "tensor {name}: data at offset {offset}, expected {total} (each tensor follows the one before, aligned to {alignment})"
            )));
        }
        let end = total.checked_add(bytes).and_then(|e| e.checked_next_multiple_of(alignment));
        total = end.ok_or_else(|| bad(format!("tensor {name}: offsets overflow")))?;
        if data_start.checked_add(offset + bytes).is_none_or(|e| e > len) {
            return Err(bad(format!(
                "tensor {name}: its {bytes} bytes at offset {offset} run past the end of the file ({len} bytes)"
            )));
        }
    }
    if let Some(arch) = &architecture
        && let Some(&blocks) = block_counts.get(&format!("{arch}.block_count"))
    {
        let mut seen = HashSet::new();
        for (name, ..) in &infos {
            if let Some(i) = name.strip_prefix("blk.").and_then(|r| r.split('.').next()) {
                let i: u64 =
                    i.parse().map_err(|_| bad(format!("tensor {}: not a block number", escape(name))))?;
                if i >= blocks {
                    return Err(bad(format!(
                        "tensor {} belongs to block {i}, past the {blocks} blocks of {arch}.block_count",
                        escape(name)
                    )));
                }
                seen.insert(i);
            }
        }
        if let Some(missing) = (0..blocks.min(MAX_TENSORS)).find(|i| !seen.contains(i)) {
            return Err(bad(format!("block {missing} of {blocks} has no tensors")));
        }
    }
    if let (Some(tokens), Some((_, dims, ..))) = (tokens, infos.iter().find(|i| i.0 == "token_embd.weight"))
        && dims.len() == 2
        && dims[1] != tokens
    {
        return Err(bad(format!("the tokenizer has {tokens} tokens, the token embedding {} rows", dims[1])));
    }
    Ok(Summary { version, alignment, tensors: infos.len(), data_bytes: total, architecture })
}
