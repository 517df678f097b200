//! A structure-aware GGUF mutator: the file is walked once to find where each header field,
//! metadata value and tensor description lies, and one of them is given a new value of the
//! same width. The structure stays intact (every length that the walk depends on is kept,
//! unless a length itself is the field picked), so the mutants reach the checks behind the
//! parser: metadata that disagrees with the tensors, dims, types and offsets that lie.

use kvq::quant::synth::Rng;

/// What a field is, for choosing its new value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The tensor or metadata count of the header.
    Count,
    /// A metadata value's type tag, or an array's element type.
    ValueType,
    /// An integer metadata value (array elements included) of this many bytes.
    Int(usize),
    /// A float metadata value of this many bytes.
    Float(usize),
    /// A boolean metadata value.
    Bool,
    /// A string's or an array's length.
    Length,
    /// A tensor's number of dimensions.
    Dims,
    /// One of a tensor's dimensions.
    Dim,
    /// A tensor's GGML type.
    TensorType,
    /// A tensor's data offset.
    Offset,
}

/// One field: where it is, how wide, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Its first byte.
    pub at: usize,
    /// Its width in bytes.
    pub width: usize,
    /// What it is.
    pub kind: Kind,
}

struct Walk<'a> {
    data: &'a [u8],
    at: usize,
    fields: Vec<Field>,
}

impl Walk<'_> {
    fn take(&mut self, n: usize) -> Option<usize> {
        let start = self.at;
        self.at = self.at.checked_add(n).filter(|&e| e <= self.data.len())?;
        Some(start)
    }
    fn field(&mut self, width: usize, kind: Kind) -> Option<u64> {
        let at = self.take(width)?;
        self.fields.push(Field { at, width, kind });
        let mut b = [0u8; 8];
        b[..width].copy_from_slice(&self.data[at..at + width]);
        Some(u64::from_le_bytes(b))
    }
    fn string(&mut self) -> Option<()> {
        let n = self.field(8, Kind::Length)?;
        self.take(usize::try_from(n).ok()?)?;
        Some(())
    }
    fn value(&mut self, ty: u64, depth: usize) -> Option<()> {
        match ty {
            0 | 1 => self.field(1, Kind::Int(1)).map(drop),
            2 | 3 => self.field(2, Kind::Int(2)).map(drop),
            4 | 5 => self.field(4, Kind::Int(4)).map(drop),
            10 | 11 => self.field(8, Kind::Int(8)).map(drop),
            6 => self.field(4, Kind::Float(4)).map(drop),
            12 => self.field(8, Kind::Float(8)).map(drop),
            7 => self.field(1, Kind::Bool).map(drop),
            8 => self.string(),
            9 if depth < 2 => {
                let elem = self.field(4, Kind::ValueType)?;
                let n = self.field(8, Kind::Length)?;
                // Long arrays (a vocabulary) are walked, but only their first elements
                // become fields: picking among 50,000 token strings would starve the rest.
                let mut cap = None;
                for i in 0..n {
                    self.value(elem, depth + 1)?;
                    if i == 7 {
                        cap = Some(self.fields.len());
                    }
                    if let Some(c) = cap {
                        self.fields.truncate(c);
                    }
                }
                Some(())
            }
            _ => None,
        }
    }
}

/// The fields of a GGUF file, as far as its structure can be walked (a damaged file gives
/// the fields before the damage).
pub fn fields(data: &[u8]) -> Vec<Field> {
    let mut w = Walk { data, at: 0, fields: Vec::new() };
    let _ = walk(&mut w);
    w.fields
}

fn walk(w: &mut Walk<'_>) -> Option<()> {
    if w.data.get(..4)? != b"GGUF" {
        return None;
    }
    w.take(8)?; // magic and version
    let tensors = w.field(8, Kind::Count)?;
    let kvs = w.field(8, Kind::Count)?;
    for _ in 0..kvs {
        w.string()?;
        let ty = w.field(4, Kind::ValueType)?;
        w.value(ty, 0)?;
    }
    for _ in 0..tensors {
        w.string()?;
        let dims = w.field(4, Kind::Dims)?;
        for _ in 0..dims.min(8) {
            w.field(8, Kind::Dim)?;
        }
        w.field(4, Kind::TensorType)?;
        w.field(8, Kind::Offset)?;
    }
    Some(())
}

