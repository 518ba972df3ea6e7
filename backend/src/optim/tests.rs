use super::*;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig, SimpleOptimizer};

type B = burn::backend::NdArray<f32>;

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 20001) as f32 / 10000.0 - 1.0
        })
        .collect()
}

fn tensor(v: &[f32]) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), &Default::default())
}

/// Burn's optimizer, four steps on one 1-D tensor.
fn burn_steps<O: SimpleOptimizer<B>>(o: O, lr: f64, n: usize) -> Vec<f32> {
    let mut t = tensor(&values(n, 1));
    let mut state = None;
    for step in 0..4 {
        let g = tensor(&values(n, 10 + step));
        let (nt, ns) = o.step::<1>(lr, t, g, state);
        t = nt;
        state = ns;
    }
    t.into_data().to_vec::<f32>().unwrap()
}

fn flat_steps(rule: Rule, place: Place, lr: f64, n: usize) -> Vec<f32> {
    let mut o = FlatOptim::<B>::new(rule, place, n);
    let mut t = tensor(&values(n, 1));
    for step in 0..4 {
        t = o.step(lr, t, tensor(&values(n, 10 + step)), None).unwrap();
    }
    t.into_data().to_vec::<f32>().unwrap()
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{x} vs {y}");
    }
}

#[test]
fn same_update_as_burn() {
    let n = 1000;
    let lr = 3e-2;
    let places = [Place::Device, Place::Host { threads: 3 }];
    let adamw = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-8)
        .with_weight_decay(0.1);
    let want = burn_steps(adamw.build(), lr, n);
    for place in places {
        let rule = Rule::AdamW {
            beta_1: 0.9,
            beta_2: 0.95,
            epsilon: 1e-8,
            weight_decay: 0.1,
        };
        close(&flat_steps(rule, place, lr, n), &want);
    }
    let adam = AdamConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(1e-8)
        .with_weight_decay(Some(WeightDecayConfig { penalty: 0.01 }));
    let want = burn_steps(adam.build(), lr, n);
    for place in places {
        let rule = Rule::Adam {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-8,
            penalty: Some(0.01),
        };
        close(&flat_steps(rule, place, lr, n), &want);
    }
    let sgd = SgdConfig::new()
        .with_momentum(Some(MomentumConfig {
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
        }))
        .with_weight_decay(Some(WeightDecayConfig { penalty: 0.01 }));
    let want = burn_steps(sgd.build::<B>(), lr, n);
    for place in places {
        let rule = Rule::Sgd {
            momentum: Some(0.9),
            penalty: Some(0.01),
        };
        close(&flat_steps(rule, place, lr, n), &want);
    }
    let want = burn_steps(SgdConfig::new().build::<B>(), lr, n);
    let plain = Rule::Sgd {
        momentum: None,
        penalty: None,
    };
    close(&flat_steps(plain, Place::Host { threads: 2 }, lr, n), &want);
    // Lion's update is ±lr per value: the host's arithmetic must match the
    // device's exactly, or a value near a sign change would move by 2 lr.
    let lion = lion::LionOptimizer {
        beta_1: 0.9,
        beta_2: 0.99,
        weight_decay: 0.1,
    };
    let want = burn_steps(lion, lr, n);
    for place in places {
        let rule = Rule::Lion {
            beta_1: 0.9,
            beta_2: 0.99,
            weight_decay: 0.1,
        };
        assert_eq!(flat_steps(rule, place, lr, n), want, "{place:?}");
    }
}

/// Two steps, save, a new optimizer loads the state (the other place), two
/// more steps: the same as four steps without a break.
#[test]
fn saved_state_resumes_the_same_steps() {
    let adamw = Rule::AdamW {
        beta_1: 0.9,
        beta_2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.1,
    };
    let lion = Rule::Lion {
        beta_1: 0.9,
        beta_2: 0.99,
        weight_decay: 0.0,
    };
    for rule in [adamw, lion] {
        resumes_the_same_steps(rule);
    }
}

