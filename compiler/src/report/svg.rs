//! The report's charts as inline SVG: a stacked bar against the budget, a
//! stacked memory timeline over one step, and a small line chart for runs.
//!
//! Every chart has a `viewBox` (it scales with the page), a `<title>` and a
//! `<desc>` (screen readers), and a `<title>` on every mark (hover shows the
//! exact bytes). Colour is never the only carrier of meaning: segments and
//! bands carry text labels or sit beside a labelled legend. All text passes
//! through [`escape`]; coordinates are printed with one decimal so the output
//! is deterministic and small.

use super::{bytes_exact, escape, gib};
use crate::memory::{Category, Phase, Sample};
use std::fmt::Write;

/// Width of every chart's coordinate system (the page scales it).
pub const WIDTH: f64 = 1000.0;

/// The colour of a breakdown category (the same in the bar, the timeline and the legend).
/// A restrained palette: blues for weights, oranges for gradients, one red for the
/// optimizer, greens for activations, violet for scratch space.
pub fn colour(key: &str) -> &'static str {
    match key {
        "weights" => "#3d6fa8",
        "weight_copies" => "#93b5dc",
        "grads" => "#e08a2e",
        "optimizer" => "#b8473a",
        "activations" => "#4b9462",
        "activation_grads" => "#a5cfa9",
        "workspace" => "#8a78b0",
        "communication" => "#4f9fa6",
        "measured" => "#55554f",
        _ => "#9a9a9a",
    }
}

/// A category name as people read it.
pub fn label(key: &str) -> String {
    match key {
        "weight_copies" => "weight copies".to_string(),
        "activation_grads" => "activation grads".to_string(),
        other => other.replace('_', " "),
    }
}

/// One slice of a stacked bar.
#[derive(Clone, Debug)]
pub struct Segment {
    /// The category key (colour and legend), e.g. `weights`; `reserved` is drawn hatched.
    pub key: String,
    pub bytes: u64,
}

/// Hatch pattern for the reserve, shared by the charts of one page (ids must be unique per
/// page, so each chart passes its own prefix).
fn hatch_def(id: &str) -> String {
    format!(
        r##"<defs><pattern id="{id}" width="8" height="8" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="8" height="8" fill="#f1f1f1"/><line x1="0" y1="0" x2="0" y2="8" stroke="#9a9a9a" stroke-width="3"/></pattern></defs>"##
    )
}

fn f(x: f64) -> String {
    let v = (x * 10.0).round() / 10.0;
    if v == v.trunc() {
        format!("{}", v as i64)
    } else {
        format!("{v:.1}")
    }
}

/// Tick values (bytes) for an axis from 0 to `max`: about five, at 1/2/5 × 10^k GiB steps.
fn ticks(max: u64) -> Vec<u64> {
    let g = max as f64 / (1u64 << 30) as f64;
    if g <= 0.0 {
        return vec![0];
    }
    let raw = g / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut out = Vec::new();
    let mut v = 0.0;
    while v <= g * 1.0001 {
        out.push((v * (1u64 << 30) as f64).round() as u64);
        v += step;
    }
    out
}

/// A tick label: GiB with as few decimals as the step needs.
fn tick_label(b: u64, step: u64) -> String {
    let g = b as f64 / (1u64 << 30) as f64;
    let s = step as f64 / (1u64 << 30) as f64;
    if s >= 1.0 {
        format!("{g:.0}")
    } else if s >= 0.1 {
        format!("{g:.1}")
    } else if s >= 0.01 {
        format!("{g:.2}")
    } else {
        format!("{g:.3}")
    }
}

