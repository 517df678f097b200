//! Long-context retrieval: a number (the pass key) hidden at some depth in filler text that
//! says nothing, asked for at the end, and the model's greedy answer checked, with the f32
//! reference cache and each candidate cache on the same prompts.
//!
//! The task is the one long-context papers and llama.cpp's `passkey` example use; the text
//! here is this crate's own. The pieces are tokenized once and joined as token ids, so a
//! prompt has the length asked for to within one filler sentence, and the key sits at the
//! depth asked for (a fraction of the filler sentences before it).

use crate::error::{Error, Result};
use crate::eval::Candidate;
use crate::model::LlamaModel;
use crate::store::{KvStore, KvqStore};
use crate::tokenizer::GgufTokenizer;

const HEAD: &str = "A pass key is hidden somewhere in the long notes below. Read them, find it and \
                    keep it in mind: you will be asked for it at the end.\n";
const FILLER: &str = " The river ran past the old mill, and the baker opened her shop at dawn. \
                      Nothing else happened in the village that day.";
const QUESTION: &str = "\nWhat is the pass key? The pass key is";
/// Tokens generated for the answer (a five-digit number and a little slack).
pub const ANSWER_TOKENS: usize = 8;
/// Tokens per forward call in the prefill (bounds the logits held: one row is kept).
const PREFILL_CHUNK: usize = 512;

/// What to run.
#[derive(Debug, Clone)]
pub struct PasskeyPlan {
    /// Prompt lengths, in tokens.
    pub lengths: Vec<usize>,
    /// Where the key sits among the filler sentences: 0 before the first, 1 after the last.
    pub depths: Vec<f64>,
    /// Keys tried at each length and depth.
    pub trials: usize,
    /// Seed of the keys (five-digit numbers).
    pub seed: u64,
}

impl Default for PasskeyPlan {
    /// 2k, 4k and 8k tokens (SmolLM2's trained context is 8192), the key at a tenth, half and
    /// nine tenths of the filler, two keys each.
    fn default() -> Self {
        Self { lengths: vec![2048, 4096, 8000], depths: vec![0.1, 0.5, 0.9], trials: 2, seed: 1 }
    }
}

impl PasskeyPlan {
    /// Checks the plan before any work: a length, a depth and a trial at least, depths from 0
    /// to 1, and each length with its answer within `context` (the model's; 0 when unknown).
    ///
    /// # Errors
    /// [`Error::Eval`] naming what is wrong.
    pub fn check(&self, context: usize) -> Result<()> {
        if self.lengths.is_empty() || self.depths.is_empty() || self.trials == 0 {
            return Err(Error::Eval("a passkey run needs a length, a depth and a trial".into()));
        }
        if let Some(d) = self.depths.iter().find(|d| !(0.0..=1.0).contains(*d)) {
            return Err(Error::Eval(format!("a passkey depth of {d}: give fractions from 0 to 1")));
        }
        if let Some(&l) = self.lengths.iter().find(|&&l| context > 0 && l + ANSWER_TOKENS > context) {
            return Err(Error::Eval(format!(
                "a passkey prompt of {l} tokens and its answer do not fit the model's context of {context}"
            )));
        }
        Ok(())
    }
}

/// One length and depth.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PasskeyCell {
    /// Prompt tokens (the length asked for, to within a filler sentence).
    pub tokens: usize,
    /// The depth asked for.
    pub depth: f64,
    /// Keys tried.
    pub trials: usize,
    /// Keys answered right: the reference first, then each candidate.
    pub found: Vec<usize>,
}

/// The whole run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PasskeyReport {
    /// The caches: `f32 (reference)`, then the candidates' names.
    pub caches: Vec<String>,
    /// One cell per length and depth, lengths outermost.
    pub cells: Vec<PasskeyCell>,
}

impl PasskeyReport {
    /// Share of all keys each cache answered right (the reference first).
    pub fn accuracy(&self) -> Vec<f64> {
        let trials: usize = self.cells.iter().map(|c| c.trials).sum();
        (0..self.caches.len())
            .map(|i| self.cells.iter().map(|c| c.found[i]).sum::<usize>() as f64 / trials.max(1) as f64)
            .collect()
    }
}

/// The prompt of `tokens` tokens (at most) with `key` at `depth`, and where the key's
/// sentence begins.
///
/// # Errors
/// [`Error::Eval`] when `tokens` cannot hold the fixed text and one filler sentence, or
/// `depth` is outside `0..=1`; the tokenizer's errors.
pub fn prompt(tok: &GgufTokenizer, tokens: usize, depth: f64, key: u32) -> Result<(Vec<u32>, usize)> {
    if !(0.0..=1.0).contains(&depth) {
        return Err(Error::Eval(format!("a passkey depth of {depth}: give a fraction from 0 to 1")));
    }
    let head = tok.encode(HEAD)?;
    let filler = tok.encode_raw(FILLER)?;
    let needle = tok.encode_raw(&format!(" The pass key is {key}. Remember it: the pass key is {key}."))?;
    let question = tok.encode_raw(QUESTION)?;
    let fixed = head.len() + needle.len() + question.len();
    let n = tokens.saturating_sub(fixed) / filler.len().max(1);
    if n == 0 {
        return Err(Error::Eval(format!(
            "a passkey prompt of {tokens} tokens: at least {} are needed",
            fixed + filler.len()
        )));
    }
    let before = ((n as f64 * depth).round() as usize).min(n);
    let mut ids = head;
    for _ in 0..before {
        ids.extend_from_slice(&filler);
    }
    let at = ids.len();
    ids.extend_from_slice(&needle);
    for _ in before..n {
        ids.extend_from_slice(&filler);
    }
    ids.extend_from_slice(&question);
    Ok((ids, at))
}