/// GGML type ids: every known one, and a few that are not.
const TYPES: [u64; 16] = [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 30, 4, 99];

/// A copy of `input` with one field given a new value of its width; `None` when the input has
/// no field (not a GGUF).
pub fn mutate(rng: &mut Rng, input: &[u8]) -> Option<Vec<u8>> {
    let all = fields(input);
    // Lengths change the structure itself: picked rarely.
    let kept: Vec<Field> =
        all.iter().copied().filter(|f| f.kind != Kind::Length || rng.below(8) == 0).collect();
    let f = *kept.get(rng.below(kept.len().max(1) as u64) as usize)?;
    let old = {
        let mut b = [0u8; 8];
        b[..f.width].copy_from_slice(&input[f.at..f.at + f.width]);
        u64::from_le_bytes(b)
    };
    // Another field of the same kind: a value that is plausible, only in the wrong place.
    let same: Vec<&Field> = all.iter().filter(|g| g.kind == f.kind && g.at != f.at).collect();
    let from_other = |rng: &mut Rng| {
        same.get(rng.below(same.len().max(1) as u64) as usize).map(|g| {
            let mut b = [0u8; 8];
            b[..g.width].copy_from_slice(&input[g.at..g.at + g.width]);
            u64::from_le_bytes(b)
        })
    };
    let new = match (f.kind, rng.below(4)) {
        (Kind::TensorType | Kind::ValueType, _) => TYPES[rng.below(TYPES.len() as u64) as usize],
        (Kind::Float(4), _) => {
            let v = [f32::NAN, f32::INFINITY, -1.0, 0.0, 1e30, 1e-40, 65504.0][rng.below(7) as usize];
            u64::from(v.to_bits())
        }
        (Kind::Float(_), _) => [f64::NAN, f64::NEG_INFINITY, 0.0, 1e300][rng.below(4) as usize].to_bits(),
        (Kind::Bool, _) => [2, 0xff][rng.below(2) as usize],
        (_, 0) => crate::INTS[rng.below(crate::INTS.len() as u64) as usize],
        (_, 1) => from_other(rng).unwrap_or(old ^ 1),
        (_, 2) => old.wrapping_add([1, u64::MAX, 32, 0u64.wrapping_sub(32)][rng.below(4) as usize]),
        _ => [old.wrapping_mul(2), old / 2, old.wrapping_mul(3), 0][rng.below(4) as usize],
    };
    let mut out = input.to_vec();
    out[f.at..f.at + f.width].copy_from_slice(&new.to_le_bytes()[..f.width]);
    MUTANTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Some(out)
}

/// Structure-aware mutants [`mutate`] has made in this process (the `kvq-fuzz gguf` summary
/// line counts them).
pub static MUTANTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Target;

    #[test]
    fn the_walk_finds_every_tensor_and_value_and_mutants_keep_the_layout() {
        for seed in Target::Gguf.seeds() {
            let f = fields(&seed);
            let count = |k: Kind| f.iter().filter(|x| x.kind == k).count();
            assert_eq!(count(Kind::Count), 2);
            let tensors = count(Kind::TensorType);
            assert!(tensors >= 12, "{tensors} tensors");
            assert_eq!(count(Kind::Offset), tensors);
            assert_eq!(count(Kind::Dims), tensors);
            assert!(count(Kind::Dim) >= tensors);
            assert!(count(Kind::Int(4)) >= 5, "the model's integer metadata");
            let mut rng = Rng::new(7);
            let mut changed_kinds = std::collections::BTreeSet::new();
            for _ in 0..500 {
                let m = mutate(&mut rng, &seed).unwrap();
                assert_eq!(m.len(), seed.len(), "fields change in place");
                let diff: Vec<usize> = (0..m.len()).filter(|&i| m[i] != seed[i]).collect();
                if let (Some(&a), Some(&b)) = (diff.first(), diff.last()) {
                    let field = f.iter().find(|x| x.at <= a && b < x.at + x.width);
                    let field = field.unwrap_or_else(|| panic!("bytes {a}..={b} are in no field"));
                    changed_kinds.insert(format!("{:?}", field.kind));
                }
            }
            for k in ["TensorType", "Offset", "Dim", "Int(4)"] {
                assert!(changed_kinds.contains(k), "{k} never mutated: {changed_kinds:?}");
            }
        }
        assert!(mutate(&mut Rng::new(1), b"not a gguf").is_none());
    }
}