/// A horizontal stacked bar: `segments` from the left, then the reserve (hatched), on a
/// scale from 0 to `scale_max` bytes, with a labelled budget line when `budget` is given.
pub fn stacked_bar(
    id: &str,
    caption: &str,
    segments: &[Segment],
    scale_max: u64,
    budget: Option<u64>,
) -> String {
    let (x0, x1) = (20.0, WIDTH - 20.0);
    let (bar_y, bar_h) = (44.0, 56.0);
    let height = 150.0;
    let scale = scale_max.max(1) as f64;
    let x_of = |b: u64| x0 + (x1 - x0) * (b as f64 / scale).min(1.0);
    let total: u64 = segments.iter().map(|s| s.bytes).sum();
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg class="chart bar" id="{id}" viewBox="0 0 {w} {h}" role="img" aria-labelledby="{id}-t {id}-d" xmlns="http://www.w3.org/2000/svg">"#,
        w = f(WIDTH),
        h = f(height)
    );
    let desc: Vec<String> = segments
        .iter()
        .filter(|g| g.bytes > 0)
        .map(|g| format!("{} {}", label(&g.key), gib(g.bytes)))
        .collect();
    let _ = write!(
        s,
        r#"<title id="{id}-t">{}</title><desc id="{id}-d">{}{}</desc>"#,
        escape(caption),
        escape(&desc.join(", ")),
        budget
            .map(|b| format!("; budget {}", gib(b)))
            .unwrap_or_default()
    );
    s.push_str(&hatch_def(&format!("{id}-hatch")));
    // Track: the whole scale, so an almost empty bar still reads as "small".
    let _ = write!(
        s,
        r##"<rect class="track" x="{}" y="{}" width="{}" height="{}" fill="#f4f4f2" stroke="#d8d8d4"/>"##,
        f(x0),
        f(bar_y),
        f(x1 - x0),
        f(bar_h)
    );
    let mut at = 0u64;
    for g in segments.iter().filter(|g| g.bytes > 0) {
        let (a, b) = (x_of(at), x_of(at + g.bytes));
        at += g.bytes;
        let fill = if g.key == "reserved" {
            format!("url(#{id}-hatch)")
        } else {
            colour(&g.key).to_string()
        };
        let share = 100.0 * g.bytes as f64 / total.max(1) as f64;
        let _ = write!(
            s,
            r##"<rect class="seg" data-category="{k}" x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" stroke="#ffffff" stroke-width="1"><title>{t}</title></rect>"##,
            k = escape(&g.key),
            x = f(a),
            y = f(bar_y),
            w = f((b - a).max(0.5)),
            h = f(bar_h),
            t = escape(&format!(
                "{}: {} ({:.1}% of the bar, {})",
                label(&g.key),
                gib(g.bytes),
                share,
                bytes_exact(g.bytes)
            )),
        );
        // A label inside the segment when it fits (the legend always has them all).
        let name = label(&g.key);
        if b - a > 9.0 * name.len() as f64 + 8.0 {
            let dark = matches!(
                g.key.as_str(),
                "weight_copies" | "activation_grads" | "reserved"
            );
            let _ = write!(
                s,
                r#"<text class="seg-label{}" x="{}" y="{}" aria-hidden="true">{}</text>"#,
                if dark { " dark" } else { "" },
                f(a + 6.0),
                f(bar_y + bar_h / 2.0 + 5.0),
                escape(&name)
            );
        }
    }
    // Axis below the bar.
    let tk = ticks(scale_max);
    let step = if tk.len() > 1 {
        tk[1]
    } else {
        scale_max.max(1)
    };
    for t in &tk {
        let x = x_of(*t);
        let _ = write!(
            s,
            r##"<line x1="{x}" y1="{y1}" x2="{x}" y2="{y2}" stroke="#b0b0ab"/><text class="tick" x="{x}" y="{ty}" text-anchor="middle">{l}</text>"##,
            x = f(x),
            y1 = f(bar_y + bar_h),
            y2 = f(bar_y + bar_h + 6.0),
            ty = f(bar_y + bar_h + 22.0),
            l = tick_label(*t, step)
        );
    }
    let _ = write!(
        s,
        r#"<text class="axis-unit" x="{}" y="{}" text-anchor="end">GiB</text>"#,
        f(x1),
        f(bar_y + bar_h + 40.0)
    );
    if let Some(b) = budget {
        let x = x_of(b);
        let anchor = if x > x1 - 150.0 { "end" } else { "middle" };
        let _ = write!(
            s,
            r##"<g class="budget"><line class="budget-line" x1="{x}" y1="{y1}" x2="{x}" y2="{y2}" stroke="#1d1d1b" stroke-width="2.5" stroke-dasharray="6 3"><title>budget: {t}</title></line><text class="budget-label" x="{x}" y="{ty}" text-anchor="{anchor}">budget {g}</text></g>"##,
            x = f(x),
            y1 = f(bar_y - 12.0),
            y2 = f(bar_y + bar_h + 8.0),
            ty = f(bar_y - 18.0),
            g = gib(b),
            t = escape(&format!("{} ({})", gib(b), bytes_exact(b))),
        );
    }
    s.push_str("</svg>");
    s
}

