//! The OpenAI-compatible request and response bodies, and their checks.
//!
//! Requests refuse fields the API does not define (`deny_unknown_fields`), and accept the
//! defined ones this server cannot honour only at their neutral values (`n: 1`, `echo: false`,
//! no `logprobs`), so that a client never gets a silently different answer. `top_k`, `min_p`,
//! `repetition_penalty` and `ignore_eos` are llama-server's extensions.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::chat::Message;
use crate::sampling::SamplingParams;

/// An error body and its HTTP status.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// `invalid_request_error`, `not_found_error`, `rate_limit_error`, `server_error`.
    pub kind: &'static str,
    /// The offending parameter.
    pub param: Option<String>,
    /// Human-readable.
    pub message: String,
}

impl ApiError {
    /// A 400 for `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            param: Some(param.into()),
            message: message.into(),
        }
    }

    /// A 400 without a parameter (a body that is not JSON).
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self { status: 400, kind: "invalid_request_error", param: None, message: message.into() }
    }

    /// The body, as OpenAI shapes it.
    pub fn body(&self) -> Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": Value::Null } })
    }
}

/// A string or a list of strings (`stop`, `prompt`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One string.
    One(String),
    /// Many.
    Many(Vec<String>),
}

/// A completion prompt: text, one text in a list, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Texts (one only is served).
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<i64>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and stopping fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    /// The model's id (checked when given).
    pub model: Option<String>,
    /// Tokens to generate at most.
    pub max_tokens: Option<i64>,
    /// 0 to 2.
    pub temperature: Option<f32>,
    /// (0, 1].
    pub top_p: Option<f32>,
    /// Extension: keep the k most likely.
    pub top_k: Option<i64>,
    /// Extension: [0, 1).
    pub min_p: Option<f32>,
    /// Extension: (0, 10].
    pub repetition_penalty: Option<f32>,
    /// [-2, 2].
    pub frequency_penalty: Option<f32>,
    /// [-2, 2].
    pub presence_penalty: Option<f32>,
    /// The generator's seed.
    pub seed: Option<i64>,
    /// Up to 4 stop strings.
    pub stop: Option<OneOrMany>,
    /// Server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Choices: 1 only.
    pub n: Option<i64>,
    /// Caller's id (ignored).
    pub user: Option<String>,
    /// Extension: generate past end-of-generation tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Token log-probabilities: not served.
    pub logprobs: Option<Value>,
    /// Token biases: only an empty map.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
}

/// `/v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Echo the prompt: `false` only.
    #[serde(default)]
    pub echo: bool,
    /// `1` only.
    pub best_of: Option<i64>,
    /// Text after the completion: not served.
    pub suffix: Option<String>,
    /// The shared fields.
    #[serde(flatten)]
    pub common: Common,
}

/// Message content: text, or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Text.
    Text(String),
    /// Parts (`{"type": "text", "text": ...}`).
    Parts(Vec<Part>),
}

/// One part of a message's content.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// `text` only.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: Option<String>,
}

/// One chat message as sent.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessageIn {
    /// `system`, `developer`, `user`, `assistant`, `tool`.
    pub role: String,
    /// The content.
    pub content: Option<Content>,
    /// A participant's name (ignored).
    pub name: Option<String>,
}

/// `/v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessageIn>,
    /// The newer name of `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// `{"type": "text"}` only.
    pub response_format: Option<Value>,
    /// Top log-probabilities: not served.
    pub top_logprobs: Option<Value>,
    /// The shared fields.
    #[serde(flatten)]
    pub common: Common,
}

/// The fields of [`Common`]; serde's `deny_unknown_fields` does not see through `flatten`, so
/// [`parse`] checks the names itself.
pub const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "ignore_eos",
    "logprobs",
    "logit_bias",
];

/// The fields of `/v1/completions` besides [`COMMON_FIELDS`].
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "echo", "best_of", "suffix"];

/// The fields of `/v1/chat/completions` besides [`COMMON_FIELDS`].
pub const CHAT_FIELDS: &[&str] = &["messages", "max_completion_tokens", "response_format", "top_logprobs"];

/// Parses a request body: a JSON object whose fields are all in `fields` or the shared ones.
///
/// # Errors
/// [`ApiError`]: not JSON, not an object, an unknown field, or a field of the wrong type.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8], fields: &[&str]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_body(format!("the body is not valid JSON: {e}")))?;
    let Some(object) = value.as_object() else {
        return Err(ApiError::bad_body("the body is not a JSON object"));
    };
    if let Some(unknown) =
        object.keys().find(|k| !fields.contains(&k.as_str()) && !COMMON_FIELDS.contains(&k.as_str()))
    {
        return Err(ApiError::invalid(unknown, format!("unrecognized request argument supplied: {unknown}")));
    }
    serde_json::from_value(value).map_err(|e| ApiError::bad_body(format!("invalid request: {e}")))
}

