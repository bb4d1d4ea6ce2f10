//! The report as text: the table's columns and cells, the settings the runs shared, and the
//! Markdown and self-contained HTML pages around them.

use std::fmt::Write as _;

use super::quality::Quality;
use super::spec::CompareOptions;

use super::claims::*;
use super::runs::*;

/// A failed run's row: its label, then what it ended with across the other columns' first.
pub(super) fn failed_cells(f: &Failed, columns: usize) -> Vec<String> {
    let mut cells = vec![
        format!("{} ({})", f.label, f.name),
        format!("FAILED: {}", f.reason),
    ];
    cells.resize(columns.max(2), "—".to_string());
    cells
}

/// The table's columns in `quality`'s terms, and the failure study's where runs have one.
pub(super) fn columns(quality: &Quality, failures: bool) -> Vec<String> {
    let unit = quality.unit();
    let (final_column, best_column) = match quality {
        Quality::Accuracy {
            regression: true, ..
        } => ("final R²", "best R²"),
        Quality::Accuracy { .. } => ("final accuracy %", "best %"),
        Quality::Loss { .. } => ("final validation loss", "best"),
    };
    let mut columns: Vec<String> = [
        "run",
        final_column,
        best_column,
        "time to target (s)",
        &format!("{unit}s/s"),
        &format!("bytes/{unit} (cluster)"),
        &format!("bytes/{unit} (busiest node)"),
        "peak RSS, largest node (MB)",
        "idle % of training time",
        "training time (s)",
    ]
    .map(String::from)
    .to_vec();
    if failures {
        columns.extend([
            "useful % of time with failures".into(),
            format!("effective {unit}s/s"),
        ]);
    }
    if let Quality::Accuracy {
        regression: true, ..
    } = quality
    {
        columns.extend(["final RMSE".into(), "final MAE".into()]);
    }
    columns
}

/// Whether any row has a failure study.
pub(super) fn with_failures(rows: &[Row]) -> bool {
    rows.iter().any(|r| r.useful_fraction.is_some())
}

pub(super) fn cells(row: &Row, quality: &Quality, simulated: bool, failures: bool) -> Vec<String> {
    let (digits, scale) = quality.digits_and_scale();
    let target = quality.target_text();
    let mut cells = vec![
        if row.repeats > 1 {
            format!("{} ({} runs)", row.label, row.repeats)
        } else {
            row.label.clone()
        },
        show(row.final_quality, digits, scale),
        show(row.best_quality, digits, scale),
        match row.time_to_target {
            Some(_) if row.reached < row.repeats => format!(
                "{} ({} of {} reached {target})",
                show(row.time_to_target, 1, 1.0),
                row.reached,
                row.repeats,
            ),
            Some(_) => show(row.time_to_target, 1, 1.0),
            None => format!("not reached ({target})"),
        },
        show(row.samples_per_second, 0, 1.0),
        show(row.bytes_per_sample, 0, 1.0),
        show(row.busiest_bytes_per_sample, 0, 1.0),
        show(row.peak_rss_mb, 0, 1.0),
        show(row.idle_fraction, 1, 100.0),
        show(row.train_seconds, 1, 1.0),
    ];
    if simulated {
        // Sizes-only runs compute no accuracy, and their memory is the simulator's.
        for i in [1, 2, 3, 7] {
            cells[i] = "—".into();
        }
    }
    if failures {
        cells.push(show(row.useful_fraction, 1, 100.0));
        cells.push(show(row.effective_samples_per_second, 0, 1.0));
    }
    if let Quality::Accuracy {
        regression: true, ..
    } = quality
    {
        let (rmse, mae) = if simulated {
            ("—".into(), "—".into())
        } else {
            (show(row.rmse, 4, 1.0), show(row.mae, 4, 1.0))
        };
        cells.extend([rmse, mae]);
    }
    cells
}

