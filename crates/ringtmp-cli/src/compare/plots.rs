//! The report's SVG plots (drawn by the `plotters` crate): curves of quality against training
//! time and samples, and figures against the node count.

use anyhow::Result;
use plotters::prelude::*;

use super::quality::Quality;

use super::render::*;
use super::runs::*;

/// (file name, title, SVG document) of every plot.
#[expect(
    clippy::too_many_lines,
    reason = "one plot after another over the same runs, each a few lines of its own"
)]
pub(super) fn plots(
    finished: &[Finished],
    rows: &[Row],
    quality: &Quality,
    simulated: bool,
) -> Result<Vec<(String, String, String)>> {
    let first: Vec<&Finished> = finished.iter().filter(|f| f.plan.repeat == 0).collect();
    let mut out = Vec::new();
    if simulated {
        // No accuracy, no memory of their own: throughput, bytes, compute and idle only.
        let all = plots(finished, rows, quality, false)?;
        return Ok(all
            .into_iter()
            .filter(|(name, ..)| {
                !name.starts_with("accuracy") && !name.starts_with("loss") && name != "peak_memory"
            })
            .collect());
    }
    let (stem, what) = match quality {
        Quality::Accuracy {
            regression: true, ..
        } => ("accuracy", "Test R²"),
        Quality::Accuracy { .. } => ("accuracy", "Test accuracy"),
        Quality::Loss { .. } => ("loss", "Validation loss"),
    };
    let unit = quality.unit();
    out.push((
        format!("{stem}_vs_time"),
        format!("{what} against training time"),
        lines(
            Axis::Auto("training time (s)"),
            quality.axis(),
            &first
                .iter()
                .map(|f| {
                    (
                        f.label(),
                        f.curve
                            .iter()
                            .map(|p| (p.0, quality.plotted(p.2)))
                            .collect(),
                    )
                })
                .collect::<Vec<_>>(),
        )?,
    ));
    let units = format!("{unit}s");
    out.push((
        format!("{stem}_vs_{unit}s"),
        format!("{what} against {unit}s trained on"),
        lines(
            Axis::Linear(&units),
            quality.axis(),
            &first
                .iter()
                .map(|f| {
                    (
                        f.label(),
                        f.curve
                            .iter()
                            .map(|p| (p.1 * quality.per_sample(), quality.plotted(p.2)))
                            .collect(),
                    )
                })
                .collect::<Vec<_>>(),
        )?,
    ));
    let labels: Vec<String> = rows.iter().map(|r| r.label.clone()).collect();
    let median = |v: Option<(f64, f64, f64)>| v.map_or(0.0, |v| v.0);
    let per_second = format!("{unit}s/s");
    out.push((
        format!("{unit}s_per_second"),
        format!("{}s per second", capitalised(unit)),
        bars(
            &per_second,
            &labels,
            &[(
                per_second.as_str(),
                rows.iter().map(|r| median(r.samples_per_second)).collect(),
            )],
        )?,
    ));
    out.push((
        format!("bytes_per_{unit}"),
        format!("Bytes sent per {unit}: the whole cluster, and its busiest node"),
        bars(
            &format!("bytes per {unit}"),
            &labels,
            &[
                (
                    "cluster",
                    rows.iter().map(|r| median(r.bytes_per_sample)).collect(),
                ),
                (
                    "busiest node",
                    rows.iter()
                        .map(|r| median(r.busiest_bytes_per_sample))
                        .collect(),
                ),
            ],
        )?,
    ));
    // Per node: each configuration's first repeat.
    let most = first
        .iter()
        .map(|f| f.summary.per_node.len())
        .max()
        .unwrap_or(0);
    let per_node = |f: &dyn Fn(&ringtmp_metrics::NodeSummary) -> f64| -> Vec<(String, Vec<f64>)> {
        (0..most)
            .map(|k| {
                (
                    format!("node {k}"),
                    first
                        .iter()
                        .map(|r| r.summary.per_node.get(k).map_or(0.0, f))
                        .collect(),
                )
            })
            .collect()
    };
    let first_labels: Vec<String> = first.iter().map(|f| f.label()).collect();
    let memory = per_node(&|n| n.peak_rss_bytes as f64 / 1e6);
    out.push((
        "peak_memory".into(),
        "Peak memory (RSS) of every node".into(),
        bars(
            "MB",
            &first_labels,
            &memory
                .iter()
                .map(|(l, v)| (l.as_str(), v.clone()))
                .collect::<Vec<_>>(),
        )?,
    ));
    let sums = |f: &dyn Fn(&ringtmp_metrics::NodeSummary) -> f64| -> Vec<f64> {
        first
            .iter()
            .map(|r| {
                let n = r.summary.per_node.len().max(1) as f64;
                r.summary.per_node.iter().map(f).sum::<f64>() / n
            })
            .collect()
    };
    out.push((
        "compute_idle".into(),
        "Compute and idle time, mean per node".into(),
        bars(
            "seconds",
            &first_labels,
            &[
                ("compute", sums(&|n| n.compute_seconds)),
                ("idle", sums(&|n| n.idle_seconds)),
            ],
        )?,
    ));
    let counts: std::collections::BTreeSet<u32> = rows.iter().map(|r| r.nodes).collect();
    if counts.len() > 1 {
        out.push((
            "scaling".into(),
            format!("{}s per second against nodes", capitalised(unit)),
            lines(
                Axis::Linear("nodes"),
                &per_second,
                &against_nodes(rows, &|r| Some(median(r.samples_per_second))),
            )?,
        ));
        if with_failures(rows) {
            out.push((
                "useful_fraction".into(),
                "Useful fraction of time with failures, against nodes".into(),
                lines(
                    Axis::Linear("nodes"),
                    "useful time (%)",
                    &against_nodes(rows, &|r| r.useful_fraction.map(|u| u.0 * 100.0)),
                )?,
            ));
            out.push((
                "effective_scaling".into(),
                format!(
                    "{}s per second with failures ({per_second} × useful fraction), against \
                     nodes",
                    capitalised(unit)
                ),
                lines(
                    Axis::Linear("nodes"),
                    &per_second,
                    &against_nodes(rows, &|r| r.effective_samples_per_second.map(|e| e.0)),
                )?,
            ));
        }
    }
    Ok(out)
}

