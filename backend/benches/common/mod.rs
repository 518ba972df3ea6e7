//! What the benches share: finding a device without a panic's noise, and timing a queue of
//! calls. Each bench is its own binary and uses some of it.
#![allow(dead_code)]

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use std::time::Instant;

/// `f()`, or `None` if it panics (CubeCL's clients panic without a device), without the
/// panic's message and backtrace.
pub fn quietly<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe) -> Option<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(f).ok();
    std::panic::set_hook(hook);
    out
}

/// The device `make` gives, or `None` where its first use panics.
pub fn device<B: Backend>(
    make: impl FnOnce() -> B::Device + std::panic::UnwindSafe,
) -> Option<B::Device> {
    quietly(|| {
        let dev = make();
        let _ = Tensor::<B, 1>::zeros([1], &dev).into_data();
        dev
    })
}

/// Mean seconds of `f` over `repeats` calls queued back to back (their outputs kept until
/// the end), after `warmup` calls.
pub fn mean_seconds<B: Backend, T>(
    dev: &B::Device,
    warmup: usize,
    repeats: usize,
    mut f: impl FnMut() -> T,
) -> f64 {
    for _ in 0..warmup {
        let _ = f();
    }
    B::sync(dev).expect("device sync");
    let start = Instant::now();
    let out: Vec<T> = (0..repeats).map(|_| f()).collect();
    B::sync(dev).expect("device sync");
    let t = start.elapsed().as_secs_f64() / repeats as f64;
    drop(out);
    t
}
