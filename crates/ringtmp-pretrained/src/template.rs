//! Chat templates as Hugging Face writes them (Jinja, in `tokenizer_config.json` or a GGUF
//! file's `tokenizer.chat_template`), rendered with `minijinja` as `transformers`'
//! `apply_chat_template` renders them: blocks trimmed and left-stripped, Python's string methods
//! (`.strip()`, `.startswith()`, …), `raise_exception(message)` an error carrying the template's
//! message, `tojson` writing JSON as Python's `json.dumps` does (no escaping of `<`, `>`, `&`;
//! `indent` when asked), and `bos_token`, `eos_token`, `messages` and `add_generation_prompt`
//! in the context, with any other variables the caller gives (`date_string`, `tools`, …).
//!
//! Invariant: a template that does not compile, or raises while rendering, is a
//! [`TemplateError`] with the template's own message; rendering never panics.

use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, Value};

/// A template that would not compile or render.
#[derive(Debug, thiserror::Error)]
#[error("chat template: {0}")]
pub struct TemplateError(String);

impl From<Error> for TemplateError {
    fn from(e: Error) -> Self {
        // The template's own message (`raise_exception`) is the detail; anything else, minijinja's.
        match e.kind() {
            ErrorKind::InvalidOperation => {
                TemplateError(e.detail().map_or_else(|| e.to_string(), str::to_string))
            }
            _ => TemplateError(e.to_string()),
        }
    }
}

/// A chat template, compiled.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as Hugging Face's: Python's `json.dumps(value, ensure_ascii=False, indent=indent)`
/// (`", "` and `": "` between items when not indented), keys in the order the value has them.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// `value` as Python's `json.dumps` writes it.
fn write_json(
    value: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    let text = |s: &str| serde_json::to_string(s).expect("a string serialises");
    match value.kind() {
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
            let map = value.kind() == ValueKind::Map;
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str(if map { "{}" } else { "[]" });
                return Ok(());
            }
            out.push(if map { '{' } else { '[' });
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                if map {
                    out.push_str(&text(&item.to_string()));
                    out.push_str(": ");
                    write_json(&value.get_item(item)?, indent, depth + 1, out)?;
                } else {
                    write_json(item, indent, depth + 1, out)?;
                }
            }
            newline(out, depth);
            out.push(if map { '}' } else { ']' });
        }
        ValueKind::String => out.push_str(&text(value.as_str().unwrap_or_default())),
        ValueKind::None | ValueKind::Undefined => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(f) if value.as_i64().is_none() => out.push_str(
                &serde_json::to_string(&f)
                    .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?,
            ),
            _ => out.push_str(&value.to_string()),
        },
        _ => out.push_str(&text(&value.to_string())),
    }
    Ok(())
}

/// One message of a conversation: who says it, and what.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or a tool's role).
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatTemplate {
    /// Compiles `source`, with the model's BOS and EOS tokens' text.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(TemplateError::from)?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_string())?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders `messages`, with the assistant's turn opened when `add_generation_prompt`, and
    /// `extra` variables (their objects' keys in sorted order).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TemplateError> {
        let mut context: std::collections::BTreeMap<String, Value> = extra
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(Serde(v))))
            .collect();
        context.insert("messages".into(), Value::from(Serde(messages)));
        context.insert("add_generation_prompt".into(), add_generation_prompt.into());
        context.insert("bos_token".into(), self.bos_token.clone().into());
        context.insert("eos_token".into(), self.eos_token.clone().into());
        let template = self.env.get_template("chat")?;
        Ok(template.render(Value::from(context))?)
    }
}
