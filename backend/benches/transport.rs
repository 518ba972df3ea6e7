//! The collectives between processes (`rcoa run --nodes N`) against what the
//! machine can move, measured in the same run.
//!
//! Two processes (this binary, started twice) join burn-collective through an
//! orchestrator on loopback and time the three operations the executor uses
//! on a flat fp32 vector: the all-reduce of data parallelism, and the
//! reduce-scatter and all-gather of ZeRO. The baseline is two threads that
//! swap the same number of bytes over plain loopback TCP sockets, in both
//! directions at once, as a ring of two does. Each operation is reported as
//! NCCL's bus bandwidth (the bytes one rank sends per second: 2(n−1)/n of the
//! vector for an all-reduce, (n−1)/n for the other two) and as the ratio of
//! that to the baseline (1.0: the collective moves bytes as fast as bare TCP).
//! Once per size, outside the timings, each rank also checks the values the
//! three operations return (rank- and position-dependent inputs), and the
//! benchmark fails if one is off.
//!
//!     cargo bench -p rcoa-backend --bench transport -- [MiB...] [--cuda [--bf16]]
//!
//! `--cuda` (a build with `--features cuda`) puts both ranks' tensors on GPU 0
//! through the executor's CUDA backend, so the device read-back and write are
//! timed and checked too; `--bf16` sends bf16 vectors (CUDA only: NdArray has
//! no bf16), the ring's 16-bit path.

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, FloatDType, Int, Tensor};
use rcoa_backend::distributed::Collective;
use rcoa_backend::testing::{free_port, loopback_node};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RANK_VAR: &str = "RCOA_TRANSPORT_RANK";
const ORCHESTRATOR_VAR: &str = "RCOA_TRANSPORT_ORCHESTRATOR";
const REPEATS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn sizes_mib() -> Vec<usize> {
    let given: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if given.is_empty() {
        vec![16, 256]
    } else {
        given
    }
}

/// Seconds for each side of a loopback connection pair to send `bytes` to
/// the other while receiving as many (the median of `REPEATS`).
fn tcp_swap_seconds(bytes: usize) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (b, _) = listener.accept().unwrap();
    let data = vec![7u8; bytes];
    let mut times = Vec::new();
    for _ in 0..REPEATS {
        let start = Instant::now();
        // Each side writes and reads on threads of its own, the data borrowed:
        // nothing but the sockets' work is timed.
        std::thread::scope(|s| {
            for stream in [&a, &b] {
                let data = &data;
                s.spawn(move || {
                    let mut w = stream;
                    w.write_all(data).unwrap()
                });
                s.spawn(move || {
                    let mut r = stream;
                    let mut got = vec![0u8; 1 << 20];
                    let mut left = bytes;
                    while left > 0 {
                        let n = r.read(&mut got[..left.min(1 << 20)]).unwrap();
                        assert!(n > 0, "the peer closed the socket");
                        left -= n;
                    }
                });
            }
        });
        times.push(start.elapsed().as_secs_f64());
    }
    median(times)
}

/// One rank: times each operation on each size and prints `RESULT` lines.
fn rank<B: Backend>(rank: u32, orchestrator: String, device: B::Device, dtype: FloatDType) {
    let d = loopback_node(2, rank, orchestrator, Duration::from_secs(300));
    let c = Collective::<B>::register(&d, &device).unwrap();
    c.progress().set_step(1);
    // The first call waits for the peer to join; keep it out of the timings.
    c.mean(Tensor::<B, 1>::ones([64], &device)).unwrap();
    // Values in `mib` MiB of the vector's dtype (the table's GB/s count bytes).
    let per_mib = (1 << 20) / if dtype == FloatDType::F32 { 4 } else { 2 };
    for mib in sizes_mib() {
        let n = mib * per_mib;
        // A fresh input per call, made outside the timing: a tensor shared with a clone is
        // read back element by element by NdArray, which the executor's flat vectors (owned
        // once) are not.
        let timed = |what: &str, len: usize, f: &dyn Fn(Tensor<B, 1>)| {
            let mut times = Vec::new();
            for _ in 0..REPEATS {
                let x = Tensor::<B, 1>::ones([len], &device).cast(dtype);
                B::sync(&device).unwrap();
                let start = Instant::now();
                f(x);
                B::sync(&device).unwrap();
                times.push(start.elapsed().as_secs_f64());
            }
            println!("RESULT {rank} {what} {mib} {}", median(times));
        };
        timed("all-reduce", n, &|x| {
            c.mean(x).unwrap();
        });
        timed("reduce-scatter", n, &|x| {
            c.reduce_scatter_mean(x).unwrap();
        });
        timed("all-gather", n / 2, &|x| {
            c.all_gather(x).unwrap();
        });
        check(&c, rank, n, &device, dtype);
    }
    c.progress().set_done();
}