/// One shaded stretch of the timeline.
#[derive(Clone, Debug, PartialEq)]
struct Band {
    phase: Phase,
    start: usize,
    end: usize,
    /// 0 for the first micro-batch, 1 for the later ones (gradient accumulation).
    micro: usize,
}

/// Cut the samples into phase bands. The backward recomputes checkpointed layers, whose
/// samples say `forward`; those runs lie inside one layer (every sample has a layer), while
/// a micro-batch's own forward always includes layer-less ops (`forward end`), so
/// recomputation stays inside its backward band.
fn bands(samples: &[Sample]) -> Vec<Band> {
    let mut runs: Vec<(Phase, usize, usize)> = Vec::new();
    for (i, s) in samples.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if r.0 == s.phase => r.2 = i + 1,
            _ => runs.push((s.phase, i, i + 1)),
        }
    }
    let mut out: Vec<Band> = Vec::new();
    for (k, &(phase, a, b)) in runs.iter().enumerate() {
        let recompute = phase == Phase::Forward
            && samples[a..b].iter().all(|s| s.layer.is_some())
            && k > 0
            && runs[k - 1].0 == Phase::Backward
            && runs.get(k + 1).is_some_and(|r| r.0 == Phase::Backward);
        match out.last_mut() {
            Some(last) if recompute || last.phase == phase => last.end = b,
            _ => {
                let micro = if phase == Phase::Optimizer {
                    0
                } else {
                    out.iter()
                        .filter(|x| x.phase == Phase::Forward)
                        .count()
                        .saturating_sub(if phase == Phase::Forward { 0 } else { 1 })
                        .min(1)
                };
                out.push(Band {
                    phase,
                    start: a,
                    end: b,
                    micro,
                })
            }
        }
    }
    out
}

/// How many micro-batches the timeline shows (forward bands).
pub fn micro_batches_shown(samples: &[Sample]) -> usize {
    bands(samples)
        .iter()
        .filter(|b| b.phase == Phase::Forward)
        .count()
}

/// Samples that recompute a checkpointed layer (forward samples inside a backward band).
fn recomputed(samples: &[Sample], bands: &[Band]) -> Vec<usize> {
    let mut out = Vec::new();
    for b in bands.iter().filter(|b| b.phase == Phase::Backward) {
        out.extend(
            (b.start..b.end).filter(|&i| samples.get(i).is_some_and(|x| x.phase == Phase::Forward)),
        );
    }
    out
}

/// The timeline's layers, bottom to top: the categories with bytes somewhere, then what a
/// sample's total holds beyond its categories (bytes added per rank after the walk, such
/// as communication buffers) under `residual_name`. When a total is below the sum of its
/// categories (weights offloaded after the walk), the difference comes off the weights,
/// so the stack always tops out at the sample's total.
pub fn stack(samples: &[Sample], residual_name: &str) -> Vec<(String, Vec<u64>)> {
    let mut layers: Vec<(String, Vec<u64>)> = Category::ALL
        .iter()
        .map(|c| {
            let i = *c as usize;
            (
                c.as_str().to_string(),
                samples.iter().map(|x| x.by_category[i]).collect(),
            )
        })
        .collect();
    let mut extra = vec![0u64; samples.len()];
    for (j, x) in samples.iter().enumerate() {
        let sum: u64 = x.by_category.iter().sum();
        if x.bytes >= sum {
            extra[j] = x.bytes - sum;
        } else {
            let mut over = sum - x.bytes;
            for layer in layers.iter_mut() {
                let take = over.min(layer.1[j]);
                layer.1[j] -= take;
                over -= take;
                if over == 0 {
                    break;
                }
            }
        }
    }
    layers.push((residual_name.to_string(), extra));
    layers.retain(|(_, v)| v.iter().any(|b| *b > 0));
    layers
}

