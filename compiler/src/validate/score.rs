//! Scoring: compile each configuration's plan in-process and compare the
//! predicted peak (`memory.peak_bytes`) with the measured one, and the fit
//! verdict with whether the run ran out of memory.

use super::plan::plan_text;
use super::row::MeasuredRun;
use crate::resolve::{resolve, ResolveContext};
use serde::Serialize;

/// What became of one configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "lowercase")]
pub enum Outcome {
    /// It ran: the prediction against the measured peak.
    Scored {
        measured_bytes: u64,
        predicted_bytes: u64,
        /// (predicted − measured) / measured.
        rel_err: f64,
        fits: bool,
        /// Bytes the measuring script held, taken off the row's `peak_train_B` to make
        /// `measured_bytes` ([`MeasuredRun::engine_peak_bytes`]).
        #[serde(skip_serializing_if = "is_zero")]
        harness_bytes: u64,
    },
    /// It ran out of memory: the prediction must say it does not fit.
    Oom { predicted_bytes: u64, fits: bool },
    /// No prediction: the plan did not parse, resolve or compile.
    Failed {
        stage: &'static str,
        message: String,
    },
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RowScore {
    pub name: String,
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// Predicts `run`'s peak from `plan` (its `.plan` text) and scores it.
pub fn score_plan(run: &MeasuredRun, plan: &str) -> RowScore {
    let file = format!("{}.plan", run.name);
    let failed = |stage, message: String| RowScore {
        name: run.name.clone(),
        outcome: Outcome::Failed { stage, message },
    };
    let parsed = match rcoa_grammar::parse(&file, plan) {
        Ok(p) => p,
        Err(e) => return failed("parse", e.to_string()),
    };
    let ctx = ResolveContext::new(file, plan, std::path::PathBuf::new());
    let mut spec = match resolve(&parsed, &ctx) {
        Ok(s) => s,
        Err(errs) => {
            let all: Vec<String> = errs.errors().iter().map(|e| e.to_string()).collect();
            return failed("resolve", all.join("; "));
        }
    };
    measured_settings(run, &mut spec);
    let compiled = match crate::compile(&spec) {
        Ok(c) => c,
        Err(e) => return failed("compile", e.to_string()),
    };
    let p = &compiled.lowered.prediction;
    let outcome = match (run.oom, run.engine_peak_bytes()) {
        (false, Some(measured)) => Outcome::Scored {
            measured_bytes: measured,
            predicted_bytes: p.peak_bytes,
            rel_err: (p.peak_bytes as f64 - measured as f64) / measured as f64,
            fits: p.fits,
            harness_bytes: run.peak_train_bytes.unwrap_or(measured) - measured,
        },
        _ => Outcome::Oom {
            predicted_bytes: p.peak_bytes,
            fits: p.fits,
        },
    };
    RowScore {
        name: run.name.clone(),
        outcome,
    }
}

/// What the measured run set that no plan text says: a DeepSpeed run's ZeRO sizes are its
/// `ds_config`'s, DeepSpeed's defaults where it leaves them out (`tools/measure_multigpu.py`
/// leaves them all), where a `target deepspeed` plan means the `ds_config.json` rcoa writes
/// (its buckets sized from the hidden width).
fn measured_settings(run: &MeasuredRun, spec: &mut crate::spec::Spec) {
    if run.config.engine != super::row::Engine::Deepspeed {
        return;
    }
    let stage = run.config.zero_stage.unwrap_or(0).min(3) as u8;
    let mut zs = crate::profile::engines::deepspeed::ZeroSettings::library_defaults(stage);
    let zero = run
        .deepspeed_config
        .as_ref()
        .and_then(|c| c.get("zero_optimization"));
    // JSON numbers such as 5e8 come as floats.
    let size = |key: &str| zero.and_then(|z| z.get(key)).and_then(|v| v.as_f64());
    if let Some(n) = size("reduce_bucket_size") {
        zs.reduce_bucket = n as u64;
    }
    if let Some(n) = size("stage3_prefetch_bucket_size") {
        zs.prefetch_bucket = n as u64;
    }
    if let Some(n) = size("stage3_param_persistence_threshold") {
        zs.persistence_threshold = n as u64;
    }
    if let Some(b) = zero
        .and_then(|z| z.get("overlap_comm"))
        .and_then(|v| v.as_bool())
    {
        zs.overlap_comm = b;
    }
    spec.deepspeed_zero = Some(zs);
}

/// [`score_plan`] on the plan [`plan_text`] writes for `run`.
pub fn score(run: &MeasuredRun) -> RowScore {
    score_plan(run, &plan_text(&run.config))
}

/// The whole file's verdict. Errors are absolute relative errors (fractions).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Configurations that ran and were scored.
    pub n: usize,
    pub median_abs_err: Option<f64>,
    pub p90_abs_err: Option<f64>,
    pub max_abs_err: Option<f64>,
    pub oom_correct: usize,
    pub oom_total: usize,
    pub fit_correct: usize,
    pub fit_total: usize,
    pub failures: usize,
}

impl Summary {
    pub fn of(rows: &[RowScore]) -> Summary {
        let mut errs = Vec::new();
        let mut s = Summary {
            n: 0,
            median_abs_err: None,
            p90_abs_err: None,
            max_abs_err: None,
            oom_correct: 0,
            oom_total: 0,
            fit_correct: 0,
            fit_total: 0,
            failures: 0,
        };
        for r in rows {
            match &r.outcome {
                Outcome::Scored { rel_err, fits, .. } => {
                    errs.push(rel_err.abs());
                    s.fit_total += 1;
                    s.fit_correct += usize::from(*fits);
                }
                Outcome::Oom { fits, .. } => {
                    s.oom_total += 1;
                    s.oom_correct += usize::from(!fits);
                }
                Outcome::Failed { .. } => s.failures += 1,
            }
        }
        errs.sort_by(f64::total_cmp);
        s.n = errs.len();
        if let Some(&max) = errs.last() {
            s.median_abs_err = Some(median(&errs));
            s.p90_abs_err = Some(errs[p90_index(errs.len())]);
            s.max_abs_err = Some(max);
        }
        s
    }

