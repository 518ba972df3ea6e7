//! A checkpoint's chat template (`tokenizer_config.json`'s `chat_template`, or
//! `chat_template.jinja` beside it as transformers 5 saves it), rendered as
//! transformers' `apply_chat_template` renders it: Jinja with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python's string and dict methods
//! (`minijinja-contrib`'s `pycompat`), `raise_exception`, `strftime_now`, a
//! `tojson` that writes Python's `json.dumps` (`", "` and `": "`, no HTML escaping),
//! and the special tokens' strings (`bos_token`, `eos_token`, ...) as variables.
//!
//! `{% generation %}` … `{% endgeneration %}` (transformers' `AssistantTracker`, which
//! TRL's `assistant_only_loss` reads) renders its body unchanged, and
//! [`Renderer::render_marked`] also says where each such body lies in the text: the
//! tags become `with` blocks (a scope, as the extension's call block has, and the same
//! whitespace control) around two marker characters, which the renderer removes and
//! records. Where transformers' offsets are wrong (a block inside another, or inside a
//! macro: it counts from where the enclosing output began), these are where the block's
//! text lies.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use std::ops::Range;
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

    /// Does the template mark the assistant's turns (`{% generation %}`)?
    pub fn marks_assistant(&self) -> bool {
        generation_tags(&self.source).0 > 0
    }

    /// The template compiled once, for rendering a file's conversations.
    pub fn renderer(&self) -> Result<Renderer<'_>, String> {
        let mut env = Environment::new();
        env.add_global(OPEN_GLOBAL, Value::from(OPEN.to_string()));
        env.add_global(CLOSE_GLOBAL, Value::from(CLOSE.to_string()));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_filter("tojson", tojson);
        let (blocks, source) = generation_tags(&self.source);
        env.add_template_owned("chat", source)
            .map_err(|e| format!("the chat template does not parse: {e}"))?;
        Ok(Renderer {
            env,
            tokens: &self.tokens,
            marked: blocks > 0,
        })
    }
}

/// A [`ChatTemplate`] compiled.
pub struct Renderer<'a> {
    env: Environment<'a>,
    tokens: &'a [(&'static str, String)],
    /// The template has `{% generation %}` blocks: its output holds markers (the data
    /// never does: `render_raw` refuses them).
    marked: bool,
}