/// The checked fields every request turns into.
#[derive(Debug, Clone)]
pub struct Checked {
    /// Tokens to generate at most, if the client set it.
    pub max_tokens: Option<usize>,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stream?
    pub stream: bool,
    /// Send usage in the stream?
    pub include_usage: bool,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
}

/// The largest `max_tokens`, `top_k` and seed accepted before they are compared with the
/// context.
const MAX_FIELD: i64 = 1 << 31;

impl Common {
    /// Checks the shared fields; `fresh_seed` seeds a request that gave none.
    ///
    /// # Errors
    /// [`ApiError`] naming the field.
    pub fn check(&self, served: &str, fresh_seed: u64) -> Result<Checked, ApiError> {
        if let Some(m) = &self.model
            && m != served
        {
            return Err(ApiError {
                status: 404,
                kind: "not_found_error",
                param: Some("model".into()),
                message: format!("the model {m:?} does not exist; this server serves {served:?}"),
            });
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("n", "only n = 1 is served"));
        }
        if self.logprobs.as_ref().is_some_and(|v| !v.is_null() && *v != Value::Bool(false)) {
            return Err(ApiError::invalid("logprobs", "log-probabilities are not served"));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::invalid("logit_bias", "logit biases are not served"));
        }
        let max_tokens = match self.max_tokens {
            None => None,
            Some(n) if (1..MAX_FIELD).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!("max_tokens is {n}; it must be at least 1"),
                ));
            }
        };
        let top_k = match self.top_k {
            None => 0,
            Some(k) if (0..MAX_FIELD).contains(&k) => k as usize,
            Some(k) => return Err(ApiError::invalid("top_k", format!("top_k is {k}; it must be 0 or more"))),
        };
        let d = SamplingParams::default();
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            seed: self.seed.map_or(fresh_seed, |s| s as u64),
        };
        if let Err(message) = sampling.validate() {
            let param = message.split(' ').next().unwrap_or_default().to_string();
            return Err(ApiError { param: Some(param), ..ApiError::invalid("", message) });
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return Err(ApiError::invalid("stop", format!("{} stop strings; at most 4", stop.len())));
        }
        if stop.iter().any(|s| s.len() > 1024) {
            return Err(ApiError::invalid("stop", "a stop string longer than 1024 bytes"));
        }
        let include_usage = self.stream_options.as_ref().is_some_and(|o| o.include_usage);
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::invalid("stream_options", "stream_options needs stream: true"));
        }
        Ok(Checked {
            max_tokens,
            sampling,
            stop,
            stream: self.stream,
            include_usage,
            ignore_eos: self.ignore_eos,
        })
    }
}

impl CompletionRequest {
    /// Refuses the fields this server does not serve.
    ///
    /// # Errors
    /// [`ApiError`] naming the field.
    pub fn check_extra(&self) -> Result<(), ApiError> {
        if self.echo {
            return Err(ApiError::invalid("echo", "echo is not served"));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("best_of", "only best_of = 1 is served"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "suffix is not served"));
        }
        Ok(())
    }
}

impl ChatRequest {
    /// The messages as the template takes them.
    ///
    /// # Errors
    /// [`ApiError`] for an empty conversation, parts that are not text, or an unknown role.
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "no messages"));
        }
        if self
            .response_format
            .as_ref()
            .is_some_and(|f| f.get("type").and_then(Value::as_str) != Some("text"))
        {
            return Err(ApiError::invalid("response_format", "only text responses are served"));
        }
        if self.top_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid("top_logprobs", "log-probabilities are not served"));
        }
        self.messages
            .iter()
            .map(|m| {
                let role = match m.role.as_str() {
                    "developer" => "system",
                    r @ ("system" | "user" | "assistant" | "tool") => r,
                    other => return Err(ApiError::invalid("messages", format!("unknown role {other:?}"))),
                };
                let content = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut text = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => text.push_str(t),
                                _ => {
                                    return Err(ApiError::invalid(
                                        "messages",
                                        format!("a content part of type {:?}; only text is served", p.kind),
                                    ));
                                }
                            }
                        }
                        text
                    }
                };
                Ok(Message { role: role.into(), content })
            })
            .collect()
    }
}

/// Token counts.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// Counts for a prompt and an output.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}