    /// The one-line verdict, e.g.
    /// `accuracy: n=45 median_abs_err=0.0% p90_abs_err=0.7% max_abs_err=1.7% oom_correct=3/3 fit_correct=45/45 failures=0`.
    pub fn line(&self) -> String {
        match (self.median_abs_err, self.p90_abs_err, self.max_abs_err) {
            (Some(median), Some(p90), Some(max)) => format!(
                "accuracy: n={} median_abs_err={:.1}% p90_abs_err={:.1}% max_abs_err={:.1}% \
                 oom_correct={}/{} fit_correct={}/{} failures={}",
                self.n,
                100.0 * median,
                100.0 * p90,
                100.0 * max,
                self.oom_correct,
                self.oom_total,
                self.fit_correct,
                self.fit_total,
                self.failures
            ),
            _ => format!(
                "accuracy: n=0 oom_correct={}/{} failures={}",
                self.oom_correct, self.oom_total, self.failures
            ),
        }
    }
}

/// The middle value of sorted `xs`, or the mean of the two middle values.
fn median(xs: &[f64]) -> f64 {
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// `min(n-1, round(0.9*(n-1)))` with round-half-to-even, the way the
/// accuracy bar has always been computed.
fn p90_index(n: usize) -> usize {
    let x = 0.9 * (n - 1) as f64;
    (x.round_ties_even() as usize).min(n - 1)
}

/// The row as one human line (GiB, signed error in percent).
pub fn row_line(r: &RowScore) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    match &r.outcome {
        Outcome::Scored {
            measured_bytes,
            predicted_bytes,
            rel_err,
            fits,
            harness_bytes,
        } => format!(
            "{:34} measured {:7.2} GiB predicted {:7.2} GiB err {:+6.1}%{}{}",
            r.name,
            gib(*measured_bytes),
            gib(*predicted_bytes),
            100.0 * rel_err,
            if *fits { "" } else { "  (predicted no fit)" },
            if *harness_bytes > 0 {
                format!(
                    "  (peak_train_B less the script's {:.2} GiB copy of the unsharded model)",
                    gib(*harness_bytes)
                )
            } else {
                String::new()
            }
        ),
        Outcome::Oom {
            predicted_bytes,
            fits,
        } => format!(
            "{:34} measured OOM      predicted {:7.2} GiB fits={fits}  {}",
            r.name,
            gib(*predicted_bytes),
            if *fits { "WRONG (predicted fit)" } else { "ok" }
        ),
        Outcome::Failed { stage, message } => {
            format!("{:34} FAILED at {stage}: {message}", r.name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::row;

    /// The ZeRO sizes the scorer predicts a DeepSpeed row with: its `ds_config`'s, DeepSpeed's
    /// defaults where it leaves them out; none for another engine.
    #[test]
    fn a_deepspeed_row_is_predicted_with_its_own_zero_sizes() {
        use crate::profile::engines::deepspeed::ZeroSettings;
        let settings = |text: &str| {
            let run = row::parse("t.jsonl", text).unwrap().runs.remove(0);
            let plan = plan_text(&run.config);
            let parsed = rcoa_grammar::parse("t.plan", &plan).unwrap();
            let ctx = ResolveContext::new("t.plan", &plan, std::path::PathBuf::new());
            let mut spec = resolve(&parsed, &ctx).unwrap();
            measured_settings(&run, &mut spec);
            spec.deepspeed_zero
        };
        let plain = row::tests_support::deepspeed();
        assert_eq!(settings(&plain), Some(ZeroSettings::library_defaults(2)));
        let given = plain.replacen(
            r#""record": "config","#,
            r#""record": "config", "deepspeed_config": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e6, "overlap_comm": true}},"#,
            1,
        );
        assert_eq!(
            settings(&given),
            Some(ZeroSettings {
                reduce_bucket: 2_000_000,
                overlap_comm: true,
                ..ZeroSettings::library_defaults(2)
            })
        );
        assert_eq!(settings(&row::tests_support::ddp()), None);
    }

    fn scored(name: &str, rel_err: f64, fits: bool) -> RowScore {
        RowScore {
            name: name.into(),
            outcome: Outcome::Scored {
                measured_bytes: 100,
                predicted_bytes: 100,
                rel_err,
                fits,
                harness_bytes: 0,
            },
        }
    }

    #[test]
    fn p90_rounds_half_to_even() {
        // 0.9 * 45 = 40.5 → 40 (Python's round), not 41.
        assert_eq!(p90_index(46), 40);
        assert_eq!(p90_index(45), 40); // 39.6 → 40
        assert_eq!(p90_index(1), 0);
        assert_eq!(p90_index(11), 9);
    }

    #[test]
    fn median_of_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[1.0, 2.0, 3.0, 4.0]), 2.5);
        assert_eq!(median(&[1.0, 2.0, 7.0]), 2.0);
    }

    #[test]
    fn summary_counts_every_kind_of_row() {
        let rows = vec![
            scored("a", -0.02, true),
            scored("b", 0.01, true),
            scored("c", 0.10, false),
            RowScore {
                name: "d".into(),
                outcome: Outcome::Oom {
                    predicted_bytes: 1,
                    fits: false,
                },
            },
            RowScore {
                name: "e".into(),
                outcome: Outcome::Oom {
                    predicted_bytes: 1,
                    fits: true,
                },
            },
            RowScore {
                name: "f".into(),
                outcome: Outcome::Failed {
                    stage: "resolve",
                    message: "x".into(),
                },
            },
        ];
        let s = Summary::of(&rows);
        assert_eq!(
            s.line(),
            "accuracy: n=3 median_abs_err=2.0% p90_abs_err=10.0% max_abs_err=10.0% \
             oom_correct=1/2 fit_correct=2/3 failures=1"
        );
        assert_eq!(
            Summary::of(&rows[5..]).line(),
            "accuracy: n=0 oom_correct=0/0 failures=1"
        );
    }

    #[test]
    fn a_measured_row_compiles_and_scores() {
        let f = row::parse("t.jsonl", row::tests_support::ROW).unwrap();
        let r = score(&f.runs[0]);
        let Outcome::Scored {
            predicted_bytes,
            rel_err,
            fits,
            ..
        } = r.outcome
        else {
            panic!("{r:?}");
        };
        assert!(fits);
        assert!(predicted_bytes > 0);
        assert_eq!(
            rel_err,
            (predicted_bytes as f64 - 1_000_000.0) / 1_000_000.0
        );
        assert!(row_line(&r).starts_with("tiny "), "{}", row_line(&r));
    }

    fn predicted(text: &str) -> u64 {
        let f = row::parse("t.jsonl", text).unwrap();
        match score(&f.runs[0]).outcome {
            Outcome::Scored {
                predicted_bytes, ..
            } => predicted_bytes,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ddp_and_tp_rows_compile_on_the_pytorch_profile() {
        use row::tests_support::{ddp, tp, ROW};
        let single = predicted(ROW);
        // Every DDP rank holds what the single GPU held, and more only for
        // what data parallelism adds.
        assert!(
            predicted(&ddp()) >= single,
            "{} < {single}",
            predicted(&ddp())
        );
        // Two tensor-parallel ranks split the layers: rank 0 holds less.
        assert!(
            predicted(&tp()) < single,
            "{} >= {single}",
            predicted(&tp())
        );
    }

    #[test]
    fn engine_rows_score_or_name_the_profile_they_need() {
        use row::tests_support::{deepspeed, fsdp2};
        for (text, target) in [(fsdp2(), "fsdp"), (deepspeed(), "deepspeed")] {
            let f = row::parse("t.jsonl", &text).unwrap();
            match score(&f.runs[0]).outcome {
                Outcome::Scored { .. } => {}
                Outcome::Failed { stage, message } => {
                    assert_eq!(stage, "resolve", "{message}");
                    assert!(message.contains(target), "{message}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn an_oom_row_too_large_for_the_gpu_is_predicted_not_to_fit() {
        let text = row::tests_support::ROW
            .replace("\"oom\": false", "\"oom\": true")
            .replace("\"batch\": 2", "\"batch\": 4096")
            .replace("\"seq\": 128", "\"seq\": 8192")
            .replace("\"max_pos\": 256", "\"max_pos\": 8192");
        let f = row::parse("t.jsonl", &text).unwrap();
        let r = score(&f.runs[0]);
        assert!(
            matches!(r.outcome, Outcome::Oom { fits: false, .. }),
            "{r:?}"
        );
        assert!(row_line(&r).ends_with(" ok"), "{}", row_line(&r));
    }

    #[test]
    fn a_plan_that_does_not_resolve_is_a_failure_not_a_panic() {
        let mut f = row::parse("t.jsonl", row::tests_support::ROW).unwrap();
        f.runs[0].config.lora = Some(row::Lora {
            r: 8,
            alpha: 16.into(),
            targets: vec!["lm_head".into()],
            dropout: 0.into(),
        });
        let r = score(&f.runs[0]);
        let Outcome::Failed { stage, message } = &r.outcome else {
            panic!("{r:?}");
        };
        assert_eq!(*stage, "resolve", "{message}");
        assert!(row_line(&r).contains("FAILED"));
    }
}
