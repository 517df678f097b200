//! The GGUF's own tokenizer: byte-level BPE from its metadata (`tokenizer.ggml.*`), through the
//! `tokenizers` crate, with the pre-tokenizer llama.cpp uses for the model's `tokenizer.ggml.pre`.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::Tokenizer;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;

use crate::error::{Error, Result};

/// The ChatML chat template (SmolLM2's and Qwen2's turn format), in Jinja: what a model
/// without a `tokenizer.chat_template` is given, as llama.cpp does, and what
/// [`crate::tiny::TinyModel`] writes.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Bytes of text [`GgufTokenizer::encode_prefix`] tokenizes at once, about.
pub const PIECE_BYTES: usize = 1 << 16;

/// Where the first piece of `text` ends: all of it when it is at most `piece` bytes, else
/// before the last space within `piece` bytes that a non-whitespace character follows (the
/// first one after, when there is none within; all of the text when there is none at all).
/// Only a space: the pre-tokenizer splits there, and a piece that begins with one gets no
/// prefix space of the tokenizer's own (a tab or newline would).
fn piece_end(text: &str, piece: usize) -> usize {
    if text.len() <= piece {
        return text.len();
    }
    let starts_word = |(i, c): &(usize, char)| {
        *i > 0 && *c == ' ' && text[i + 1..].chars().next().is_some_and(|n| !n.is_whitespace())
    };
    let mut limit = piece;
    while !text.is_char_boundary(limit) {
        limit -= 1;
    }
    text[..limit]
        .char_indices()
        .rev()
        .find(starts_word)
        .or_else(|| text.char_indices().skip_while(|&(i, _)| i < limit).find(starts_word))
        .map_or(text.len(), |(i, _)| i)
}

/// A GGUF model's tokenizer.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    inner: Tokenizer,
    bos: Option<u32>,
    add_bos: bool,
    end_of_generation: Vec<u32>,
    chat_template: Option<String>,
}