/// Values that differ by rank and by position (period 61, prime to every
/// block and chunk size), so that a block put in the wrong place, or left
/// over from an earlier call, shows. Small integers and their halves: exact
/// in fp32, fp16 and bf16 alike, so the check needs no tolerance.
fn values<B: Backend>(
    rank: u32,
    len: usize,
    device: &B::Device,
    dtype: FloatDType,
) -> Tensor<B, 1> {
    Tensor::<B, 1, Int>::arange(0..len as i64, device)
        .remainder_scalar(61)
        .float()
        .add_scalar(rank as f64 + 1.0)
        .cast(dtype)
}

fn assert_exact<B: Backend>(what: &str, got: Tensor<B, 1>, want: Tensor<B, 1>) {
    let err: f32 = (got.cast(FloatDType::F32) - want.cast(FloatDType::F32))
        .abs()
        .max()
        .into_scalar()
        .elem();
    assert!(err == 0.0, "{what}: the result is off by {err}");
}

/// Outside the timings, once per size: each operation's values, each call
/// right after the other as in a ZeRO step.
fn check<B: Backend>(
    c: &Collective<B>,
    rank: u32,
    n: usize,
    device: &B::Device,
    dtype: FloatDType,
) {
    let mean = || values::<B>(0, n, device, dtype).add_scalar(0.5);
    assert_exact(
        "all-reduce",
        c.mean(values(rank, n, device, dtype)).unwrap(),
        mean(),
    );
    let (shard, at) = c
        .reduce_scatter_mean(values(rank, n, device, dtype))
        .unwrap();
    let half = n / 2;
    assert_exact(
        "reduce-scatter",
        shard,
        mean().slice(at * half..(at + 1) * half),
    );
    // Blocks come in ring order, which is the order of the shard indices (set by when each
    // node registered, not by its rank): this rank's block at `at`, the other's beside it.
    let all = c.all_gather(values(rank, half, device, dtype)).unwrap();
    for p in 0..2 {
        let owner = if p == at { rank } else { 1 - rank };
        let block = all.clone().slice(p * half..(p + 1) * half);
        assert_exact("all-gather", block, values(owner, half, device, dtype));
    }
}

/// `--cuda` (with `--features cuda`): both ranks on GPU 0, the executor's
/// CUDA backend; `--bf16`: the vectors in bf16 (CUDA only).
fn run_rank(r: u32, orchestrator: String) {
    let args: Vec<String> = std::env::args().collect();
    let dtype = if args.iter().any(|a| a == "--bf16") {
        FloatDType::BF16
    } else {
        FloatDType::F32
    };
    if args.iter().any(|a| a == "--cuda") {
        #[cfg(feature = "cuda")]
        return rank::<burn::backend::Cuda<f32>>(r, orchestrator, Default::default(), dtype);
        #[cfg(not(feature = "cuda"))]
        panic!("--cuda needs `--features cuda`");
    }
    rank::<NdArray<f32>>(r, orchestrator, Default::default(), dtype);
}

fn main() {
    if let Ok(r) = std::env::var(RANK_VAR) {
        run_rank(r.parse().unwrap(), std::env::var(ORCHESTRATOR_VAR).unwrap());
        return;
    }
    let port = free_port();
    std::thread::spawn(move || {
        rcoa_backend::distributed::orchestrate(port, Duration::from_secs(3600)).unwrap()
    });
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        std::thread::sleep(Duration::from_millis(50));
    }
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(&exe)
                .args(std::env::args().skip(1))
                .env(RANK_VAR, r.to_string())
                .env(ORCHESTRATOR_VAR, format!("127.0.0.1:{port}"))
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut rows: Vec<(String, usize, f64)> = Vec::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "a rank failed");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(rest) = line.strip_prefix("RESULT ") else {
                continue;
            };
            let f: Vec<&str> = rest.split(' ').collect();
            let (what, mib, s) = (
                f[1].to_string(),
                f[2].parse().unwrap(),
                f[3].parse().unwrap(),
            );
            // The slower rank's time is the operation's.
            match rows.iter_mut().find(|r| r.0 == what && r.1 == mib) {
                Some(r) => r.2 = r.2.max(s),
                None => rows.push((what, mib, s)),
            }
        }
    }
    println!(
        "{:<15} {:>8} {:>10} {:>12} {:>14} {:>8}",
        "operation", "MiB", "seconds", "bus GB/s", "TCP GB/s", "ratio"
    );
    for (what, mib, s) in rows {
        let bytes = (mib << 20) as f64;
        // What one rank sends, n = 2: the all-reduce sends half the vector in
        // each of its two phases; the others send half once (the all-gather's
        // input is already the half).
        let sent = if what == "all-reduce" {
            bytes
        } else {
            bytes / 2.0
        };
        let tcp = sent / tcp_swap_seconds(sent as usize);
        let bus = sent / s;
        println!(
            "{what:<15} {mib:>8} {s:>10.3} {:>12.3} {:>14.3} {:>8.3}",
            bus / 1e9,
            tcp / 1e9,
            bus / tcp
        );
    }
}
