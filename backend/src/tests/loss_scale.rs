//! fp16's dynamic loss scaling (`crate::loss_scale`) through every optimizer
//! path of the step, on the CPU in fp32: a power-of-two scale is exact
//! there, so a scaled step must equal an unscaled one bit for bit, and an
//! overflowing one must leave the weights and the optimizer state as they
//! were. (fp16 itself runs only on CUDA.)

use super::{rank_trainer, serial, trainer, two_rank_reference, Cpu, Off};
use crate::loss_scale::LossScaler;
use crate::memory::RssProbe;
use crate::testing::tiny_plan;
use crate::train::{StepReport, Trainer};
use crate::RunError;
use rcoa_compiler::lowered::LoweredPlan;

/// Past fp32's largest value once it multiplies a loss of ~4: every
/// gradient of the step is infinite or NaN.
const OVERFLOWING: f64 = 1.7e38 * 4.0;

/// `body` on one rank of `plan` (`data` = 1) or on each of two thread ranks;
/// what each returned, in rank order.
fn on_ranks<R: Send + 'static>(
    plan: &LoweredPlan,
    body: impl Fn(&mut Trainer<Cpu>) -> Result<R, RunError> + Send + Sync + 'static,
) -> Vec<R> {
    if plan.resolved.data == 1 {
        let mut t = trainer(plan);
        return vec![body(&mut t).unwrap()];
    }
    let body = std::sync::Arc::new(body);
    let built = std::sync::Arc::new(std::sync::Barrier::new(2));
    let ranks: Vec<_> = (0..2u32)
        .map(|local| {
            let (plan, body, built) = (plan.clone(), body.clone(), built.clone());
            std::thread::spawn(move || {
                let (mut t, progress) = rank_trainer(&plan, local, 4)?;
                built.wait();
                let r = body(&mut t);
                if r.is_ok() {
                    progress.set_done();
                }
                r
            })
        })
        .collect();
    ranks
        .into_iter()
        .map(|r| r.join().unwrap().unwrap())
        .collect()
}

fn steps(t: &mut Trainer<Cpu>, n: usize) -> Result<Vec<StepReport>, RunError> {
    (0..n).map(|_| t.train_step(&mut RssProbe::new())).collect()
}

/// One rank with accumulation, and two ranks under ZeRO 0 (the all-reduce),
/// 2 (the reduce-scatter, whose flags ride the loss's all-reduce) and 3,
/// with the optimizer and gradients on the host or not.
fn configs() -> Vec<(String, LoweredPlan)> {
    let one = two_rank_reference(tiny_plan());
    let mut out = vec![("one rank".to_string(), one.clone())];
    for (zero, off) in [
        (0, Off::None),
        (2, Off::None),
        (2, Off::Optimizer),
        (3, Off::None),
        (3, Off::Both),
        (0, Off::Both),
    ] {
        let mut plan = one.clone();
        plan.resolved.micro_batch = 2;
        plan.resolved.data = 2;
        plan.resolved.zero = zero;
        plan.resolved.offload = off.list();
        out.push((format!("zero {zero}, offload {off:?}"), plan));
    }
    out
}

#[test]
fn a_scaled_step_equals_an_unscaled_one_on_every_path() {
    let _g = serial();
    for (what, plan) in configs() {
        let plain = on_ranks(&plan, |t| {
            steps(t, 3)?;
            t.flat_weights()
        });
        let scaled = on_ranks(&plan, |t| {
            // Grows after two steps: the third runs at 2,048.
            t.set_loss_scaler(Some(LossScaler::new(1024.0, 2)));
            let r = steps(t, 3)?;
            Ok((r, t.flat_weights()?))
        });
        for ((reports, w), want) in scaled.iter().zip(&plain) {
            let scales: Vec<_> = reports.iter().map(|r| r.loss_scale).collect();
            assert_eq!(scales, [Some(1024.0), Some(1024.0), Some(2048.0)], "{what}");
            assert!(reports.iter().all(|r| r.skipped.is_none()), "{what}");
            assert_eq!(w, want, "{what}: scaled weights differ");
        }
    }
}