/// What the timeline needs besides the samples.
pub struct TimelineInput<'a> {
    pub samples: &'a [Sample],
    pub peak_bytes: u64,
    /// The peak's place, as people read it (`backward · layer 3 · attention`).
    pub peak_text: &'a str,
    /// The peak sample's identity, to place the marker on the right op.
    pub peak_phase: Phase,
    pub peak_op: &'a str,
    pub peak_layer: Option<u64>,
    pub budget_bytes: u64,
    pub reserve_bytes: u64,
    /// What to call bytes in a sample's total beyond its categories (see [`stack`]).
    pub residual_name: &'a str,
}

/// The live bytes over one step as stacked areas per category, phases shaded and
/// labelled, the peak marked and labelled, the budget and the reserve drawn when they are
/// on the scale (and named above the chart when far above it).
pub fn timeline(id: &str, t: &TimelineInput) -> String {
    let samples = t.samples;
    let (x0, x1, y0, y1) = (64.0, WIDTH - 16.0, 46.0, 330.0);
    let height = 372.0;
    let top_sample = samples.iter().map(|s| s.bytes).max().unwrap_or(0);
    let peak = t.peak_bytes.max(top_sample);
    let limit = t.budget_bytes;
    // Draw the budget when it is close enough to read the peak against it; otherwise zoom
    // on the step and name the budget in words (a sliver under a far line says nothing).
    let budget_on_scale = limit > 0 && (limit as f64) <= peak as f64 * 1.6;
    let y_max = if budget_on_scale {
        (limit.max(peak + t.reserve_bytes) as f64 * 1.04) as u64
    } else {
        (peak as f64 * 1.18) as u64
    }
    .max(1);
    let y_of = |b: u64| y1 - (y1 - y0) * (b as f64 / y_max as f64).min(1.0);
    // x: every op gets the same width; the optimizer (one sample) gets a readable stretch.
    let n = samples.len().max(1);
    let weights: Vec<f64> = samples
        .iter()
        .map(|s| {
            if s.phase == Phase::Optimizer {
                (n as f64 * 0.07).max(1.0)
            } else {
                1.0
            }
        })
        .collect();
    let total_w: f64 = weights.iter().sum::<f64>().max(1.0);
    let mut xs = Vec::with_capacity(n + 1);
    let mut acc = 0.0;
    xs.push(x0);
    for w in &weights {
        acc += w;
        xs.push(x0 + (x1 - x0) * acc / total_w);
    }
    let bands = bands(samples);
    let mut below = vec![0u64; samples.len()];
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg class="chart timeline" id="{id}" viewBox="0 0 {w} {h}" role="img" aria-labelledby="{id}-t {id}-d" xmlns="http://www.w3.org/2000/svg">"#,
        w = f(WIDTH),
        h = f(height)
    );
    let _ = write!(
        s,
        r#"<title id="{id}-t">Live memory per GPU over one training step</title><desc id="{id}-d">{}</desc>"#,
        escape(&format!(
            "{} operations in execution order; peak {} at {}; budget {}",
            samples.len(),
            gib(t.peak_bytes),
            t.peak_text,
            gib(t.budget_bytes)
        ))
    );
    s.push_str(&hatch_def(&format!("{id}-hatch")));
    // Phase bands and their labels.
    let micro_steps = bands.iter().filter(|b| b.phase == Phase::Forward).count();
    for b in &bands {
        let (a, e) = (xs[b.start], xs[b.end]);
        let (fill, name) = match b.phase {
            Phase::Setup => ("#f2f2f2", "setup"),
            Phase::Forward => ("#eef3f9", "forward"),
            Phase::Backward => ("#f7f1e8", "backward"),
            Phase::Optimizer => ("#f3eef6", "optimizer"),
        };
        let full = if micro_steps > 1 && matches!(b.phase, Phase::Forward | Phase::Backward) {
            format!(
                "{name} ({})",
                if b.micro == 0 {
                    "1st micro-batch"
                } else {
                    "later micro-batches"
                }
            )
        } else {
            name.to_string()
        };
        let _ = write!(
            s,
            r#"<rect class="band" data-phase="{p}" x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}"><title>{t}</title></rect>"#,
            p = name,
            x = f(a),
            y = f(y0 - 26.0),
            w = f(e - a),
            h = f(y1 - y0 + 26.0),
            t = escape(&format!("{full}: {} operations", b.end - b.start)),
        );
        let room = e - a;
        // About 7.5 units per character at the label's size.
        let text = if room > 7.5 * full.len() as f64 + 12.0 {
            full
        } else if room > 7.5 * name.len() as f64 + 12.0 {
            name.to_string()
        } else if room > 28.0 {
            name[..3].to_string()
        } else {
            String::new()
        };
        if !text.is_empty() {
            let _ = write!(
                s,
                r#"<text class="band-label" x="{}" y="{}">{}</text>"#,
                f(a + 6.0),
                f(y0 - 10.0),
                escape(&text)
            );
        }
    }
    // Horizontal grid and y axis.
    let tk = ticks(y_max);
    let step = if tk.len() > 1 { tk[1] } else { y_max };
    for v in &tk {
        let y = y_of(*v);
        let _ = write!(
            s,
            r##"<line class="grid" x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#dcdcd6" stroke-width="1"/><text class="tick" x="{}" y="{}" text-anchor="end">{}</text>"##,
            f(x0),
            f(x1),
            f(x0 - 8.0),
            f(y + 4.0),
            tick_label(*v, step),
            y = f(y),
        );
    }
    let _ = write!(
        s,
        r#"<text class="axis-unit" x="{}" y="{}" text-anchor="end">GiB</text>"#,
        f(x0 - 8.0),
        f(y0 - 30.0)
    );
    // The reserve sits behind the areas: a step that reaches into it stays visible.
    const BEHIND: &str = "\u{0}behind\u{0}";
    let mut back = String::new();
    s.push_str(BEHIND);
    // Stacked areas: one path per category present, bottom to top in breakdown order.
    for (key, values) in stack(samples, t.residual_name) {
        let top: Vec<u64> = below.iter().zip(&values).map(|(b, v)| b + v).collect();
        let mut d = String::new();
        for (i, v) in top.iter().enumerate() {
            let _ = write!(
                d,
                "{}{} {}H{}",
                if i == 0 { "M" } else { "L" },
                f(xs[i]),
                f(y_of(*v)),
                f(xs[i + 1])
            );
        }
        for i in (0..below.len()).rev() {
            let _ = write!(d, "L{} {}H{}", f(xs[i + 1]), f(y_of(below[i])), f(xs[i]));
        }
        d.push('Z');
        let most = values.iter().copied().max().unwrap_or(0);
        let _ = write!(
            s,
            r#"<path class="area" data-category="{k}" d="{d}" fill="{fill}"><title>{t}</title></path>"#,
            k = escape(&key),
            fill = colour(&key),
            t = escape(&format!(
                "{}: up to {} ({})",
                label(&key),
                gib(most),
                bytes_exact(most)
            )),
        );
        below = top;
    }
    // Outline of the total, and one invisible hover target per sample naming its op.
    let mut d = String::new();
    for (i, x) in samples.iter().enumerate() {
        let _ = write!(
            d,
            "{}{} {}H{}",
            if i == 0 { "M" } else { "L" },
            f(xs[i]),
            f(y_of(x.bytes)),
            f(xs[i + 1])
        );
    }
    if !d.is_empty() {
        let _ = write!(
            s,
            r##"<path class="total" d="{d}" fill="none" stroke="#1d1d1b" stroke-width="1.2"/>"##
        );
    }
    // Recomputation (checkpointed layers replayed in the backward): ticks under the axis.
    let rec = recomputed(samples, &bands);
    if !rec.is_empty() {
        s.push_str(r#"<g class="recompute">"#);
        for i in &rec {
            let _ = write!(
                s,
                r##"<rect x="{}" y="{}" width="{}" height="5" fill="#6b6b66"><title>recompute: {}</title></rect>"##,
                f(xs[*i]),
                f(y1 + 2.0),
                f((xs[*i + 1] - xs[*i]).max(0.8)),
                escape(&sample_text(&samples[*i]))
            );
        }
        s.push_str("</g>");
        let _ = write!(
            s,
            r#"<text class="note" x="{}" y="{}">▮ recomputed in the backward (checkpointed layers)</text>"#,
            f(x0),
            f(y1 + 24.0)
        );
    }
    let _ = write!(
        s,
        r#"<text class="note" x="{}" y="{}" text-anchor="end">operations in execution order →</text>"#,
        f(x1),
        f(y1 + 24.0)
    );
    // Budget and reserve.
    if budget_on_scale {
        let yb = y_of(limit);
        let yr = y_of(limit.saturating_sub(t.reserve_bytes));
        if t.reserve_bytes > 0 {
            let _ = write!(
                back,
                r##"<rect class="reserve" x="{}" y="{}" width="{}" height="{}" fill="url(#{id}-hatch)"><title>{}</title></rect>"##,
                f(x0),
                f(yb),
                f(x1 - x0),
                f((yr - yb).max(1.0)),
                escape(&format!(
                    "reserve kept out of the budget: {} ({})",
                    gib(t.reserve_bytes),
                    bytes_exact(t.reserve_bytes)
                ))
            );
            if yr - yb > 14.0 {
                let _ = write!(
                    s,
                    r#"<text class="reserve-label" x="{}" y="{}">reserve {}</text>"#,
                    f(x0 + 6.0),
                    f(yr - 4.0),
                    gib(t.reserve_bytes)
                );
            }
        }
        let _ = write!(
            s,
            r##"<g class="budget"><line class="budget-line" x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#1d1d1b" stroke-width="2" stroke-dasharray="6 3"><title>budget: {}</title></line><text class="budget-label" x="{}" y="{}">budget {}</text></g>"##,
            f(x0),
            f(x1),
            escape(&format!(
                "{} ({})",
                if t.reserve_bytes > 0 && yr - yb <= 14.0 {
                    format!(
                        "{} · reserve {} hatched below",
                        gib(limit),
                        gib(t.reserve_bytes)
                    )
                } else {
                    gib(limit)
                },
                bytes_exact(limit)
            )),
            f(x0 + 6.0),
            f(yb - 6.0),
            gib(limit),
            y = f(yb),
        );
    } else if limit > 0 {
        let _ = write!(
            s,
            r#"<g class="budget"><text class="budget-label off-scale" x="{}" y="{}" text-anchor="end">budget {} is above this scale (the step uses {:.1}% of it)<title>{}</title></text></g>"#,
            f(x1),
            f(y0 - 30.0),
            gib(limit),
            100.0 * (peak + t.reserve_bytes) as f64 / limit as f64,
            escape(&bytes_exact(limit)),
        );
    }
    // The peak: marker on the right sample, labelled with its op and layer.
    let pi = samples
        .iter()
        .position(|x| {
            x.bytes == t.peak_bytes
                && x.phase == t.peak_phase
                && x.op == t.peak_op
                && x.layer == t.peak_layer
        })
        .or_else(|| samples.iter().position(|x| x.bytes == top_sample));
    if let Some(i) = pi {
        let cx = (xs[i] + xs[i + 1]) / 2.0;
        let cy = y_of(samples[i].bytes);
        let right = cx < (x0 + x1) / 2.0;
        let (lx, anchor) = if right {
            (cx + 12.0, "start")
        } else {
            (cx - 12.0, "end")
        };
        let ly = (cy - 4.0).max(y0 + 26.0);
        let _ = write!(
            s,
            r##"<g class="peak"><line x1="{cx}" y1="{cy}" x2="{cx}" y2="{yb}" stroke="#1d1d1b" stroke-width="1" stroke-dasharray="2 2"/><circle cx="{cx}" cy="{cy}" r="5" fill="#ffffff" stroke="#1d1d1b" stroke-width="2"><title>{tt}</title></circle><text class="peak-label" x="{lx}" y="{ly}" text-anchor="{anchor}"><tspan class="peak-value">peak {g}</tspan><tspan x="{lx}" dy="17">{where_}</tspan></text></g>"##,
            cx = f(cx),
            cy = f(cy),
            yb = f(y1),
            lx = f(lx),
            ly = f(ly - 16.0),
            g = gib(t.peak_bytes),
            where_ = escape(t.peak_text),
            tt = escape(&format!(
                "peak {} ({}) at {}",
                gib(t.peak_bytes),
                bytes_exact(t.peak_bytes),
                t.peak_text
            )),
        );
    }
    let _ = write!(
        s,
        r##"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#8a8a85"/>"##,
        f(x0),
        f(y1),
        f(x1),
        f(y1)
    );
    s.push_str("</svg>");
    s.replacen(BEHIND, &back, 1)
}