impl GgufTokenizer {
    /// Reads the tokenizer from a GGUF file's metadata (the tensors are not read).
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Model`] for a malformed file, [`Error::Tokenizer`] for a
    /// tokenizer other than byte-level BPE (`tokenizer.ggml.model = "gpt2"`).
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let io = |source| Error::Io { path: name.clone(), source };
        let f = std::fs::File::open(path).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        let mut file = std::io::BufReader::new(f);
        let named = |e: Error| match e {
            Error::Model { reason, .. } => Error::Model { path: name.clone(), reason },
            other => other,
        };
        // Checked before candle's parser reads it (see `crate::gguf`).
        crate::gguf::check(&mut file, len).map_err(named)?;
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0)).map_err(io)?;
        let ct = gguf_file::Content::read(&mut file)
            .map_err(|e| Error::Model { path: name.clone(), reason: crate::error::candle_message(&e) })?;
        Self::from_gguf(&ct)
    }

    /// The tokenizer of parsed GGUF metadata.
    ///
    /// # Errors
    /// As [`GgufTokenizer::load`].
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let mut inner =
            Tokenizer::from_gguf(ct).map_err(|e| Error::Tokenizer(crate::error::candle_message(&e)))?;
        let pre = match ct.metadata.get("tokenizer.ggml.pre") {
            Some(gguf_file::Value::String(s)) => s.as_str(),
            _ => "default",
        };
        if pre == "smollm" {
            // SmolLM's tokenizer splits every digit on its own before the GPT-2 byte-level
            // split (its tokenizer.json, and llama.cpp's "smollm" pre-tokenizer).
            let seq: Vec<PreTokenizerWrapper> =
                vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()];
            inner.with_pre_tokenizer(Some(Sequence::new(seq)));
        }
        let int = |key: &str| match ct.metadata.get(key) {
            Some(v) => v.to_u32().ok(),
            None => None,
        };
        let vocab = inner.get_vocab_size(true);
        let bos = int("tokenizer.ggml.bos_token_id").filter(|&b| (b as usize) < vocab);
        let add_bos =
            matches!(ct.metadata.get("tokenizer.ggml.add_bos_token"), Some(gguf_file::Value::Bool(true)));
        // llama.cpp's end-of-generation tokens: end of sequence, end of turn, end of message.
        let mut end_of_generation: Vec<u32> =
            ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
                .into_iter()
                .filter_map(int)
                .filter(|&t| (t as usize) < vocab)
                .collect();
        end_of_generation.sort_unstable();
        end_of_generation.dedup();
        let chat_template = match ct.metadata.get("tokenizer.chat_template") {
            Some(gguf_file::Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        Ok(Self { inner, bos, add_bos, end_of_generation, chat_template })
    }

    /// The first `max_tokens` token ids of `text` (all of them for `None`), as [`Self::encode`]
    /// gives them, BOS counted, in bounded memory: the text is tokenized in pieces of about
    /// [`PIECE_BYTES`], each cut before a space that begins a word (where the
    /// byte-level pre-tokenizer splits anyway, so the ids are those of the whole text), and no
    /// piece is tokenized once there are enough. The tokenizer's working memory then follows
    /// the piece, not the text (about 200 bytes per input byte tokenized at once).
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn encode_prefix(&self, text: &str, max_tokens: Option<usize>) -> Result<Vec<u32>> {
        self.encode_pieces(text, max_tokens, PIECE_BYTES)
    }

    fn encode_pieces(&self, text: &str, max_tokens: Option<usize>, piece: usize) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if let (true, Some(b)) = (self.add_bos, self.bos) {
            ids.push(b);
        }
        let mut rest = text;
        while !rest.is_empty() && max_tokens.is_none_or(|m| ids.len() < m) {
            let cut = piece_end(rest, piece);
            ids.extend(self.encode_raw(&rest[..cut])?);
            rest = &rest[cut..];
        }
        if let Some(m) = max_tokens {
            ids.truncate(m);
        }
        Ok(ids)
    }

    /// Token ids of `text`, with the BOS token in front when the model's tokenizer adds one
    /// (`tokenizer.ggml.add_bos_token`), as llama.cpp tokenizes a text.
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode_raw(text)?;
        if let (true, Some(b)) = (self.add_bos, self.bos) {
            ids.insert(0, b);
        }
        Ok(ids)
    }

    /// The text of `ids`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Token ids of `text` exactly as written: no BOS added, and special tokens spelled in the
    /// text (`<|im_start|>`) are those tokens, as a rendered chat template needs.
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids` without the special tokens (what a client is shown).
    ///
    /// # Errors
    /// [`Error::Tokenizer`].
    pub fn decode_text(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// The beginning-of-sequence token, when the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Whether a text's tokens start with BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// The tokens that end a generation (`eos`, `eot` and `eom` of the GGUF's metadata).
    pub fn end_of_generation(&self) -> &[u32] {
        &self.end_of_generation
    }

    /// The chat template of the GGUF's metadata (`tokenizer.chat_template`, Jinja).
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The text of one token as the vocabulary spells it (`<|im_end|>`), if it exists.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> GgufTokenizer {
        crate::tiny::TinyModel::default().load().unwrap().1
    }

    #[test]
    fn pieces_give_the_ids_of_the_whole_text() {
        let t = tokenizer();
        let text = "The quick brown fox, 12345 jumped\tover  the lazy dog.\n\nA new paragraph:   \
                    three spaces, é and 日本語 and 🦀 — then <|im_start|>user\nHi<|im_end|>\n \n end ";
        let whole = t.encode(text).unwrap();
        for piece in (1..=48).chain([64, 100, 1000]) {
            assert_eq!(t.encode_pieces(text, None, piece).unwrap(), whole, "pieces of {piece} bytes");
            for m in [0, 1, 5, whole.len() - 1, whole.len(), whole.len() + 3] {
                let want = &whole[..m.min(whole.len())];
                assert_eq!(t.encode_pieces(text, Some(m), piece).unwrap(), want, "{piece} bytes, {m} tokens");
            }
        }
        assert_eq!(t.encode_prefix("", Some(4)).unwrap(), t.encode("").unwrap());
        // A text without whitespace is one piece.
        let word = "x".repeat(300);
        assert_eq!(t.encode_pieces(&word, None, 16).unwrap(), t.encode(&word).unwrap());
    }

    #[test]
    fn pieces_end_before_a_word_and_on_a_char_boundary() {
        assert_eq!(piece_end("abc def ghi", 5), 3);
        assert_eq!(piece_end("abc def ghi", 100), 11);
        assert_eq!(piece_end("abcdefgh ij", 4), 8, "the first cut after the limit");
        assert_eq!(piece_end("é é é é", 4), 2);
        assert_eq!(piece_end("abc  \n", 2), 6, "no word follows: everything");
        assert_eq!(piece_end("abc\tdef ghi", 5), 7, "a tab is not a cut");
    }
}
