//! `rcoa compile --report FILE`: the HTML report through the CLI, opened in a real browser.
//!
//! Headless Chromium (Debian's `chromium` package) loads the written page from disk,
//! dumps its DOM and takes a screenshot. The DOM must hold what the page promises (the
//! budget line, the peak labelled with its op and layer, one bar segment per category
//! with bytes at the peak) and the screenshot must be a real rendering, not a blank page
//! (a blank 1280×1600 page compresses to about 9 KB; the report to several hundred).
//! Where Chromium is not installed the browser tests say so and pass: the page itself is
//! golden-tested in `compiler/src/report`.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn rcoa() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rcoa"))
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh directory for one test under cargo's per-target temp dir.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("report_browser")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `/usr/bin/chromium`, or `chromium` / `chromium-browser` on the PATH.
fn chromium() -> Option<PathBuf> {
    let fixed = Path::new("/usr/bin/chromium");
    if fixed.is_file() {
        return Some(fixed.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in ["chromium", "chromium-browser"] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// Run headless Chromium on `html` with `extra` flags; its stdout. Fails after two minutes
/// rather than hanging the test run.
fn browse(chrome: &Path, dir: &Path, html: &Path, extra: &[String]) -> String {
    let profile = dir.join(format!("profile-{}", extra.len()));
    let _ = std::fs::remove_dir_all(&profile);
    let mut cmd = Command::new(chrome);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--window-size=1280,1600",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(format!("file://{}", html.display()))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("chromium starts");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("chromium runs").is_some() {
            break;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("chromium did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("chromium output");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Compile `plan` with `--report` and `--format json`: the page's path and the JSON.
fn compile_with_report(plan: &str, dir: &Path) -> (PathBuf, Value) {
    let html = dir.join("report.html");
    let out = rcoa()
        .arg("compile")
        .arg(workspace().join(plan))
        .args(["--format", "json", "--report"])
        .arg(&html)
        .output()
        .expect("rcoa runs");
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "rcoa compile failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    (html, json)
}

#[test]
fn report_is_written_and_self_contained() {
    let dir = scratch("written");
    let (html, json) = compile_with_report("plans/llama-3.1-8b-full-1xh100.plan", &dir);
    let page = std::fs::read_to_string(&html).expect("the report exists");
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert!(page.contains("<h1>llama-3.1-8b-full-1xh100.plan</h1>"));
    // Nothing to fetch, nothing to run, no path of this machine (the SVG namespace URI
    // names a namespace; it is never fetched).
    for bad in [
        "<script", "src=", "href=", "url(http", "@import", "<link", "<img",
    ] {
        assert!(!page.contains(bad), "found {bad}");
    }
    assert!(!page.contains(&*workspace().to_string_lossy()));
    let peak = json["memory"]["peak_bytes"].as_u64().unwrap();
    assert!(page.contains(&format!("{:.2} GiB", peak as f64 / (1u64 << 30) as f64)));
    // No temporary file left beside it.
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("report.html")]);
}

#[test]
fn unwritable_report_path_is_an_error() {
    let dir = scratch("unwritable");
    let out = rcoa()
        .arg("compile")
        .arg(workspace().join("plans/tiny-cpu.plan"))
        .arg("--report")
        .arg(dir.join("no/such/dir/report.html"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot write the report"));
}

#[test]
fn report_renders_in_chromium() {
    let Some(chrome) = chromium() else {
        eprintln!("skipped: chromium is not installed (apt-get install chromium)");
        return;
    };
    let dir = scratch("chromium");
    let (html, json) = compile_with_report("plans/llama-3.1-8b-full-1xh100.plan", &dir);
    let dom = browse(&chrome, &dir, &html, &["--dump-dom".to_string()]);
    assert!(dom.contains("<svg"), "no SVG in the DOM:\n{dom}");
    // The budget line, in the bar and in the timeline (or named when far off its scale).
    assert!(dom.matches(r#"class="budget-line""#).count() >= 1);
    // The peak, labelled with its op and layer.
    let at = &json["memory"]["peak_at"];
    let want = match at["layer"].as_u64() {
        Some(l) => format!(
            "{} · layer {} · {}",
            at["phase"].as_str().unwrap(),
            l,
            at["op"].as_str().unwrap()
        ),
        None => format!(
            "{} · {}",
            at["phase"].as_str().unwrap(),
            at["op"].as_str().unwrap()
        ),
    };
    let label = &dom[dom.find(r#"class="peak-label""#).expect("a peak label")..];
    assert!(
        label[..label.find("</text>").unwrap()].contains(&want),
        "peak label should name {want}"
    );
    // One segment per category with bytes at the peak (the reserve is one of them).
    let bar = &dom[dom.find(r#"id="bar""#).expect("the breakdown bar")..];
    let bar = &bar[..bar.find("</svg>").unwrap()];
    for (k, v) in json["memory"]["breakdown"].as_object().unwrap() {
        let n = bar
            .matches(&format!(r#"class="seg" data-category="{k}""#))
            .count();
        assert_eq!(n, usize::from(v.as_u64().unwrap() > 0), "segments for {k}");
    }
    // The screenshot is a real rendering of the right size.
    let png = dir.join("report.png");
    browse(
        &chrome,
        &dir,
        &html,
        &[format!("--screenshot={}", png.display())],
    );
    let bytes = std::fs::read(&png).expect("a screenshot");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!((width, height), (1280, 1600));
    assert!(
        bytes.len() > 40_000,
        "a {} byte screenshot is close to a blank page",
        bytes.len()
    );
}

#[test]
fn script_in_a_model_name_stays_text_in_the_browser() {
    let dir = scratch("escape");
    let plan = dir.join("evil.plan");
    std::fs::write(
        &plan,
        r#"model "tiny-decoder"
hardware { gpu = h100-80gb }
precision fp32
optimizer adamw { lr = 1e-3 }
train { seq_len = 32  global_batch = 4 }
target burn
"#,
    )
    .unwrap();
    // The model name is a catalog name; the file name is the user text that reaches the
    // page through the CLI (a model name with a script is tested in compiler/src/report).
    let evil = dir.join("<script>x=1&y.plan");
    std::fs::copy(&plan, &evil).unwrap();
    let html = dir.join("report.html");
    let out = rcoa()
        .arg("compile")
        .arg(&evil)
        .arg("--report")
        .arg(&html)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(!page.contains("<script>"));
    assert!(page.contains("&lt;script&gt;x=1&amp;y.plan"));
    if let Some(chrome) = chromium() {
        let dom = browse(&chrome, &dir, &html, &["--dump-dom".to_string()]);
        assert!(!dom.contains("<script>"), "the browser saw a script");
        assert!(dom.contains("&lt;script&gt;x=1&amp;y.plan"));
    }
}