#[test]
fn an_overflowing_step_is_skipped_on_every_rank_and_changes_nothing() {
    let _g = serial();
    for (what, plan) in configs() {
        // A step at step index 1 from the initial state...
        let fresh = on_ranks(&plan, |t| {
            let before = t.flat_weights()?;
            t.step = 1;
            steps(t, 1)?;
            Ok((before, t.flat_weights()?))
        });
        // ... equals the same step after a skipped one: the weights, the
        // optimizer's state and its step count are untouched by the skip.
        let skipped = on_ranks(&plan, |t| {
            let before = t.flat_weights()?;
            t.set_loss_scaler(Some(LossScaler::new(OVERFLOWING, 2000)));
            let r = steps(t, 1)?.remove(0);
            let scale = t.loss_scaler().map(|s| s.scale());
            let after_skip = t.flat_weights()?;
            t.set_loss_scaler(None);
            steps(t, 1)?;
            Ok((before, r, scale, after_skip, t.flat_weights()?))
        });
        for ((before, r, scale, after_skip, after), (fresh_before, want)) in
            skipped.iter().zip(&fresh)
        {
            assert_eq!(before, fresh_before, "{what}: same start");
            assert!(r.loss.is_finite(), "{what}: the loss itself is finite");
            assert_eq!(r.loss_scale, Some(OVERFLOWING), "{what}");
            assert_eq!(r.skipped, Some(OVERFLOWING / 2.0), "{what}");
            assert_eq!(*scale, Some(OVERFLOWING / 2.0), "{what}");
            assert_eq!(after_skip, before, "{what}: the skip changed the weights");
            assert_eq!(r.step, 1, "{what}: the skipped step counts");
            assert_eq!(after, want, "{what}: the skip changed the optimizer");
            assert_ne!(after, before, "{what}: the next step trained");
        }
    }
}

#[test]
fn the_loss_scale_is_saved_and_resumed() {
    let _g = serial();
    let plan = tiny_plan();
    let dir = std::env::temp_dir().join(format!("rcoa-loss-scale-{}", std::process::id()));
    let mut t = trainer(&plan);
    t.set_loss_scaler(Some(LossScaler::new(512.0, 3)));
    steps(&mut t, 2).unwrap();
    t.save(&dir).unwrap();
    let mut back = trainer(&plan);
    back.set_loss_scaler(Some(LossScaler::new(512.0, 3)));
    back.resume(&dir).unwrap();
    assert_eq!(back.loss_scaler(), t.loss_scaler());
    // One more good step grows both alike.
    let a = steps(&mut t, 1).unwrap().remove(0);
    let b = steps(&mut back, 1).unwrap().remove(0);
    assert_eq!(back.loss_scaler().unwrap().scale(), 1024.0);
    assert!(
        (a.loss - b.loss).abs() <= 1e-5 * a.loss.abs(),
        "{} vs {}",
        a.loss,
        b.loss
    );
    let state = std::fs::read_to_string(dir.join("state.json")).unwrap();
    assert!(state.contains("\"loss_scale\""), "{state}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A sharded step's ranks hold different gradients: one rank's overflow must
/// stop every rank's step, or their weights part. The flags ride the loss's
/// all-reduce (`shard::mean_loss_and_flag`).
#[test]
fn one_ranks_overflow_reaches_every_rank() {
    use burn::tensor::{ElementConversion, Tensor};
    let _g = serial();
    let ranks: Vec<_> = (0..2u32)
        .map(|local| {
            std::thread::spawn(move || {
                let d = crate::testing::thread_rank(local, 60);
                let device = Default::default();
                let c = crate::distributed::Collective::<burn::backend::NdArray<f32>>::register(
                    &d, &device,
                )?;
                let progress = c.progress();
                let loss = Tensor::from_data([1.0 + local as f32], &device);
                let flag = if local == 0 { f32::NAN } else { 0.0 };
                let flag = Tensor::from_data([flag], &device);
                let (loss, flag) = crate::shard::mean_loss_and_flag(&c, loss, Some(flag))?;
                let finite = crate::loss_scale::flag_finite(flag.expect("a flag"));
                let none = crate::shard::mean_loss_and_flag(&c, loss.clone(), None)?.1;
                progress.set_done();
                Ok::<_, RunError>((loss.into_scalar().elem::<f64>(), finite, none.is_none()))
            })
        })
        .collect();
    for r in ranks {
        let (loss, finite, none) = r.join().unwrap().unwrap();
        assert_eq!(loss, 1.5, "the mean loss");
        assert!(!finite, "rank 0's overflow reached this rank");
        assert!(none);
    }
}
