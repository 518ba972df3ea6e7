//! Tests of the HTML report through the real pipeline (parse, resolve, compile): the
//! golden page of one small plan, escaping of user text, and the parts every page must
//! have. Re-bless the golden with `INSTA_UPDATE=always cargo test -p rcoa-compiler report`.
//! `RCOA_REPORT_OUT=DIR` also writes the pages there, to look at in a browser.

use super::*;
use crate::resolve::{resolve, ResolveContext};
use std::path::Path;

/// A plan small enough for a readable golden (four layers, a few dozen timeline samples)
/// that still shows everything: two micro-batches, recomputed layers, a budget near the
/// peak with a visible reserve.
const PLAN: &str = r#"
model "tiny-decoder" { layers = 4  hidden = 256  heads = 4  ffn = 1024  vocab = 8192 }
hardware { gpu { memory = 400 MiB  bf16_tflops = 100  bandwidth = 1000 GB/s } }
precision bf16
optimizer adamw { lr = 1e-3 }
train { seq_len = 256  global_batch = 8  micro_batch = 4  grad_accum = auto }
fit { checkpoint = every 2  reserve = 24 MiB }
target pytorch
"#;

fn compile_src(src: &str) -> Compilation {
    let file = rcoa_grammar::parse("report.plan", src).expect("the plan parses");
    let spec = resolve(
        &file,
        &ResolveContext::new("report.plan", src, Path::new(".")),
    )
    .unwrap_or_else(|e| panic!("the plan resolves: {:?}", e.errors()));
    crate::compile(&spec).expect("the plan compiles")
}

fn save(name: &str, html: &str) {
    if let Ok(dir) = std::env::var("RCOA_REPORT_OUT") {
        let _ = std::fs::write(Path::new(&dir).join(name), html);
    }
}

#[test]
fn golden_page_of_a_small_plan() {
    let c = compile_src(PLAN);
    let html = compile_html(&c, "report.plan");
    save("golden.html", &html);
    insta::assert_snapshot!("compile_report", html);
}

#[test]
fn user_text_is_escaped_everywhere() {
    let mut c = compile_src(PLAN);
    let evil = r#"<script>alert("x")</script>&'"#;
    c.lowered.model.name = evil.to_string();
    c.explain
        .decisions
        .push(crate::explain::Decision::new(evil, evil, evil));
    c.report.peak.op = evil.to_string();
    for s in c.report.timeline.iter_mut() {
        s.op = evil.to_string();
    }
    let html = compile_html(&c, evil);
    save("escaped.html", &html);
    assert!(!html.contains("<script"), "raw <script> in the page");
    assert!(html.contains("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&#39;"));
    // The page has no scripts and fetches nothing.
    for bad in ["<script", "src=", "href=\"http", "@import", "url(http"] {
        assert!(!html.contains(bad), "found {bad}");
    }
}

