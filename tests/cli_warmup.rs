//! `rcoa warmup` on the CPU: it runs the plan's steps (and its evaluation's
//! shapes), saves nothing, leaves `rcoa run`'s results as they were, and
//! refuses bad input with a clear error (exit 2).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rcoa-cli-warmup-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `rcoa ARGS` with every cache location inside `home`.
fn rcoa(home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rcoa"))
        .args(args)
        .env("HOME", home)
        .env("XDG_CACHE_HOME", home.join("xdg"))
        .env_remove("RCOA_CACHE_DIR")
        .env_remove("CUDA_CACHE_PATH")
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Every file under `dir` with its bytes.
fn tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// The JSON step lines of `rcoa run`, without the timings.
fn run_losses(home: &Path, plan: &Path, eval: &Path) -> Vec<(u64, String)> {
    let out = rcoa(
        home,
        &[
            "run",
            plan.to_str().unwrap(),
            "--steps",
            "3",
            "--eval",
            eval.to_str().unwrap(),
            "--format",
            "json",
        ],
    );
    assert!(
        out.status.success(),
        "rcoa run failed: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("step").is_some())
        .map(|v| {
            let step = v["step"].as_u64().unwrap();
            // Bit-exact: the losses' JSON text.
            let loss = v.get("loss").unwrap_or(&v["eval_loss"]).to_string();
            (step, loss)
        })
        .collect()
}

#[test]
fn warmup_on_the_cpu_runs_the_shapes_saves_nothing_and_changes_no_run() {
    let dir = temp("cpu");
    let home = dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let plan = work.join("tiny.plan");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("plans/tiny-cpu.plan"),
        &plan,
    )
    .unwrap();
    // seq 32, micro-batch 4: 225 bytes and an EOS (byte tokens) are 7
    // evaluation windows, a full batch of 4 and a short one of 3.
    let eval = work.join("heldout.txt");
    std::fs::write(
        &eval,
        "the quick brown fox jumps over the lazy dog. ".repeat(5),
    )
    .unwrap();

    let before_run = run_losses(&home, &plan, &eval);
    let before = tree(&dir);
    // `--compile-jobs` only matters on CUDA.
    let out = rcoa(
        &home,
        &[
            "warmup",
            plan.to_str().unwrap(),
            "--eval",
            eval.to_str().unwrap(),
            "--compile-jobs",
            "3",
        ],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "rcoa warmup failed:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stdout.contains("device     cpu (ndarray)"), "{stdout}");
    assert!(
        stdout.contains("shapes     eval batch 4 × 32, eval batch 3 × 32, micro-batch 4 × 32"),
        "{stdout}"
    );
    assert!(stdout.contains("nothing to compile on the CPU"), "{stdout}");
    assert!(stderr.contains("2 steps of 2 micro-batch(es)"), "{stderr}");
    assert!(!stderr.contains("compiling ahead"), "{stderr}");
    // Nothing written: not beside the plan, not in a cache.
    assert_eq!(tree(&dir), before, "rcoa warmup wrote or changed files");
    assert!(!home.join("xdg").exists());
    // The run after it is the run before it, and on the CPU it says nothing
    // about compiling.
    assert_eq!(run_losses(&home, &plan, &eval), before_run);
    let out = rcoa(&home, &["run", plan.to_str().unwrap(), "--steps", "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("compiling kernels"));
    let _ = std::fs::remove_dir_all(&dir);
}

const TWO_RANKS: &str = r#"
model "tiny-decoder"
hardware { gpu = h100-80gb  gpus_per_node = 2 }
precision fp32
optimizer adamw { lr = 1e-3  weight_decay = 0.0 }
train {
  seq_len = 32
  global_batch = 8
  micro_batch = 2
  grad_accum = 2
  steps = 20
}
parallel { data = 2  zero = 1 }
fit { checkpoint = none }
target burn
"#;

#[test]
fn warmup_runs_a_data_parallel_plans_ranks_as_devices_and_refuses_another_count() {
    let dir = temp("ranks");
    let plan = dir.join("two.plan");
    std::fs::write(&plan, TWO_RANKS).unwrap();
    let p = plan.to_str().unwrap();
    let out = rcoa(&dir, &["warmup", p, "--devices", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("micro-batch 2 × 32"));
    for devices in [None, Some("3")] {
        let mut args = vec!["warmup", p];
        if let Some(d) = devices {
            args.extend(["--devices", d]);
        }
        let out = rcoa(&dir, &args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("pass --devices 2"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `rcoa ARGS` exits 2 with `needle` in its message and no panic.
fn refused(dir: &Path, args: &[&str], needle: &str) -> String {
    let out = rcoa(dir, args);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    err
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = temp("bad");
    // A missing plan.
    refused(&dir, &["warmup", "no/such.plan"], "no/such.plan");
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("plans/tiny-cpu.plan");
    let tiny = tiny.to_str().unwrap();
    // No device at all.
    refused(&dir, &["warmup", tiny, "--devices", "0"], "--devices");
    // A missing data file: the run's own error, before anything trains.
    refused(
        &dir,
        &["warmup", tiny, "--data", "no/such.jsonl"],
        "no/such.jsonl",
    );
    // CUDA where this build has none (the CI build) is refused, not a panic,
    // and no recording pass runs first.
    if !rcoa_backend::CUDA_BUILT {
        let err = refused(
            &dir,
            &["warmup", tiny, "--device", "cuda"],
            "without CUDA support",
        );
        assert!(!err.contains("recording"), "{err}");
    }
    // Compiling ahead: at least one thread; the recording pass is CUDA's.
    refused(
        &dir,
        &["warmup", tiny, "--compile-jobs", "0"],
        "--compile-jobs",
    );
    let record = dir.join("kernels.jsonl");
    let record_arg = record.to_str().unwrap();
    refused(
        &dir,
        &["warmup", tiny, "--record-kernels", record_arg],
        "give --device cuda",
    );
    assert!(!record.exists(), "nothing recorded on the CPU");
    let out = rcoa(&dir, &["warmup", "--help"]);
    let help = text(&out.stdout);
    assert!(help.contains("--compile-jobs <N>"), "{help}");
    assert!(
        !help.contains("--record-kernels"),
        "an internal flag: {help}"
    );
    // The command is listed in the help.
    let out = rcoa(&dir, &["--help"]);
    assert!(text(&out.stdout).contains("warmup"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A compile worker (`RCOA_NVRTC_JOBS`, started by the compile phase) serves its jobs
/// before anything else reads the command line: here, without the CUDA build, it
/// writes the reason it cannot compile where the phase reads each result, says so on
/// stdout, and ends at the end of its stdin.
#[test]
fn a_compile_worker_is_served_before_the_command_line_is_read() {
    use std::io::Write;
    let home = temp("compile-worker");
    let mut worker = Command::new(env!("CARGO_BIN_EXE_rcoa"))
        .env("RCOA_NVRTC_JOBS", &home)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    worker.stdin.take().unwrap().write_all(b"0\n1\n").unwrap();
    let out = worker.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "rcoa-nvrtc-done 0\nrcoa-nvrtc-done 1\n");
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    for job in ["0", "1"] {
        let result = std::fs::read(home.join(job).with_extension("out")).unwrap();
        assert_eq!(result[0], b'E');
        let why = text(&result[1..]);
        assert!(
            why.contains("built without CUDA") || why.contains("cannot read the compile job"),
            "{why}"
        );
    }
    std::fs::remove_dir_all(&home).unwrap();
}
