//! Generated tokens into text a client can be sent piece by piece: incremental detokenization
//! that never splits a UTF-8 character, and stop strings that cut the output where they begin
//! (and are never sent, not even in part).

use kvq_candle::GgufTokenizer;

/// Turns generated tokens into text deltas.
///
/// Byte-level BPE spreads one character over several tokens, and a token's text can depend on
/// the one before it; so each delta is the difference between decoding a short window with and
/// without the newest tokens, sent only once it no longer ends in an incomplete character
/// (U+FFFD), the approach of Hugging Face's text-generation-inference.
#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    /// An empty detokenizer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token; returns the text it completes (possibly empty).
    ///
    /// # Errors
    /// The tokenizer's.
    pub fn push(&mut self, tok: &GgufTokenizer, id: u32) -> kvq_candle::Result<String> {
        self.ids.push(id);
        let before = tok.decode_text(&self.ids[self.prefix..self.read])?;
        let after = tok.decode_text(&self.ids[self.prefix..])?;
        if after.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let Some(delta) = after.get(before.len()..).filter(|_| after.starts_with(&before)) else {
            // The window's text changed before its end (a merge across tokens): send what
            // follows the common part, which is all a stream can still do.
            let common = before.char_indices().zip(after.chars()).take_while(|((_, a), b)| a == b).count();
            let start = after.char_indices().nth(common).map_or(after.len(), |(i, _)| i);
            self.advance();
            return Ok(after[start..].to_string());
        };
        let delta = delta.to_string();
        self.advance();
        Ok(delta)
    }

    fn advance(&mut self) {
        self.prefix = self.read;
        self.read = self.ids.len();
    }

    /// The text of the last tokens that has not been returned yet (an incomplete character,
    /// shown as U+FFFD): what a generation that ends now still owes its client.
    ///
    /// # Errors
    /// The tokenizer's.
    pub fn finish(&mut self, tok: &GgufTokenizer) -> kvq_candle::Result<String> {
        let before = tok.decode_text(&self.ids[self.prefix..self.read])?;
        let after = tok.decode_text(&self.ids[self.prefix..])?;
        self.advance();
        Ok(after.get(before.len()..).filter(|_| after.starts_with(&before)).unwrap_or_default().to_string())
    }

    /// The tokens pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// Holds back text that may be the start of a stop string, and cuts the output at the first
/// stop string found.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What [`StopMatcher::push`] lets through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text that can be sent.
    pub text: String,
    /// Whether a stop string was found (nothing after it is ever sent).
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), pending: String::new() }
    }

    /// Adds a delta; returns what can be sent now.
    pub fn push(&mut self, delta: &str) -> Released {
        self.pending.push_str(delta);
        if self.stops.is_empty() {
            return Released { text: std::mem::take(&mut self.pending), stopped: false };
        }
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            self.pending.truncate(at);
            return Released { text: std::mem::take(&mut self.pending), stopped: true };
        }
        // The longest tail of the pending text that begins some stop string waits.
        let hold = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.pending[i..])))
            .unwrap_or(self.pending.len());
        let rest = self.pending.split_off(hold);
        Released { text: std::mem::replace(&mut self.pending, rest), stopped: false }
    }

    /// What was held back, at the end of a generation that stopped for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for d in deltas {
            let r = m.push(d);
            out += &r.text;
            if r.stopped {
                return (out, true);
            }
        }
        out += &m.finish();
        (out, false)
    }

    #[test]
    fn a_stop_string_across_deltas_is_cut_and_never_sent() {
        assert_eq!(run(&["END"], &["ab", "cE", "N", "Dxyz"]), ("abc".into(), true));
        assert_eq!(run(&["END"], &["abEN", "x"]), ("abENx".into(), false));
        assert_eq!(run(&["\n\n", "##"], &["a\n", "b#", "#c"]), ("a\nb".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }

    #[test]
    fn held_text_is_released_as_soon_as_it_cannot_start_a_stop() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("xST").text, "x");
        assert_eq!(m.push("Ay").text, "STAy");
    }
}