#[test]
fn page_has_every_part() {
    let c = compile_src(PLAN);
    let html = compile_html(&c, "report.plan");
    for part in [
        r#"id="breakdown""#,
        r#"id="timeline""#,
        r#"id="decisions""#,
        r#"id="resolved""#,
        r#"id="time""#,
        r#"class="budget-line""#,
        r#"class="peak-label""#,
        r#"class="reserve""#,
        r#"data-phase="forward""#,
        r#"data-phase="backward""#,
        r#"data-phase="optimizer""#,
        r#"<g class="recompute">"#,
    ] {
        assert!(html.contains(part), "missing {part}");
    }
    // One bar segment per category with bytes at the peak, and none for empty ones.
    let bar = &html[html.find(r#"id="bar""#).unwrap()..];
    let bar = &bar[..bar.find("</svg>").unwrap()];
    for (k, v) in &c.report.breakdown {
        let seg = format!(r#"class="seg" data-category="{k}""#);
        assert_eq!(bar.matches(&seg).count(), usize::from(*v > 0), "{k} = {v}");
    }
    assert_eq!(bar.matches(r#"data-category="reserved""#).count(), 1);
    // The peak label names the op and layer of the peak.
    let p = &c.report.peak;
    let want = match p.layer {
        Some(l) => format!("{} · layer {} · {}", p.phase.as_str(), l, p.op),
        None => format!("{} · {}", p.phase.as_str(), p.op),
    };
    assert!(html.contains(&escape(&want)), "peak label {want}");
    // Exact bytes are in tooltips.
    assert!(html.contains(&bytes_exact(c.lowered.prediction.peak_bytes)));
}

#[test]
fn rejected_alternatives_are_listed_and_escaped() {
    let mut c = compile_src(PLAN);
    let budget = c.lowered.prediction.budget_bytes;
    c.explain.rejected = vec![
        crate::explain::Rejected {
            what: "zero = <2>".into(),
            peak_bytes: budget + (1 << 20),
            step_seconds: 0.5,
            why: "over the budget & slower".into(),
        },
        crate::explain::Rejected {
            what: "micro_batch = 2".into(),
            peak_bytes: budget / 2,
            step_seconds: f64::NAN,
            why: "slower".into(),
        },
    ];
    let html = compile_html(&c, "report.plan");
    save("rejected.html", &html);
    let sec = &html[html.find(r#"id="rejected""#).expect("a rejected section")..];
    let sec = &sec[..sec.find("</section>").unwrap()];
    assert!(sec.contains("zero = &lt;2&gt;") && sec.contains("over the budget &amp; slower"));
    assert_eq!(
        sec.matches("<tr").count(),
        4,
        "header, chosen, two alternatives"
    );
    assert_eq!(
        sec.matches(": over\"").count(),
        1,
        "only the first is over the budget"
    );
    // Without alternatives there is no section.
    c.explain.rejected.clear();
    assert!(!compile_html(&c, "report.plan").contains(r#"id="rejected""#));
}

#[test]
fn far_budget_is_named_and_the_bar_is_zoomed() {
    let src = PLAN.replace(
        "gpu { memory = 400 MiB  bf16_tflops = 100  bandwidth = 1000 GB/s }",
        "gpu = h100-80gb",
    );
    let c = compile_src(&src);
    let html = compile_html(&c, "far.plan");
    save("far.html", &html);
    assert!(html.contains("is above this scale"));
    assert!(html.contains(r#"id="bar-zoom""#));
}

#[test]
fn a_plan_that_does_not_fit_says_so_in_words() {
    let src = PLAN.replace("400 MiB", "100 MiB");
    let c = compile_src(&src);
    assert!(!c.lowered.prediction.fits);
    let html = compile_html(&c, "nofit.plan");
    save("nofit.html", &html);
    assert!(html.contains("Does not fit."));
    assert!(html.contains(r#"class="budget-line""#));
}

#[test]
fn run_page_shows_measured_beside_predicted() {
    let c = compile_src(PLAN);
    let p = c.lowered.prediction.peak_bytes;
    let run = RunRecord {
        plan_name: "<b>run</b>.plan".into(),
        device: "cpu".into(),
        memory_measure: "process RSS".into(),
        steps: (1..=6)
            .map(|i| StepRecord {
                step: i,
                loss: 9.0 / i as f64,
                step_seconds: if i == 1 { 0.5 } else { 0.1 },
                peak_bytes: p + p / 20,
            })
            .collect(),
        measured_peak_bytes: p + p / 20,
        measured_reserved_bytes: Some(p + p / 10),
        steady_step_seconds: 0.1,
        tokens_per_second: 20480.0,
    };
    let html = run_html(&c.lowered, &run);
    save("run.html", &html);
    assert!(html.contains("&lt;b&gt;run&lt;/b&gt;.plan"));
    assert!(html.contains("The prediction was low."));
    assert!(html.contains("+5.0%"));
    assert!(html.contains(r#"id="loss""#) && html.contains(r#"id="secs""#));
    assert_eq!(html.matches("<tr><td>").count(), 6, "one row per step");
}

#[test]
fn numbers_read_as_people_write_them() {
    assert_eq!(bytes_exact(0), "0 bytes");
    assert_eq!(bytes_exact(1234567), "1,234,567 bytes");
    assert_eq!(gib(3 << 29), "1.50 GiB");
    assert_eq!(compact_ranges(&[0, 1, 2, 5, 7, 8]), "0–2, 5, 7–8");
    assert_eq!(thousands(12345.6), "12,346");
}

#[test]
fn multi_gpu_pages_list_the_traffic_single_gpu_pages_do_not() {
    let one = compile_html(&compile_src(PLAN), "report.plan");
    assert!(!one.contains("id=\"traffic\""));
    let src = r#"
model "tiny-decoder"
hardware { gpu = h100-80gb  gpus_per_node = 4  nodes = 2 }
precision bf16
optimizer adamw { lr = 1e-3 }
train { seq_len = 256  global_batch = 32  micro_batch = 2 }
parallel { data = 4  tensor = 2  zero = 3 }
fit { checkpoint = none }
target pytorch
"#;
    let c = compile_src(src);
    let html = compile_html(&c, "traffic.plan");
    save("traffic.html", &html);
    assert!(html.contains("<section id=\"traffic\">"));
    assert!(html.contains("ZeRO-3 weight gather (forward)"));
    assert!(html.contains("<td>tensor × 2</td><td>intra_node</td>"));
    assert!(html.contains("<td>data × 4</td><td>inter_node</td>"));
    let rows = html
        .matches("<tr><th scope=\"row\">all-gather</th>")
        .count();
    assert_eq!(rows, 2, "forward and backward gathers");
}