/// A sample as people read it: `backward · layer 3 · attention`.
pub fn sample_text(x: &Sample) -> String {
    match x.layer {
        Some(l) => format!("{} · layer {} · {}", x.phase.as_str(), l, x.op),
        None => format!("{} · {}", x.phase.as_str(), x.op),
    }
}

/// One series of a line chart.
pub struct Series<'a> {
    pub name: &'a str,
    pub colour: &'a str,
    /// (x, y) points, x increasing.
    pub points: Vec<(f64, f64)>,
    /// Draw dashed (a prediction rather than a measurement).
    pub dashed: bool,
}

/// A small line chart (loss or step time over steps); `unit` formats the y ticks.
pub fn line_chart(id: &str, caption: &str, x_label: &str, series: &[Series], unit: &str) -> String {
    let (x0, x1, y0, y1) = (70.0, WIDTH - 20.0, 30.0, 230.0);
    let height = 276.0;
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg class="chart line" id="{id}" viewBox="0 0 {w} {h}" role="img" aria-labelledby="{id}-t" xmlns="http://www.w3.org/2000/svg"><title id="{id}-t">{c}</title>"#,
        w = f(WIDTH),
        h = f(height),
        c = escape(caption)
    );
    if all.is_empty() {
        let _ = write!(
            s,
            r#"<text class="note" x="{}" y="{}">no data</text></svg>"#,
            f(x0),
            f((y0 + y1) / 2.0)
        );
        return s;
    }
    let xmin = all.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
    let xmax = all.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
    let ymax_raw = all.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let ymin_raw = all.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let ymin = if ymin_raw >= 0.0 { 0.0 } else { ymin_raw * 1.1 };
    // Round steps (1, 2 or 5 × 10^k), four or five of them.
    let span = if ymax_raw > ymin {
        ymax_raw - ymin
    } else {
        1.0
    };
    let raw = span / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|st| *st >= raw)
        .unwrap_or(10.0 * mag);
    let n_ticks = (span / step).ceil().max(1.0) as usize;
    let ymax = ymin + step * n_ticks as f64;
    let xs = |x: f64| {
        if xmax > xmin {
            x0 + (x1 - x0) * (x - xmin) / (xmax - xmin)
        } else {
            (x0 + x1) / 2.0
        }
    };
    let ys = |y: f64| y1 - (y1 - y0) * (y - ymin) / (ymax - ymin);
    for k in 0..=n_ticks {
        let v = ymin + step * k as f64;
        let y = ys(v);
        let _ = write!(
            s,
            r##"<line class="grid" x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#dcdcd6"/><text class="tick" x="{}" y="{}" text-anchor="end">{}</text>"##,
            f(x0),
            f(x1),
            f(x0 - 8.0),
            f(y + 4.0),
            escape(&fmt_num(v, unit)),
            y = f(y),
        );
    }
    let _ = write!(
        s,
        r#"<text class="tick" x="{}" y="{}" text-anchor="start">{}</text><text class="tick" x="{}" y="{}" text-anchor="end">{}</text><text class="note" x="{}" y="{}" text-anchor="middle">{}</text>"#,
        f(x0),
        f(y1 + 18.0),
        fmt_num(xmin, ""),
        f(x1),
        f(y1 + 18.0),
        fmt_num(xmax, ""),
        f((x0 + x1) / 2.0),
        f(y1 + 36.0),
        escape(x_label)
    );
    let mut legend_x = x0;
    for se in series {
        let pts: Vec<&(f64, f64)> = se
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        let mut d = String::new();
        for (i, (x, y)) in pts.iter().enumerate() {
            let _ = write!(
                d,
                "{}{} {}",
                if i == 0 { "M" } else { "L" },
                f(xs(*x)),
                f(ys(*y))
            );
        }
        if pts.len() == 1 {
            let _ = write!(d, "h1");
        }
        let _ = write!(
            s,
            r#"<path class="series" d="{d}" fill="none" stroke="{c}" stroke-width="2"{dash}><title>{n}</title></path>"#,
            c = se.colour,
            dash = if se.dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            },
            n = escape(se.name)
        );
        if !se.dashed && pts.len() <= 200 {
            for (x, y) in &pts {
                let _ = write!(
                    s,
                    r#"<circle cx="{}" cy="{}" r="2.5" fill="{}"><title>{}: step {} = {}</title></circle>"#,
                    f(xs(*x)),
                    f(ys(*y)),
                    se.colour,
                    escape(se.name),
                    fmt_num(*x, ""),
                    escape(&fmt_num(*y, unit))
                );
            }
        }
        let _ = write!(
            s,
            r#"<line x1="{}" y1="14" x2="{}" y2="14" stroke="{}" stroke-width="2"{}/><text class="legend" x="{}" y="18">{}</text>"#,
            f(legend_x),
            f(legend_x + 22.0),
            se.colour,
            if se.dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            },
            f(legend_x + 28.0),
            escape(se.name)
        );
        legend_x += 40.0 + 8.0 * se.name.chars().count() as f64;
    }
    s.push_str("</svg>");
    s
}