impl Renderer<'_> {
    /// `messages` (a JSON list of `{"role", "content", ...}`) rendered to text;
    /// `add_generation_prompt` opens the assistant's turn, as for a prompt.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        self.render_marked(messages, add_generation_prompt)
            .map(|(text, _)| text)
    }

    /// [`Self::render`], and the byte ranges of the text that `{% generation %}` blocks
    /// rendered, in the order they closed (transformers' `generation_indices`, in bytes
    /// where it counts characters).
    pub fn render_marked(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<Range<usize>>), String> {
        let raw = self.render_raw(messages, add_generation_prompt)?;
        if !self.marked {
            return Ok((raw, Vec::new()));
        }
        unmark(&raw)
    }

    fn render_raw(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        if holds_marker(messages) {
            return Err(format!(
                "a message holds U+{:04X} or U+{:04X}, which rcoa reserves to find the template's `{{% generation %}}` blocks",
                OPEN as u32, CLOSE as u32
            ));
        }
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

// Unicode noncharacters: for a program's internal use, never in interchanged text.
const OPEN: char = '\u{FDD0}';
const CLOSE: char = '\u{FDD1}';
const OPEN_GLOBAL: &str = "__rcoa_generation_open";
const CLOSE_GLOBAL: &str = "__rcoa_generation_close";

/// `source` with each `{% generation %}` / `{% endgeneration %}` (any whitespace
/// control) rewritten to print a marker inside a `with` scope, and the number of
/// generation blocks. `{%- generation +%}` becomes
/// `{%- with %}{{ open }}{% with +%}`: the outer tag keeps the original's control over
/// the text before it (`-`, and `lstrip_blocks` where it starts a line), the inner one
/// its control over the text after (`-`, and `trim_blocks`' newline); between them
/// there is no text for either to trim.
fn generation_tags(source: &str) -> (usize, String) {
    let mut out = String::with_capacity(source.len());
    let mut blocks = 0;
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        match parse_generation_tag(tag) {
            Some((len, before, end, after)) => {
                let (word, marker) = if end {
                    ("endwith", CLOSE_GLOBAL)
                } else {
                    blocks += 1;
                    ("with", OPEN_GLOBAL)
                };
                out.push_str(&format!(
                    "{{%{before} {word} %}}{{{{ {marker} }}}}{{% {word} {after}%}}"
                ));
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    (blocks, out)
}

/// `tag` (which starts with `{%`) as `(its length, the whitespace control after
/// `{%`, whether it is `endgeneration`, the control before `%}`)` when it is a
/// generation tag.
fn parse_generation_tag(tag: &str) -> Option<(usize, &str, bool, &str)> {
    let control = |s: &str| match s.as_bytes().first() {
        Some(b'-' | b'+') => 1,
        _ => 0,
    };
    let body = &tag[2..];
    let before = &body[..control(body)];
    let body = body[before.len()..].trim_start();
    let (end, body) = if let Some(b) = body.strip_prefix("endgeneration") {
        (true, b)
    } else {
        (false, body.strip_prefix("generation")?)
    };
    let body = body.trim_start();
    let after = &body[..control(body)];
    let close = body[after.len()..].strip_prefix("%}")?;
    Some((tag.len() - close.len(), before, end, after))
}

/// Whether a string of `v` (a key or a value, at any depth) holds a marker.
fn holds_marker(v: &serde_json::Value) -> bool {
    use serde_json::Value as J;
    match v {
        J::String(s) => s.contains([OPEN, CLOSE]),
        J::Array(items) => items.iter().any(holds_marker),
        J::Object(map) => map
            .iter()
            .any(|(k, v)| k.contains([OPEN, CLOSE]) || holds_marker(v)),
        _ => false,
    }
}

/// The rendered text without its markers, and the ranges each open/close pair held.
fn unmark(raw: &str) -> Result<(String, Vec<Range<usize>>), String> {
    let mut text = String::with_capacity(raw.len());
    let mut open = Vec::new();
    let mut spans = Vec::new();
    for c in raw.chars() {
        match c {
            OPEN => open.push(text.len()),
            CLOSE => {
                let start = open
                    .pop()
                    .ok_or("the chat template closed a `{% generation %}` block it did not open")?;
                spans.push(start..text.len());
            }
            c => text.push(c),
        }
    }
    if !open.is_empty() {
        return Err("the chat template left a `{% generation %}` block open".into());
    }
    Ok((text, spans))
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

    /// `{% generation %}` renders as transformers' `AssistantTracker` renders it: the
    /// same text (whitespace control, `trim_blocks`, `lstrip_blocks`, `+`; a `set`
    /// inside stays inside) and the same spans, in bytes (transformers 5.23.0's
    /// `render_jinja_template(..., return_assistant_tokens_mask=True)` gave these, in
    /// characters: `yo é`'s 4 characters are 5 bytes).
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // each case lists its spans, one or more
    fn generation_blocks_render_as_transformers_and_say_where_they_are() {
        let msgs = serde_json::json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo é"}
        ]);
        let cases: [(&str, &str, &[std::ops::Range<usize>]); 5] = [
            (
                "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}|{% endfor %}",
                "hi|yo é|",
                &[0..2, 3..8],
            ),
            (
                "x\n  {% generation %}\nA{{ messages[0].content }}\n  {% endgeneration %}\nB",
                "x\nAhi\nB",
                &[2..6],
            ),
            ("a   {%- generation -%}   b   {%- endgeneration -%}   c", "abc", &[1..2]),
            (
                "{% set x = 1 %}{% generation %}{% set x = 2 %}{{ x }}{% endgeneration %}{{ x }}",
                "21",
                &[0..1],
            ),
            (
                "  {%+ generation %}x{% endgeneration %}\n  {%generation%}y{%endgeneration%}.",
                "  xy.",
                &[2..3, 3..4],
            ),
        ];
        for (source, text, spans) in cases {
            let t = ChatTemplate::from_source(source);
            assert!(t.marks_assistant(), "{source}");
            let r = t.renderer().unwrap();
            let (got, got_spans) = r.render_marked(&msgs, false).unwrap();
            assert_eq!(
                (got.as_str(), got_spans.as_slice()),
                (text, spans),
                "{source}"
            );
            assert_eq!(r.render(&msgs, false).unwrap(), text, "{source}");
        }
        // Names that only start like the tag are left to Jinja.
        let t = ChatTemplate::from_source("{% set generations = 1 %}{{ generations }}");
        assert!(!t.marks_assistant());
        assert_eq!(t.renderer().unwrap().render(&msgs, false).unwrap(), "1");
        // The markers cannot come from the data.
        let bad = serde_json::json!([{"role": "user", "content": "a\u{FDD0}b"}]);
        let e = ChatTemplate::from_source("{{ messages[0].content }}")
            .renderer()
            .unwrap()
            .render(&bad, false)
            .unwrap_err();
        assert!(e.contains("U+FDD0"), "{e}");
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
