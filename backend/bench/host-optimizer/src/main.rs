//! The executor's host optimizer step (AdamW, `backend/src/optim/host.rs`,
//! compiled from that very file) over N parameters, against its physical
//! bound measured in the same run: the bytes the step touches (read: weights,
//! gradients, two moments; written: weights, two moments = 28 bytes per
//! parameter) divided by the host memory bandwidth of a plain multi-threaded
//! copy (bytes read + bytes written per second). Prints the ratio
//! bound / measured (1.0: the step runs at memory speed).

#[path = "../../../src/optim/host.rs"]
#[allow(dead_code)]
mod host;

use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Seconds of one copy of `src` into `dst` over `threads` threads.
fn copy(src: &[f32], dst: &mut [f32], threads: usize) -> f64 {
    let chunk = src.len().div_ceil(threads);
    let start = Instant::now();
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
    start.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args
        .get(1)
        .map(|a| a.parse().expect("PARAMS is a count"))
        .unwrap_or(32 << 20);
    let threads: usize = args
        .get(2)
        .map(|a| a.parse().expect("THREADS is a count"))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |t| t.get()));
    let rule = host::Rule::AdamW {
        beta_1: 0.9,
        beta_2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.1,
    };
    let mut p: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let g: Vec<f32> = (0..n).map(|i| ((i * 7) % 1000) as f32 * 1e-4 - 0.05).collect();
    let (mut m1, mut m2) = (Vec::new(), Vec::new());
    // Warm-up: allocates the moments and faults their pages in.
    host::step(rule, 1e-4, 1, &mut p, &g, &mut m1, &mut m2, threads);
    let mut steps = Vec::new();
    for t in 2..8 {
        let start = Instant::now();
        host::step(rule, 1e-4, t, &mut p, &g, &mut m1, &mut m2, threads);
        steps.push(start.elapsed().as_secs_f64());
    }
    let step = median(steps);
    // The copy moves as many bytes as the step reads (4 vectors of n).
    let src: Vec<f32> = vec![1.0; 4 * n];
    let mut dst: Vec<f32> = vec![0.0; 4 * n];
    copy(&src, &mut dst, threads);
    let copies: Vec<f64> = (0..5).map(|_| copy(&src, &mut dst, threads)).collect();
    let copy_s = median(copies);
    let copy_bw = 2.0 * (4 * n * 4) as f64 / copy_s;
    let touched = 28.0 * n as f64;
    let bound = touched / copy_bw;
    println!("params                 {n}");
    println!("threads                {threads}");
    println!("copy bandwidth         {:.2} GB/s (read + write)", copy_bw / 1e9);
    println!("adamw step             {:.4} s ({:.2} GB/s touched, {:.1} M params/s)", step, touched / step / 1e9, n as f64 / step / 1e6);
    println!("bound (28 B/param)     {:.4} s", bound);
    println!("bound / measured       {:.2}", bound / step);
    // Keep the results alive.
    assert!(p.iter().take(4).all(|x| x.is_finite()) && dst[0] == 1.0);
}