/// A number for an axis: integers plainly, small values with enough decimals.
fn fmt_num(v: f64, unit: &str) -> String {
    let a = v.abs();
    let n = if a == 0.0 || (a >= 100.0) || (v == v.trunc() && a < 1e6) {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    };
    if unit.is_empty() {
        n
    } else {
        format!("{n} {unit}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(phase: Phase, op: &str, layer: Option<u64>, bytes: u64) -> Sample {
        let mut by = [0; Category::COUNT];
        by[0] = bytes;
        Sample {
            phase,
            op: op.into(),
            layer,
            bytes,
            by_category: by,
        }
    }

    #[test]
    fn recomputation_stays_inside_the_backward_band() {
        let s = vec![
            sample(Phase::Forward, "embedding", None, 1),
            sample(Phase::Forward, "mlp", Some(0), 2),
            sample(Phase::Forward, "forward end", None, 2),
            sample(Phase::Backward, "head", None, 3),
            sample(Phase::Forward, "attention", Some(0), 4),
            sample(Phase::Backward, "attention", Some(0), 5),
            sample(Phase::Backward, "backward end", None, 1),
            sample(Phase::Forward, "embedding", None, 1),
            sample(Phase::Forward, "forward end", None, 1),
            sample(Phase::Backward, "backward end", None, 1),
            sample(Phase::Optimizer, "adamw", None, 2),
        ];
        let b = bands(&s);
        let kinds: Vec<(Phase, usize, usize, usize)> = b
            .iter()
            .map(|b| (b.phase, b.start, b.end, b.micro))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (Phase::Forward, 0, 3, 0),
                (Phase::Backward, 3, 7, 0),
                (Phase::Forward, 7, 9, 1),
                (Phase::Backward, 9, 10, 1),
                (Phase::Optimizer, 10, 11, 0),
            ]
        );
        assert_eq!(recomputed(&s, &b), vec![4]);
    }

    #[test]
    fn the_stack_always_tops_out_at_the_sample_total() {
        let mut a = sample(Phase::Forward, "x", None, 10);
        a.by_category[Category::Activations as usize] = 5;
        a.bytes = 18; // 3 bytes added after the walk (communication)
        let mut b = sample(Phase::Forward, "y", None, 10);
        b.bytes = 7; // 3 bytes of weights offloaded after the walk
        let layers = stack(&[a, b], "communication");
        let names: Vec<&str> = layers.iter().map(|l| l.0.as_str()).collect();
        assert_eq!(names, ["weights", "activations", "communication"]);
        for j in 0..2 {
            let total: u64 = layers.iter().map(|l| l.1[j]).sum();
            assert_eq!(total, [18, 7][j]);
        }
        assert_eq!(layers[0].1, vec![10, 7]);
    }

    #[test]
    fn ticks_cover_the_scale_in_round_steps() {
        let g = 1u64 << 30;
        assert_eq!(
            ticks(10 * g),
            (0..=5).map(|k| 2 * k * g).collect::<Vec<_>>()
        );
        let t = ticks(g / 10);
        assert!(t.len() >= 4 && t.len() <= 11, "{t:?}");
        assert_eq!(ticks(0), vec![0]);
    }

    #[test]
    fn empty_inputs_draw_without_panicking() {
        let svg = timeline(
            "t",
            &TimelineInput {
                samples: &[],
                peak_bytes: 0,
                peak_text: "",
                peak_phase: Phase::Forward,
                peak_op: "",
                peak_layer: None,
                budget_bytes: 0,
                reserve_bytes: 0,
                residual_name: "other",
            },
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        let bar = stacked_bar("b", "x", &[], 0, None);
        assert!(bar.ends_with("</svg>"));
        let line = line_chart("l", "x", "step", &[], "s");
        assert!(line.contains("no data"));
    }
}