pub(super) fn settings(options: &CompareOptions, finished: &[Finished]) -> String {
    let first = finished.first().map(|f| &f.summary);
    let share = match super::spec::sweep_share(options) {
        Some(share)
            if !options.simulate && !options.train.iter().any(|a| a.starts_with("--node-cpu")) =>
        {
            format!(
                "; every node of the sweep under a CPU quota of {share} core(s) (--node-cpu), \
                 the same at every node count"
            )
        }
        _ => String::new(),
    };
    let length = match first.map(|s| (s.train_samples, s.epochs)) {
        _ if options.train_seconds.is_some() => format!(
            "equal training time: about {} s per run (each run's sample budget is that time × \
             the samples/s of a probe run of {} samples of its own configuration, under \
             runs/*-probe)",
            options.train_seconds.unwrap_or_default(),
            super::spec::PROBE_SAMPLES
        ),
        Some((Some(samples), _)) => format!("{samples} training samples"),
        Some((None, epochs)) => format!("{epochs} epoch(s)"),
        None => "? epoch(s)".into(),
    };
    let simulated = if options.simulate {
        "SIMULATED with `ringtmp simulate` (the strategies' own code on the simulated network, \
         compute priced by the cost model in cost-model.json, tensors as sizes): accuracy and \
         memory are not simulated; "
    } else {
        ""
    };
    let failures = if options.failure_args.is_empty() {
        String::new()
    } else {
        format!(
            "with failures `{}` (each run injects one failure into its strategy's protocol to \
             measure the recovery, then follows a long training through failures of every node: \
             its simulation.json holds the inputs and the assumptions); ",
            options.failure_args.join(" ")
        )
    };
    // Runs with the same arguments as an earlier one (`local` at each count of a sweep) ran once.
    let reused: Vec<String> = finished
        .iter()
        .filter_map(|f| {
            let same = std::fs::read_to_string(
                options.out.join("runs").join(&f.plan.name).join("same-as"),
            )
            .ok()?;
            let source = finished.iter().find(|g| g.plan.name == same.trim())?;
            Some(format!("{} is {}'s run", f.label(), source.label()))
        })
        .collect();
    let reused = if reused.is_empty() {
        String::new()
    } else {
        format!(
            "; runs with the same arguments ran once ({})",
            reused.join(", ")
        )
    };
    let shared = shared_options(&options.train);
    format!(
        "{simulated}{failures}model {}, dataset {}, {length}, seed {}{shared}{share}{reused}",
        first.map_or("?", |s| s.model.as_str()),
        first.map_or("?", |s| s.dataset.as_str()),
        first.map_or(0, |s| s.seed),
    )
}

/// `; shared options: `…`` for the runs' common `train` options; nothing (not an empty code
/// span) when there are none.
pub(super) fn shared_options(train: &[String]) -> String {
    if train.is_empty() {
        String::new()
    } else {
        format!("; shared options: `{}`", train.join(" "))
    }
}

/// What the target is, where the report chose it (a language model's).
pub(super) fn target_note(quality: &Quality) -> String {
    match quality {
        Quality::Accuracy {
            regression: true, ..
        } => " The runs are regressions: the yardstick is R² (1 − the mean squared error over \
               the targets' variance), kept in the summaries' accuracy fields; RMSE and MAE are \
               in the targets' units."
            .into(),
        Quality::Accuracy { .. } => String::new(),
        Quality::Loss { target, .. } => format!(
            " The target is validation loss {target:.3}: within {:.0}% of the lowest final \
             validation loss of any run here; throughput and traffic are per token.",
            super::quality::LOSS_TOLERANCE * 100.0
        ),
    }
}

