//! Data-parallel `rcoa run` over processes on the CPU, on loopback only:
//! `rcoa orchestrate` plus two ranks of a plan with `data = 2`. Both ranks
//! must finish, report the same falling loss and end with the same parameter
//! checksum (their weights stayed equal), and the loss curve must equal one
//! process training the same global batch with twice the micro-batch. Every
//! child is killed after a hard deadline, so a hang fails instead of
//! blocking the test run.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(120);

/// The tiny CPU decoder with two data-parallel ranks: 2 ranks × micro-batch
/// 2 × grad_accum 2 = global batch 8, as `plans/tiny-cpu.plan` (1 × 4 × 2).
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
parallel { data = 2  zero = 0 }
fit { checkpoint = none }
target burn
"#;

fn rcoa() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rcoa"))
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rcoa-cli-dist-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A port nothing listens on now (the OS picks it; released before use).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills every child it holds when dropped (also when a test panics).
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The JSON lines of a run's stdout (burn-collective also prints a
/// `Connecting to ...` line there, which is skipped).
fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn losses(lines: &[serde_json::Value]) -> Vec<f64> {
    lines
        .iter()
        .filter(|v| v.get("step").is_some() && v.get("event").is_none())
        .map(|v| v["loss"].as_f64().unwrap())
        .collect()
}

fn summary(lines: &[serde_json::Value]) -> serde_json::Value {
    lines
        .iter()
        .find(|v| v["event"] == "summary")
        .cloned()
        .expect("a summary line")
}

#[test]
fn two_ranks_keep_equal_weights_and_match_one_process() {
    let dir = temp("two");
    let plan = dir.join("tiny-2ranks.plan");
    std::fs::write(&plan, TWO_RANKS).unwrap();
    let steps = "6";

    let port = free_port();
    let mut children = Children(Vec::new());
    children.0.push(
        rcoa()
            .args([
                "orchestrate",
                "--port",
                &port.to_string(),
                "--timeout",
                "150",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the orchestrator did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let mut outs = Vec::new();
    for rank in 0..2 {
        let (out, err) = (
            dir.join(format!("r{rank}.out")),
            dir.join(format!("r{rank}.err")),
        );
        let node = format!("127.0.0.1:{}", free_port());
        children.0.push(
            rcoa()
                .arg("run")
                .arg(&plan)
                .args(["--steps", steps, "--format", "json", "--nodes", "2"])
                .args(["--node-rank", &rank.to_string()])
                .args(["--orchestrator", &format!("127.0.0.1:{port}")])
                .args(["--node-address", &node])
                .stdout(std::fs::File::create(&out).unwrap())
                .stderr(std::fs::File::create(&err).unwrap())
                .spawn()
                .unwrap(),
        );
        outs.push((out, err));
    }
    let mut status = [None, None];
    while status.iter().any(Option::is_none) {
        for (i, s) in status.iter_mut().enumerate() {
            if s.is_none() {
                *s = children.0[i + 1].try_wait().unwrap();
            }
        }
        if start.elapsed() > DEADLINE {
            let errs: Vec<String> = outs
                .iter()
                .map(|(_, e)| std::fs::read_to_string(e).unwrap_or_default())
                .collect();
            panic!("the ranks did not finish within {DEADLINE:?}: {errs:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (i, s) in status.iter().enumerate() {
        assert!(
            s.unwrap().success(),
            "rank {i} failed: {}",
            std::fs::read_to_string(&outs[i].1).unwrap_or_default()
        );
    }

    let ranks: Vec<Vec<serde_json::Value>> = outs.iter().map(|(o, _)| json_lines(o)).collect();
    for (r, lines) in ranks.iter().enumerate() {
        assert!(
            lines.iter().all(|v| v["rank"] == r),
            "rank {r} tags its lines"
        );
    }
    let (l0, l1) = (losses(&ranks[0]), losses(&ranks[1]));
    assert_eq!(l0.len(), 6);
    assert!(l0[5] < l0[0], "the loss falls: {l0:?}");
    // Both ranks report the global batch's loss (all-reduced) ...
    assert_eq!(l0, l1, "the ranks disagree on the loss");
    // ... and stepped the same weights.
    let (s0, s1) = (summary(&ranks[0]), summary(&ranks[1]));
    let (c0, c1) = (
        s0["param_checksum"].as_f64().unwrap(),
        s1["param_checksum"].as_f64().unwrap(),
    );
    assert_eq!(c0, c1, "the ranks' weights diverged");

    // One process, micro-batch 4: the same rows in every global batch, so
    // the same loss curve up to the order of float sums.
    let single = dir.join("single.out");
    let plan1 = Path::new(env!("CARGO_MANIFEST_DIR")).join("plans/tiny-cpu.plan");
    let st = rcoa()
        .arg("run")
        .arg(&plan1)
        .args(["--steps", steps, "--format", "json"])
        .stdout(std::fs::File::create(&single).unwrap())
        .status()
        .unwrap();
    assert!(st.success());
    let one = losses(&json_lines(&single));
    for (a, b) in l0.iter().zip(&one) {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "2 ranks × 2 {l0:?} vs 1 × 4 {one:?}"
        );
    }
    drop(children);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rank_count_must_match_the_plan() {
    let dir = temp("mismatch");
    let plan = dir.join("tiny-2ranks.plan");
    std::fs::write(&plan, TWO_RANKS).unwrap();
    // No orchestrator is needed: both are refused before connecting.
    let cases: [&[&str]; 2] = [
        &["--steps", "1"],
        &[
            "--steps",
            "1",
            "--nodes",
            "3",
            "--node-rank",
            "0",
            "--orchestrator",
            "127.0.0.1:1",
            "--node-address",
            "127.0.0.1:2",
        ],
    ];
    for args in cases {
        let out = rcoa().arg("run").arg(&plan).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("rcoa::distributed"), "{args:?}: {err}");
        assert!(err.contains("data"), "{args:?}: {err}");
    }
    let out = rcoa()
        .arg("run")
        .arg(&plan)
        .args(["--steps", "1", "--nodes", "2", "--node-rank", "2"])
        .args([
            "--orchestrator",
            "127.0.0.1:1",
            "--node-address",
            "127.0.0.1:2",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node-rank must be below --nodes"));
    let _ = std::fs::remove_dir_all(&dir);
}
