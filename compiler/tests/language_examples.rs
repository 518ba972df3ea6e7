//! Every complete example in `docs/language.md` is a plan the compiler takes:
//! each block fenced as ```plan resolves without error and compiles (fitting
//! or not). Blocks fenced as ```plan fragment are partial on purpose (one
//! section, or a file that needs a `config.json` beside it); the grammar's
//! tests parse and format them.

use rcoa_compiler::resolve::{resolve, ResolveContext};
use std::path::PathBuf;

/// (first line number, body) of each block fenced exactly as ```plan.
fn complete_plans(markdown: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (i, line) in markdown.lines().enumerate() {
        let fence = line.trim();
        match &mut cur {
            None if fence == "```plan" => cur = Some((i + 2, String::new())),
            Some(_) if fence.starts_with("```") => out.extend(cur.take()),
            Some((_, body)) => {
                body.push_str(line);
                body.push('\n');
            }
            None => {}
        }
    }
    out
}

#[test]
fn every_complete_example_resolves_and_compiles() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/language.md");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let plans = complete_plans(&text);
    assert!(plans.len() >= 10, "only {} complete examples", plans.len());
    for (line, src) in plans {
        let name = format!("docs/language.md:{line}");
        let file = rcoa_grammar::parse(&name, &src).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ctx = ResolveContext::new(name.clone(), src.clone(), PathBuf::new());
        let spec = resolve(&file, &ctx).unwrap_or_else(|errs| {
            let all: Vec<String> = errs.errors().iter().map(|e| e.to_string()).collect();
            panic!("{name} does not resolve:\n{}\n{src}", all.join("\n"))
        });
        if let Err(e) = rcoa_compiler::compile(&spec) {
            panic!("{name} does not compile: {e}\n{src}");
        }
    }
}

#[test]
fn fragments_are_told_apart_from_complete_plans() {
    let md = "```plan\nmodel \"x\"\n```\n\n```plan fragment\nfit { }\n```\n";
    assert_eq!(complete_plans(md), vec![(2, "model \"x\"\n".to_string())]);
}