pub(super) fn markdown(
    options: &CompareOptions,
    quality: &Quality,
    finished: &[Finished],
    rows: &[Row],
    failed: &[Failed],
    plots: &[(String, String, String)],
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# ringtmp compare\n\n{}\n", settings(options, finished));
    let failures = with_failures(rows);
    let columns = columns(quality, failures);
    let _ = writeln!(md, "| {} |", columns.join(" | "));
    let _ = writeln!(md, "|{}", "---|".repeat(columns.len()));
    for row in rows {
        let _ = writeln!(
            md,
            "| {} |",
            cells(row, quality, options.simulate, failures).join(" | ")
        );
    }
    for f in failed {
        let cells: Vec<String> = failed_cells(f, columns.len())
            .into_iter()
            .map(|c| c.replace('|', "\\|"))
            .collect();
        let _ = writeln!(md, "| {} |", cells.join(" | "));
    }
    let _ = writeln!(
        md,
        "\nMedians, with the range over repeats in parentheses. Time to target is on each \
         strategy's training clock. `results.jsonl` has one line per run; every run's own files \
         are under `runs/` where the report was made (published reports leave them out: the \
         script that made the report makes them again).{}\n",
        target_note(quality)
    );
    for (name, title, _) in plots {
        let _ = writeln!(md, "## {title}\n\n![{title}](plots/{name}.svg)\n");
    }
    if options.simulate {
        let _ = writeln!(
            md,
            "The claims need accuracy: not judged on simulated runs."
        );
        return md;
    }
    let _ = writeln!(md, "## The claims\n");
    for c in claims(finished, rows, quality) {
        let _ = writeln!(
            md,
            "**{}** — {}\n\n- measured: {}\n- predicted: {}\n",
            c.title, c.verdict, c.measured, c.predicted
        );
    }
    md
}

pub(super) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

pub(super) fn html(
    options: &CompareOptions,
    quality: &Quality,
    finished: &[Finished],
    rows: &[Row],
    failed: &[Failed],
    plots: &[(String, String, String)],
) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n\
         <meta charset=\"utf-8\"/>\n<title>ringtmp compare</title>\n<style>\n\
         body {{ font-family: sans-serif; margin: 2em; max-width: 1100px; }}\n\
         table {{ border-collapse: collapse; }}\n\
         td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}\n\
         td:first-child, th:first-child {{ text-align: left; }}\n\
         figure {{ margin: 1.5em 0; }}\n</style>\n</head>\n<body>\n\
         <h1>ringtmp compare</h1>\n<p>{}</p>\n<table>\n<tr>",
        escape(&settings(options, finished))
    );
    let failures = with_failures(rows);
    for c in columns(quality, failures) {
        let _ = write!(h, "<th>{}</th>", escape(&c));
    }
    h.push_str("</tr>\n");
    for row in rows {
        h.push_str("<tr>");
        for c in cells(row, quality, options.simulate, failures) {
            let _ = write!(h, "<td>{}</td>", escape(&c));
        }
        h.push_str("</tr>\n");
    }
    for f in failed {
        h.push_str("<tr class=\"failed\">");
        for c in failed_cells(f, columns(quality, failures).len()) {
            let _ = write!(h, "<td>{}</td>", escape(&c));
        }
        h.push_str("</tr>\n");
    }
    let _ = writeln!(
        h,
        "</table>\n<p>Medians, with the range over repeats in parentheses. Time to target is \
         on each strategy's training clock.{}</p>",
        escape(&target_note(quality))
    );
    for (_, title, svg) in plots {
        // The SVG documents are inlined without their XML declaration.
        let body = svg
            .trim_start()
            .strip_prefix("<?xml")
            .and_then(|rest| rest.split_once("?>").map(|(_, b)| b))
            .unwrap_or(svg);
        let _ = write!(
            h,
            "<figure>\n<figcaption>{}</figcaption>\n{}\n</figure>\n",
            escape(title),
            body.trim()
        );
    }
    let claims = if options.simulate {
        h.push_str("<p>The claims need accuracy: not judged on simulated runs.</p>\n");
        Vec::new()
    } else {
        h.push_str("<h2>The claims</h2>\n");
        claims(finished, rows, quality)
    };
    for c in claims {
        let _ = write!(
            h,
            "<h3>{} — {}</h3>\n<ul><li>measured: {}</li><li>predicted: {}</li></ul>\n",
            escape(&c.title),
            escape(&c.verdict),
            escape(&c.measured),
            escape(&c.predicted)
        );
    }
    h.push_str("</body>\n</html>\n");
    h
}
