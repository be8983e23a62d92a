//! What a sweep leaves behind: `results.csv`, the ranked table, `best.toml` (the best
//! trial's resolved config, ready to run) and `metric.png` (the metric against each
//! swept key).

use std::cmp::Ordering;
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use super::runner::Outcome;
use super::spec::{Goal, SweepSpec, Trial};

/// Trial indices, best first; trials without a metric last, in trial order.
pub fn ranking(outcomes: &[Outcome], goal: Goal) -> Vec<usize> {
    let mut order: Vec<usize> = (0..outcomes.len()).collect();
    let key = |i: usize| outcomes[i].metric.filter(|m| m.is_finite());
    order.sort_by(|&a, &b| match (key(a), key(b)) {
        (Some(x), Some(y)) => {
            let c = x.total_cmp(&y);
            let c = if goal == Goal::Max { c.reverse() } else { c };
            c.then(a.cmp(&b))
        }
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => a.cmp(&b),
    });
    order
}

/// The best trial: of those that finished (an interrupted or failed trial's metric is
/// that of a part of its run), the first of the ranking.
pub fn best(outcomes: &[Outcome], goal: Goal) -> Option<usize> {
    ranking(outcomes, goal)
        .into_iter()
        .find(|&i| outcomes[i].status == "finished" && outcomes[i].metric.is_some())
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// `results.csv`: one row per trial, in trial order.
pub fn write_csv(
    path: &Path,
    spec: &SweepSpec,
    trials: &[Trial],
    outcomes: &[Outcome],
) -> std::io::Result<()> {
    let keys: Vec<&String> = trials
        .first()
        .map(|t| t.values.iter().map(|(k, _)| k).collect())
        .unwrap_or_default();
    let mut out = String::new();
    let _ = write!(out, "trial,status,exit_code,{}", spec.metric.key());
    for k in &keys {
        let _ = write!(out, ",{}", csv_field(k));
    }
    out.push_str(",slot,wall_s,run_dir,log_tail\n");
    for (t, o) in trials.iter().zip(outcomes) {
        let _ = write!(
            out,
            "{},{},{},{}",
            t.index,
            o.status,
            o.exit_code.map_or(String::new(), |c| c.to_string()),
            o.metric.map_or(String::new(), |m| m.to_string())
        );
        for (_, v) in &t.values {
            let _ = write!(out, ",{}", csv_field(v));
        }
        let _ = writeln!(
            out,
            ",{},{:.1},{},{}",
            csv_field(&o.slot),
            o.wall_s,
            csv_field(
                &o.run_dir
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            ),
            // One row per line, for grep and spreadsheets alike.
            csv_field(&o.log_tail.replace('\n', " | "))
        );
    }
    std::fs::write(path, out)
}

/// The ranked table printed at the end.
pub fn table(spec: &SweepSpec, trials: &[Trial], outcomes: &[Outcome]) -> String {
    let mut out = format!(
        "rank  trial  {:<12}  status           settings\n",
        spec.metric.key()
    );
    for (rank, &i) in ranking(outcomes, spec.goal).iter().enumerate() {
        let o = &outcomes[i];
        let _ = writeln!(
            out,
            "{:>4}  {:>5}  {:<12}  {:<15}  {}",
            rank + 1,
            i,
            o.metric.map_or("-".into(), |m| format!("{m:.4}")),
            match o.exit_code {
                Some(c) if o.status == "failed" => format!("failed ({c})"),
                _ => o.status.clone(),
            },
            trials[i].label()
        );
    }
    out
}

/// `metric.png`: one panel per swept key; numeric values on a linear axis, or a
/// logarithmic one where they span a factor of 20 or more (learning rates, weight
/// decays), others by position in the order they first appear. Trials without a metric
/// (failed, or not finished) are red crosses along the bottom.
pub fn write_plot(
    path: &Path,
    spec: &SweepSpec,
    trials: &[Trial],
    outcomes: &[Outcome],
) -> Result<(), String> {
    crate::report::register_font();
    let keys: Vec<String> = trials
        .first()
        .map(|t| t.values.iter().map(|(k, _)| k.clone()).collect())
        .unwrap_or_default();
    if keys.is_empty() {
        return Ok(());
    }
    let (w, h) = (420 * keys.len() as u32, 380u32);
    let mut buf = vec![255u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        for (k, area) in keys.iter().zip(root.split_evenly((1, keys.len()))) {
            let raw: Vec<(String, Option<f64>)> = trials
                .iter()
                .zip(outcomes)
                .filter_map(|(t, o)| {
                    let v = t.values.iter().find(|(kk, _)| kk == k)?.1.clone();
                    Some((v, o.metric.filter(|m| m.is_finite())))
                })
                .collect();
            let numbers: Vec<f64> = raw.iter().filter_map(|(v, _)| v.parse().ok()).collect();
            let numeric = numbers.len() == raw.len();
            let log = numeric && log_spaced(&numbers);
            let mut categories: Vec<String> = Vec::new();
            let xs: Vec<f64> = raw
                .iter()
                .map(|(v, _)| {
                    if numeric {
                        let x = v.parse::<f64>().unwrap_or(0.0);
                        if log { x.log10() } else { x }
                    } else {
                        match categories.iter().position(|c| c == v) {
                            Some(p) => p as f64,
                            None => {
                                categories.push(v.clone());
                                (categories.len() - 1) as f64
                            }
                        }
                    }
                })
                .collect();
            let pts: Vec<(f64, f64)> = xs
                .iter()
                .zip(&raw)
                .filter_map(|(&x, (_, m))| Some((x, (*m)?)))
                .collect();
            let failed: Vec<f64> = xs
                .iter()
                .zip(&raw)
                .filter(|(_, (_, m))| m.is_none())
                .map(|(&x, _)| x)
                .collect();
            let span = |it: &mut dyn Iterator<Item = f64>| {
                let (lo, hi) = it.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
                    (a.min(x), b.max(x))
                });
                if lo.is_finite() {
                    let pad = ((hi - lo) * 0.1).max(1e-9);
                    (lo - pad)..(hi + pad)
                } else {
                    0.0..1.0
                }
            };
            let xr = if numeric {
                span(&mut xs.iter().copied())
            } else {
                -0.5..(categories.len().max(1) as f64 - 0.5)
            };
            let yr = span(&mut pts.iter().map(|p| p.1));
            let bottom = yr.start;
            let mut chart = ChartBuilder::on(&area)
                .caption(k, ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(32)
                .y_label_area_size(56)
                .build_cartesian_2d(xr, yr)
                .map_err(|e| e.to_string())?;
            let cats = categories.clone();
            chart
                .configure_mesh()
                .y_desc(spec.metric.key())
                .x_desc(if log { "log scale" } else { "" })
                .x_labels(6)
                .x_label_formatter(&|x| {
                    if log {
                        short_number(10f64.powf(*x))
                    } else if numeric {
                        short_number(*x)
                    } else {
                        let i = x.round();
                        if (x - i).abs() < 1e-6 && i >= 0.0 {
                            cats.get(i as usize)
                                .map(|c| c.trim_matches('"').to_string())
                                .unwrap_or_default()
                        } else {
                            String::new()
                        }
                    }
                })
                .draw()
                .map_err(|e| e.to_string())?;
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 5, BLUE.filled())))
                .map_err(|e| e.to_string())?;
            chart
                .draw_series(
                    failed
                        .iter()
                        .map(|&x| Cross::new((x, bottom), 6, RED.stroke_width(2))),
                )
                .map_err(|e| e.to_string())?
                .label("no metric (failed or unfinished)")
                .legend(|(x, y)| Cross::new((x + 6, y), 5, RED.stroke_width(2)));
            if !failed.is_empty() {
                crate::report::draw_legend(&mut chart)?;
            }
        }
        root.present().map_err(|e| e.to_string())?;
    }
    let img = image::RgbImage::from_raw(w, h, buf).ok_or("plot buffer size")?;
    img.save(path)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Whether positive `values` span a factor of 20 or more: a log axis spreads them.