/// `word` with a capital first letter.
pub(super) fn capitalised(word: &str) -> String {
    let mut chars = word.chars();
    chars
        .next()
        .map_or(String::new(), |c| c.to_uppercase().chain(chars).collect())
}

/// One line per strategy through `(nodes, value)` of its rows (rows without a value left out).
pub(super) fn against_nodes(
    rows: &[Row],
    value: &dyn Fn(&Row) -> Option<f64>,
) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut by_strategy: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for row in rows {
        let Some(v) = value(row) else { continue };
        let point = (f64::from(row.nodes), v);
        match by_strategy.iter_mut().find(|s| s.0 == row.strategy) {
            Some(s) => s.1.push(point),
            None => by_strategy.push((row.strategy.clone(), vec![point])),
        }
    }
    by_strategy
}

pub(super) const SIZE: (u32, u32) = (860, 420);

pub(super) fn colour(i: usize) -> RGBColor {
    const PALETTE: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    PALETTE[i % PALETTE.len()]
}

pub(super) fn plot_error<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing a plot: {e:?}")
}

/// The x axis of a line chart.
#[derive(Clone, Copy)]
pub(super) enum Axis<'a> {
    /// Linear, with this label.
    Linear(&'a str),
    /// Logarithmic when the positive values span more than 20× (strategies whose runs take 20 s
    /// and 500 s on one chart: on a linear axis the fast ones are a vertical line at 0), else
    /// linear.
    Auto(&'a str),
}

/// A line chart of `series` (label, points), y in percent or any unit.
pub(super) fn lines(
    x_axis: Axis<'_>,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<String> {
    let positive = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .filter(|x| *x > 0.0);
    let (low, high) = positive.fold((f64::MAX, 0.0f64), |(l, h), x| (l.min(x), h.max(x)));
    let (x_label, log) = match x_axis {
        Axis::Linear(label) => (label.to_string(), false),
        Axis::Auto(label) if low < f64::MAX && high / low > 20.0 => {
            (format!("{label}, log scale"), true)
        }
        Axis::Auto(label) => (label.to_string(), false),
    };
    // A log axis is drawn as log10 of the values, labelled with the values themselves.
    let series: Vec<(String, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(name, pts)| {
            let pts = pts
                .iter()
                .filter(|p| !log || p.0 > 0.0)
                .map(|&(x, y)| (if log { x.log10() } else { x }, y))
                .collect();
            (name.clone(), pts)
        })
        .collect();
    let points = series.iter().flat_map(|s| s.1.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(
                if log {
                    x0 - 0.05..x1 + 0.05
                } else {
                    x0.min(0.0)..x1 * 1.02 + 1e-9
                },
                (y0 - pad)..(y1 + pad),
            )
            .map_err(plot_error)?;
        let shown = |v: &f64| {
            let x = if log { 10f64.powf(*v) } else { *v };
            if x >= 100.0 || x == x.round() {
                format!("{x:.0}")
            } else {
                format!("{x:.1}")
            }
        };
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .x_label_formatter(&shown)
            .draw()
            .map_err(plot_error)?;
        for (i, (label, pts)) in series.iter().enumerate() {
            let c = colour(i);
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
                .map_err(plot_error)?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// A grouped bar chart: one group per label, one bar per series.
pub(super) fn bars(
    y_label: &str,
    labels: &[String],
    series: &[(&str, Vec<f64>)],
) -> Result<String> {
    let top = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.1;
    let groups = labels.len().max(1);
    let width = 1.0 / (series.len() as f64 + 1.0);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..groups as f64, 0.0..top)
            .map_err(plot_error)?;
        let names = labels.to_vec();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(groups * 2 + 1)
            .x_label_formatter(&move |x| {
                let at = x - x.floor();
                if (at - 0.5).abs() < 0.26 {
                    names.get(x.floor() as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc(y_label)
            .draw()
            .map_err(plot_error)?;
        for (k, (name, values)) in series.iter().enumerate() {
            let c = colour(k);
            chart
                .draw_series(values.iter().enumerate().map(|(g, v)| {
                    let x = g as f64 + width * (k as f64 + 0.5);
                    Rectangle::new([(x, 0.0), (x + width, v.max(0.0))], c.filled())
                }))
                .map_err(plot_error)?
                .label(*name)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        }
        if series.len() > 1 {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(plot_error)?;
        }
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}