fn resumes_the_same_steps(rule: Rule) {
    let n = 257;
    let want = flat_steps(rule, Place::Device, 1e-2, n);
    let mut a = FlatOptim::<B>::new(rule, Place::Device, n);
    let mut t = tensor(&values(n, 1));
    for step in 0..2 {
        t = a
            .step(1e-2, t, tensor(&values(n, 10 + step)), None)
            .unwrap();
    }
    let bytes = a.save_state().unwrap();
    let mut b = FlatOptim::<B>::new(rule, Place::Host { threads: 2 }, n);
    b.load_state(&bytes, &Default::default()).unwrap();
    assert_eq!(b.steps(), 2);
    for step in 2..4 {
        t = b
            .step(1e-2, t, tensor(&values(n, 10 + step)), None)
            .unwrap();
    }
    close(&t.into_data().to_vec::<f32>().unwrap(), &want);

    // Another shard length, another rule, damaged bytes: errors.
    let mut short = FlatOptim::<B>::new(rule, Place::Device, n - 1);
    assert!(short
        .load_state(&bytes, &Default::default())
        .unwrap_err()
        .to_string()
        .contains("another rank count"));
    let sgd = Rule::Sgd {
        momentum: None,
        penalty: None,
    };
    let mut other = FlatOptim::<B>::new(sgd, Place::Device, n);
    assert!(other.load_state(&bytes, &Default::default()).is_err());
    let mut c = FlatOptim::<B>::new(rule, Place::Device, n);
    assert!(c
        .load_state(&bytes[..bytes.len() - 3], &Default::default())
        .is_err());
    assert!(c.load_state(b"junk", &Default::default()).is_err());
    // A shard of the wrong length is refused, not stepped.
    assert!(c
        .step(1e-2, tensor(&values(3, 1)), tensor(&values(3, 2)), None)
        .is_err());
}

/// 8-bit Adam, Adafactor and Adam-mini are Burn-adaptor only: the flat (ZeRO,
/// offload) path refuses them by name, saying what runs instead.
#[test]
fn per_parameter_optimizers_are_refused_on_the_flat_path() {
    for kind in [
        OptimizerKind::Adam8bit,
        OptimizerKind::Adafactor,
        OptimizerKind::AdamMini,
    ] {
        let mut plan = crate::testing::tiny_plan();
        plan.optimizer.kind = kind;
        plan.resolved.zero = 2;
        let e = Rule::for_plan(&plan).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{} with zero = 2", kind.as_str())) && e.contains("zero = 0"),
            "{e}"
        );
    }
}

/// A gradient accumulated in host memory (`accumulate_host`, over threads,
/// in chunks) steps the host shard exactly as the same sum accumulated on
/// the device and brought down at the step; a device optimizer refuses it.
#[test]
fn host_accumulated_gradient_steps_like_the_device_sum() {
    let n = 300_001;
    let rule = Rule::AdamW {
        beta_1: 0.9,
        beta_2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.1,
    };
    let place = Place::Host { threads: 3 };
    let (mut a, mut b) = (
        FlatOptim::<B>::new(rule, place, n),
        FlatOptim::<B>::new(rule, place, n),
    );
    let (mut pa, mut pb) = (values(n, 1), values(n, 1));
    for step in 0..3 {
        let parts = [values(n, 10 + step), values(n, 20 + step)];
        let mut acc = vec![0.0; n];
        for p in &parts {
            a.accumulate_host(&mut acc, p).unwrap();
        }
        a.step_host_grad(3e-2, &mut pa, &acc).unwrap();
        let sum = tensor(&parts[0]) + tensor(&parts[1]);
        b.step_host_master(3e-2, &mut pb, sum, None).unwrap();
    }
    assert_eq!(pa, pb);
    assert!(a.accumulate_host(&mut [0.0; 2], &[1.0]).is_err());
    let mut d = FlatOptim::<B>::new(rule, Place::Device, 2);
    assert!(d.step_host_grad(1e-3, &mut [0.0; 2], &[1.0; 2]).is_err());
}

/// The loss scale divided out on the host: every value, over the threads,
/// and a non-finite one anywhere is found (`crate::loss_scale`).
#[test]
fn host_unscaling_divides_every_value_and_finds_overflow() {
    let n = 5 * (1 << 16) + 3;
    let v = values(n, 7);
    let mut scaled: Vec<f32> = v.iter().map(|x| x * 1024.0).collect();
    assert!(host::unscale(&mut scaled, 1.0 / 1024.0, 4));
    assert_eq!(scaled, v);
    for at in [0, n / 2, n - 1] {
        let mut w = v.clone();
        w[at] = f32::INFINITY;
        assert!(!host::unscale(&mut w, 0.5, 4), "an infinity at {at}");
        w[at] = f32::NAN;
        assert!(!host::unscale(&mut w, 0.5, 1), "a NaN at {at}");
    }
    let o = FlatOptim::<B>::new(
        Rule::Sgd {
            momentum: None,
            penalty: None,
        },
        Place::Host { threads: 3 },
        n,
    );
    let mut w = scaled.clone();
    assert!(o.unscale_host(&mut w, 2.0).unwrap());
    assert_eq!(w[5], v[5] * 2.0);
    let d = FlatOptim::<B>::new(
        Rule::Sgd {
            momentum: None,
            penalty: None,
        },
        Place::Device,
        n,
    );
    assert!(d.unscale_host(&mut w, 2.0).is_err());
}