fn log_spaced(values: &[f64]) -> bool {
    let (lo, hi) = values
        .iter()
        .fold((f64::INFINITY, 0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    values.iter().all(|&v| v > 0.0) && hi / lo >= 20.0
}

/// `x` in few characters: `0.003`, `1e-5`, `250`, `2e6`.
fn short_number(x: f64) -> String {
    let a = x.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{x:.0e}")
    } else {
        let s = format!("{x:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        if s == "-0" { "0".into() } else { s.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(i: usize, m: Option<f64>) -> Outcome {
        Outcome {
            index: i,
            status: if m.is_some() { "finished" } else { "failed" }.into(),
            exit_code: Some(if m.is_some() { 0 } else { 1 }),
            metric: m,
            run_dir: None,
            slot: String::new(),
            wall_s: 0.0,
            log_tail: String::new(),
        }
    }

    #[test]
    fn ranking_puts_the_best_first_and_failures_last() {
        let outs = vec![
            o(0, Some(0.5)),
            o(1, None),
            o(2, Some(0.9)),
            o(3, Some(0.7)),
        ];
        assert_eq!(ranking(&outs, Goal::Max), vec![2, 3, 0, 1]);
        assert_eq!(ranking(&outs, Goal::Min), vec![0, 3, 2, 1]);
    }

    #[test]
    fn an_interrupted_trial_is_never_the_best_whatever_its_partial_metric() {
        let mut outs = vec![o(0, Some(0.5)), o(1, Some(0.9)), o(2, Some(0.7))];
        outs[1].status = "interrupted".into();
        assert_eq!(best(&outs, Goal::Max), Some(2));
        outs[0].status = "interrupted".into();
        outs[2].status = "interrupted".into();
        assert_eq!(best(&outs, Goal::Max), None);
    }

    #[test]
    fn learning_rates_get_a_log_axis_and_short_tick_labels() {
        assert!(log_spaced(&[0.001, 0.01, 0.1]));
        assert!(!log_spaced(&[0.05, 0.1, 0.2]));
        assert!(!log_spaced(&[0.0, 0.01, 1.0]), "zero has no logarithm");
        assert_eq!(short_number(0.003), "0.003");
        assert_eq!(short_number(0.00001), "1e-5");
        assert_eq!(short_number(250.0), "250");
        assert_eq!(short_number(0.1 + 0.2), "0.3");
        assert_eq!(short_number(2e6), "2e6");
        assert_eq!(short_number(-0.00001), "-1e-5");
        assert_eq!(short_number(0.0), "0");
    }
}
