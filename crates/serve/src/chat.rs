//! Chat messages into a prompt: the model's own chat template (`tokenizer.chat_template` of the
//! GGUF, Jinja) rendered with minijinja, Python's string methods included, as Hugging Face's
//! `apply_chat_template` renders it. A model without a template gets ChatML, as llama.cpp does.

use minijinja::{Environment, Error as JinjaError, ErrorKind, context};
use serde::Serialize;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

/// ChatML, for models without a template of their own.
pub use kvq_candle::tokenizer::CHATML_TEMPLATE as CHATML;

impl ChatTemplate {
    /// Compiles `source` (ChatML when `None`); `bos` and `eos` are the texts of the model's
    /// BOS and EOS tokens, which templates may print.
    ///
    /// # Errors
    /// The template's syntax error.
    pub fn new(source: Option<&str>, bos: String, eos: String) -> Result<Self, String> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.unwrap_or(CHATML).to_string())
            .map_err(|e| format!("the model's chat template does not compile: {e}"))?;
        Ok(Self { env, bos, eos })
    }

    /// The prompt for `messages`, ending with the opening of the assistant's turn.
    ///
    /// # Errors
    /// What the template raises (a role it refuses, say), as a message for the client.
    pub fn render(&self, messages: &[Message]) -> Result<String, String> {
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| format!("the chat template refused the messages: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }

    #[test]
    fn chatml_opens_the_assistant_turn() {
        let t = ChatTemplate::new(None, String::new(), String::new()).unwrap();
        let p = t.render(&[msg("system", "Be brief."), msg("user", "Hi")]).unwrap();
        assert_eq!(
            p,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_bos_and_raise_exception_work() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}\
                   {{ raise_exception('bad role ' + m.role) }}{% endif %}[{{ m.content.strip() }}]{% endfor %}";
        let t = ChatTemplate::new(Some(src), "<s>".into(), "</s>".into()).unwrap();
        assert_eq!(t.render(&[msg("user", "  a ")]).unwrap(), "<s>[a]");
        let e = t.render(&[msg("robot", "x")]).unwrap_err();
        assert!(e.contains("bad role robot"), "{e}");
        assert!(ChatTemplate::new(Some("{% for %}"), String::new(), String::new()).is_err());
    }
}
