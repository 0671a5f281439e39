//! Throughput timelines of failure-injection runs: when throughput came back after a failure,
//! and charts of throughput over time with the recovery events marked (the paper's Figures 9
//! to 11).

use std::path::Path;

use farm::{ReconfigEvent, RecoveryEvent, Timeline};

pub use farm_workloads::timeline::{back_to, mean_before, WINDOW_MS};

/// A labelled instant on a chart, in microseconds on the cluster's clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Marker {
    /// When.
    pub at_us: u64,
    /// What (suspect, config-commit, ...).
    pub label: String,
}

/// The recovery events of `t` as chart markers: suspicions, probes, the store write,
/// NEW-CONFIG-COMMIT, ALL-REGIONS-ACTIVE, and per machine the first data-recovery start and
/// the last data-recovery done.
pub fn markers(t: &Timeline) -> Vec<Marker> {
    let mut out: Vec<Marker> = t
        .events
        .iter()
        .map(|e| match e {
            ReconfigEvent::Suspect { machine, at_us } => (*at_us, format!("suspect {machine}")),
            ReconfigEvent::Probed { at_us } => (*at_us, "probe".into()),
            ReconfigEvent::Stored { config, at_us } => (*at_us, format!("zookeeper {}", config.0)),
            ReconfigEvent::Committed { config, at_us } => {
                (*at_us, format!("config-commit {}", config.0))
            }
            ReconfigEvent::AllActive { config, at_us } => {
                (*at_us, format!("all-active {}", config.0))
            }
            ReconfigEvent::Failed { at_us, .. } => (*at_us, "reconfiguration failed".into()),
        })
        .map(|(at_us, label)| Marker { at_us, label })
        .collect();
    let started = t.recovery.iter().filter_map(|(_, e)| match e {
        RecoveryEvent::DataRecoveryStarted { at, .. } => Some(*at),
        _ => None,
    });
    let done = t.recovery.iter().filter_map(|(_, e)| match e {
        RecoveryEvent::DataRecoveryDone { at, .. } => Some(*at),
        _ => None,
    });
    if let Some(at) = started.min() {
        out.push(Marker {
            at_us: at,
            label: "data-recovery start".into(),
        });
    }
    if let Some(at) = done.max() {
        out.push(Marker {
            at_us: at,
            label: "data-recovery done".into(),
        });
    }
    out.sort_by_key(|m| m.at_us);
    out
}

/// Draws operations per millisecond from `from_ms` on, with `markers` as labelled vertical
/// lines, to an SVG file at `path`.
pub fn draw(
    path: &Path,
    title: &str,
    per_ms: &[u64],
    from_ms: usize,
    markers: &[Marker],
) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let end = per_ms.len().max(from_ms + 1);
    let peak = per_ms[from_ms.min(per_ms.len())..]
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(1);
    let root = SVGBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(from_ms as u64..end as u64, 0u64..peak * 11 / 10)?;
    chart
        .configure_mesh()
        .x_desc("time (ms)")
        .y_desc("operations per ms")
        .draw()?;
    chart.draw_series(LineSeries::new(
        (from_ms..per_ms.len()).map(|ms| (ms as u64, per_ms[ms])),
        &BLUE,
    ))?;
    for (i, m) in markers.iter().enumerate() {
        let x = m.at_us / 1000;
        if x < from_ms as u64 {
            continue;
        }
        let colour = Palette99::pick(i).mix(0.9);
        chart
            .draw_series(LineSeries::new(
                [(x, 0), (x, peak * 11 / 10)],
                colour.stroke_width(1),
            ))?
            .label(format!("{} ({:.1} ms)", m.label, m.at_us as f64 / 1000.0))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 15, y)], colour));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}
