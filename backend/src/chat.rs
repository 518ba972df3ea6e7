//! A checkpoint's chat template (`tokenizer_config.json`'s `chat_template`, or
//! `chat_template.jinja` beside it as transformers 5 saves it), rendered as
//! transformers' `apply_chat_template` renders it: Jinja with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python's string and dict methods
//! (`minijinja-contrib`'s `pycompat`), `raise_exception`, `strftime_now`, a
//! `tojson` that writes Python's `json.dumps` (`", "` and `": "`, no HTML escaping),
//! and the special tokens' strings (`bos_token`, `eos_token`, ...) as variables.
//!
//! Templates that mark the assistant's tokens with `{% generation %}` (TRL's
//! `assistant_only_loss`) are refused with the reason: rcoa trains on the whole
//! conversation, as TRL does by default.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use std::path::Path;

/// A chat template and the special tokens it may print.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
    tokens: Vec<(&'static str, String)>,
}

const SPECIAL: [&str; 6] = [
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "sep_token",
    "cls_token",
];

impl ChatTemplate {
    /// The template of the tokenizer in `dir`, whose `tokenizer_config.json` is `config`
    /// (`Null` without one), if it has one; `Err` for one that cannot be used.
    pub fn load(dir: &Path, config: &serde_json::Value) -> Result<Option<ChatTemplate>, String> {
        let path = dir.join("tokenizer_config.json");
        if config.is_null() && path.is_file() {
            return Err(format!("`{}` is not a JSON object", path.display()));
        }
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.is_file() {
            std::fs::read_to_string(&jinja).map_err(|e| format!("`{}`: {e}", jinja.display()))?
        } else {
            match config.get("chat_template") {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => s.clone(),
                // Several named templates: transformers takes `default`.
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .ok_or("`chat_template` lists named templates but none is `default`")?
                    .to_string(),
                Some(_) => return Err("`chat_template` is neither a string nor a list".into()),
            }
        };
        if source.contains("{% generation %}") || source.contains("{%- generation %}") {
            return Err(
                "the chat template marks the assistant's tokens (`{% generation %}`, for TRL's assistant_only_loss); \
                 rcoa trains on the whole conversation and does not render that tag"
                    .into(),
            );
        }
        let tokens = SPECIAL
            .iter()
            .filter_map(|&name| {
                let v = config.get(name)?;
                let s = v
                    .as_str()
                    .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
                Some((name, s.to_string()))
            })
            .collect();
        Ok(Some(ChatTemplate { source, tokens }))
    }

    /// A template given as text (tests), without special tokens.
    pub fn from_source(source: &str) -> ChatTemplate {
        ChatTemplate {
            source: source.into(),
            tokens: Vec::new(),
        }
    }

    /// The template compiled once, for rendering a file's conversations.
    pub fn renderer(&self) -> Result<Renderer<'_>, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_filter("tojson", tojson);
        env.add_template("chat", &self.source)
            .map_err(|e| format!("the chat template does not parse: {e}"))?;
        Ok(Renderer {
            env,
            tokens: &self.tokens,
        })
    }
}

/// A [`ChatTemplate`] compiled.
pub struct Renderer<'a> {
    env: Environment<'a>,
    tokens: &'a [(&'static str, String)],
}

impl Renderer<'_> {
    /// `messages` (a JSON list of `{"role", "content", ...}`) rendered to text;
    /// `add_generation_prompt` opens the assistant's turn, as for a prompt.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let mut ctx: std::collections::BTreeMap<&str, Value> = self
            .tokens
            .iter()
            .map(|(k, v)| (*k, Value::from(v.as_str())))
            .collect();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        self.env
            .get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| format!("the chat template failed: {e}"))
    }
}

/// Python's `json.dumps(value, indent=indent, ensure_ascii=False)`, as transformers'
/// `tojson`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `datetime.now().strftime(format)` for the directives chat templates use (UTC).
fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages() -> serde_json::Value {
        serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "  Hi there  "},
            {"role": "assistant", "content": "Hello."}
        ])
    }

    /// ChatML (Qwen's layout) with the Python methods, loop controls and the special
    /// tokens templates use.
    #[test]
    fn renders_as_jinja_with_python_methods() {
        let t = ChatTemplate {
            source: "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' and loop.first %}{% continue %}{% endif %}\
                     <|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}\
                     {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
                .into(),
            tokens: vec![("bos_token", "<s>".into())],
        };
        let t = t.renderer().unwrap();
        let text = t.render(&messages(), false).unwrap();
        assert_eq!(
            text,
            "<s><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        );
        let prompt = t.render(&serde_json::json!([messages()[1]]), true).unwrap();
        assert!(
            prompt.ends_with("<|im_end|>\n<|im_start|>assistant\n"),
            "{prompt}"
        );
        let py = ChatTemplate::from_source(
            "{{ messages[1].content.strip().upper() }}|{{ messages[0].get('name', 'x') }}|{{ {'a': [1, 'b']} | tojson }}",
        );
        assert_eq!(
            py.renderer().unwrap().render(&messages(), false).unwrap(),
            "HI THERE|x|{\"a\": [1, \"b\"]}"
        );
    }

    #[test]
    fn template_errors_are_messages() {
        let t = ChatTemplate::from_source("{{ raise_exception('roles must alternate') }}");
        let e = t
            .renderer()
            .unwrap()
            .render(&messages(), false)
            .unwrap_err();
        assert!(e.contains("roles must alternate"), "{e}");
        let e = ChatTemplate::from_source("{% for m in messages %}")
            .renderer()
            .err()
            .unwrap();
        assert!(e.contains("does not parse"), "{e}");
        let d = strftime_now("%d %b %Y");
        assert!(
            d.len() == 11 && d[7..].parse::<i32>().unwrap() >= 2024,
            "{d}"
        );
    }
}
