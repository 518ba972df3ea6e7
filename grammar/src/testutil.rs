//! Helpers shared by this crate's unit tests.

/// The bodies of the ```plan fenced blocks in a Markdown text.
pub(crate) fn plan_blocks(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for line in markdown.lines() {
        let t = line.trim_start();
        match &mut cur {
            None if t.starts_with("```plan") => cur = Some(String::new()),
            Some(body) if t.starts_with("```") => {
                out.push(std::mem::take(body));
                cur = None;
            }
            Some(body) => {
                body.push_str(line);
                body.push('\n');
            }
            None => {}
        }
    }
    out
}