/// The first run of digits in `text`, if any.
fn first_number(text: &str) -> Option<u32> {
    let start = text.find(|c: char| c.is_ascii_digit())?;
    let digits: String = text[start..].chars().take_while(char::is_ascii_digit).take(9).collect();
    digits.parse().ok()
}

/// Prefills `prompt` into `store` (emptied first) and decodes greedily: the answer's text.
fn answer(
    model: &LlamaModel,
    tok: &GgufTokenizer,
    store: &mut dyn KvStore,
    prompt: &[u32],
) -> Result<String> {
    store.reset()?;
    let mut last = Vec::new();
    for chunk in prompt.chunks(PREFILL_CHUNK) {
        let logits = model.forward(store, chunk)?;
        last = logits.get(chunk.len() - 1)?.to_vec1::<f32>()?;
    }
    let stop = tok.end_of_generation();
    let mut out = Vec::new();
    for i in 0..ANSWER_TOKENS {
        let next = crate::eval::argmax(&last) as u32;
        if stop.contains(&next) {
            break;
        }
        out.push(next);
        if i + 1 < ANSWER_TOKENS {
            last = model.forward(store, &[next])?.get(0)?.to_vec1::<f32>()?;
        }
    }
    tok.decode_text(&out)
}

/// A five-digit key from a seeded xorshift.
fn key(state: &mut u64) -> u32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    10_000 + (*state % 90_000) as u32
}

/// Runs `plan` with the reference cache and every candidate. `progress(done, total)` is
/// called after each prompt is answered by every cache.
///
/// # Errors
/// [`Error::Eval`] for an empty plan, a length the model's context cannot hold or a bad
/// depth; [`Error::ConfigMismatch`] for a config that does not fit the model; the model's
/// and the caches' errors.
pub fn run(
    model: &LlamaModel,
    tok: &GgufTokenizer,
    candidates: &[Candidate],
    plan: &PasskeyPlan,
    mut progress: impl FnMut(usize, usize),
) -> Result<PasskeyReport> {
    plan.check(model.config().context_length)?;
    let mut stores: Vec<Box<dyn KvStore>> = vec![Box::new(model.f32_cache()?)];
    for c in candidates {
        model.config().check_cache(&c.config).map_err(|e| match e {
            Error::ConfigMismatch(m) => Error::ConfigMismatch(format!("{}: {m}", c.name)),
            other => other,
        })?;
        stores.push(Box::new(KvqStore::new(c.config.clone(), c.path)?));
    }
    let mut caches = vec!["f32 (reference)".to_string()];
    caches.extend(candidates.iter().map(|c| c.name.clone()));
    let total = plan.lengths.len() * plan.depths.len() * plan.trials;
    let (mut done, mut state) = (0, plan.seed | 1);
    let mut cells = Vec::new();
    for &length in &plan.lengths {
        for &depth in &plan.depths {
            let mut cell =
                PasskeyCell { tokens: 0, depth, trials: plan.trials, found: vec![0; stores.len()] };
            for _ in 0..plan.trials {
                let k = key(&mut state);
                let (ids, _) = prompt(tok, length, depth, k)?;
                cell.tokens = ids.len();
                for (store, found) in stores.iter_mut().zip(&mut cell.found) {
                    let text = answer(model, tok, store.as_mut(), &ids)?;
                    *found += usize::from(first_number(&text) == Some(k));
                }
                done += 1;
                progress(done, total);
            }
            cells.push(cell);
        }
    }
    Ok(PasskeyReport { caches, cells })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_read_from_the_answer() {
        assert_eq!(first_number(" 48213. Remember"), Some(48213));
        assert_eq!(first_number("is 7"), Some(7));
        assert_eq!(first_number(" the key"), None);
        assert_eq!(first_number("12345678901234"), Some(123_456_789));
    }

    #[test]
    fn prompts_have_the_length_and_the_key_at_the_depth_asked_for() {
        let (_, tok) = crate::tiny::TinyModel::default().load().unwrap();
        let filler = tok.encode_raw(FILLER).unwrap().len();
        for length in [400, 777, 1500] {
            for depth in [0.0, 0.1, 0.5, 0.9, 1.0] {
                let (ids, at) = prompt(&tok, length, depth, 48_213).unwrap();
                assert!(ids.len() <= length && ids.len() + filler > length, "{length}: {}", ids.len());
                let text = tok.decode_text(&ids).unwrap();
                assert_eq!(text.matches("48213").count(), 2, "{text}");
                assert!(text.ends_with("The pass key is"));
                // The key's sentence starts after the head and `depth` of the filler.
                let head = tok.encode(HEAD).unwrap().len();
                let needle = ids.len() - head - tok.encode_raw(QUESTION).unwrap().len();
                let needle = needle % filler;
                let all = (ids.len() - head - needle - tok.encode_raw(QUESTION).unwrap().len()) / filler;
                assert_eq!((at - head) % filler, 0);
                let before = (at - head) / filler;
                assert!(
                    (before as f64 - depth * all as f64).abs() <= 0.5,
                    "{length} {depth}: {before} of {all}"
                );
            }
        }
        assert!(prompt(&tok, 20, 0.5, 10_000).is_err());
        assert!(prompt(&tok, 400, 1.5, 10_000).is_err());
        assert!(prompt(&tok, 400, f64::NAN, 10_000).is_err());
    }

    #[test]
    fn keys_have_five_digits_and_differ() {
        let mut s = 1;
        let keys: Vec<u32> = (0..100).map(|_| key(&mut s)).collect();
        assert!(keys.iter().all(|k| (10_000..100_000).contains(k)));
        let mut unique = keys.clone();
        unique.sort_unstable();
        unique.dedup();
        assert!(unique.len() > 90);
    }
}
