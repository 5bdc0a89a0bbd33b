//! What the perf tools print and write: nccl-tests' table, and JSON, CSV and SVG.

use std::fmt::Write as _;
use std::path::Path;

use super::args::Memory;
use super::{PerfArgs, Test};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};

/// One mode (out of place or in place) of one size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measure {
    /// Time per call in microseconds, combined over ranks as `-a` asks.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s (10^9 bytes).
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Wrong elements over all ranks (`None` without `-c 1`).
    pub wrong: Option<u64>,
}

/// One line of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Bytes moved (nccl-tests' size column).
    pub size: usize,
    /// Elements in `size`.
    pub count: usize,
    /// Data type.
    pub dtype: DataType,
    /// Reduction, for reducing tests.
    pub op: Option<ReduceOp>,
    /// Root, for rooted tests.
    pub root: Option<usize>,
    /// Out of place.
    pub out_of_place: Measure,
    /// In place, where the test has it.
    pub in_place: Option<Measure>,
    /// Algorithm and channels.
    pub algorithm: String,
    /// The rank that made the row (only rank 0's are printed).
    pub rank: usize,
}

impl Row {
    /// Wrong elements in both modes.
    pub fn wrong(&self) -> u64 {
        self.out_of_place.wrong.unwrap_or(0) + self.in_place.and_then(|m| m.wrong).unwrap_or(0)
    }
}

const RULE: &str = "#";

/// Where rank `rank`'s buffers are: `host-memory`, or its GPU (`rank % GPUs`, as
/// [`super::device`] binds it), marked when the CUDA driver is the tests' simulated one.
fn memory_label(memory: Memory, rank: usize) -> String {
    match memory {
        Memory::Host => "host-memory".into(),
        Memory::Cuda => {
            let gpus = crate::cuda::device_count().max(1);
            let simulated = crate::cuda::driver().is_ok_and(|d| d.simulated.is_some());
            format!(
                "cuda:{}{}",
                rank % gpus,
                if simulated { " (SIMULATED driver)" } else { "" }
            )
        }
    }
}

/// The lines before the table: the run, the ranks, the column headings.
pub fn header(test: Test, args: &PerfArgs, comm: &Communicator) -> String {
    let mut s = String::new();
    let step = if args.step_factor > 1 {
        format!("{}(factor)", args.step_factor)
    } else {
        format!("{}(bytes)", args.step_bytes)
    };
    let iters = match args.iters {
        super::args::Iters::Fixed(n) => n.to_string(),
        super::args::Iters::Auto => "auto".into(),
    };
    let _ = writeln!(
        s,
        "# {} — ferroccl {} (nccl-tests compatible)",
        test.program(),
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(
        s,
        "# nRanks {} minBytes {} maxBytes {} step: {step} warmup iters: {} iters: {iters} agg iters: 1 validation: {} cycles: {}",
        comm.size(),
        args.min_bytes,
        args.max_bytes,
        args.warmup,
        u8::from(args.check),
        args.cycles
    );
    let _ = writeln!(s, "{RULE}\n# Using devices");
    for p in comm.peers() {
        let _ = writeln!(
            s,
            "#  Rank {:2} Group  0 Pid {:6} on {:>10} device {}",
            p.rank,
            p.pid,
            p.hostname,
            memory_label(args.memory, p.rank)
        );
    }
    let c = comm.config();
    let channels = match args.memory {
        Memory::Host => c.channels.to_string(),
        Memory::Cuda => {
            let t = comm.device_tuning();
            match t.link {
                Some(link) => format!("{} ({})", t.channels, link.name()),
                None => format!("{} (no GPU was current at initialisation)", t.channels),
            }
        }
    };
    let _ = writeln!(
        s,
        "# channels {channels}, FIFO {} x {} KiB ({} slots between ranks of a host that \
         each have a core, {} where they outnumber its cores), chunk {} KiB, timeout {:?}",
        c.slots,
        c.slot_bytes >> 10,
        c.dedicated_slots,
        c.crowded_slots,
        c.chunk_bytes_for(crate::plan::Protocol::Simple, comm.crowded()) >> 10,
        c.timeout
    );
    let _ = writeln!(s, "{RULE}");
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       in-place",
        "", "", "", "", ""
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  algorithm",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "time",
        "algbw",
        "busbw",
        "#wrong"
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}",
        "(B)",
        "(elements)",
        "",
        "",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        ""
    );
    s
}

fn time_text(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{us:7.0}")
    } else if us >= 100.0 {
        format!("{us:7.1}")
    } else {
        format!("{us:7.2}")
    }
}

fn measure_text(m: Option<&Measure>) -> String {
    match m {
        Some(m) => format!(
            "  {}  {:6.2}  {:6.2}  {:>6}",
            time_text(m.time_us),
            m.algbw,
            m.busbw,
            m.wrong.map_or("N/A".to_string(), |w| w.to_string())
        ),
        None => format!("  {:>7}  {:>6}  {:>6}  {:>6}", "N/A", "N/A", "N/A", "N/A"),
    }
}

/// One line of the table.
pub fn row_line(r: &Row) -> String {
    format!(
        "  {:>10}  {:>12}  {:>8}  {:>6}  {:>6}{}{}  {}",
        r.size,
        r.count,
        r.dtype.name(),
        r.op.map_or("none", |o| o.name()),
        r.root.map_or(-1, |x| x as i64),
        measure_text(Some(&r.out_of_place)),
        measure_text(r.in_place.as_ref()),
        r.algorithm
    )
}

/// Mean bus bandwidth over every measured mode of every row.
pub fn avg_busbw(rows: &[Row]) -> f64 {
    let all: Vec<f64> = rows
        .iter()
        .flat_map(|r| std::iter::once(r.out_of_place).chain(r.in_place))
        .map(|m| m.busbw)
        .collect();
    if all.is_empty() {
        0.0
    } else {
        all.iter().sum::<f64>() / all.len() as f64
    }
}

/// The lines after the table.
pub fn footer(rows: &[Row], checked: bool) -> String {
    let wrong: u64 = rows.iter().map(Row::wrong).sum();
    let verdict = if !checked {
        "N/A (-c 0)".to_string()
    } else if wrong == 0 {
        "0 OK".to_string()
    } else {
        format!("{wrong} FAILED")
    };
    format!(
        "# Out of bounds values : {verdict}\n# Avg bus bandwidth    : {:.6} \n#\n",
        avg_busbw(rows)
    )
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("write {}", path.display()), e))
}

fn measure_json(m: &Measure) -> serde_json::Value {
    serde_json::json!({
        "time_us": m.time_us,
        "algbw_gbs": m.algbw,
        "busbw_gbs": m.busbw,
        "wrong": m.wrong,
    })
}

/// Writes `-J`, `--csv` and `--plot` outputs.
pub fn write_outputs(test: Test, args: &PerfArgs, comm: &Communicator, rows: &[Row]) -> Result<()> {
    if let Some(path) = &args.json {
        let results: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "size": r.size,
                    "count": r.count,
                    "type": r.dtype.name(),
                    "redop": r.op.map(|o| o.name()),
                    "root": r.root,
                    "out_of_place": measure_json(&r.out_of_place),
                    "in_place": r.in_place.as_ref().map(measure_json),
                    "algorithm": r.algorithm,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "program": test.program(),
            "library": format!("ferroccl {}", env!("CARGO_PKG_VERSION")),
            "nranks": comm.size(),
            "bus_factor": test.bus_factor(comm.size()),
            "results": results,
            "wrong": rows.iter().map(Row::wrong).sum::<u64>(),
            "avg_busbw_gbs": avg_busbw(rows),
        });
        let text =
            serde_json::to_string_pretty(&doc).map_err(|e| Error::invalid(format!("JSON: {e}")))?;
        write_file(path, &text)?;
    }
    if let Some(path) = &args.csv {
        let mut s = String::from(
            "size,count,type,redop,root,oop_time_us,oop_algbw,oop_busbw,oop_wrong,ip_time_us,ip_algbw,ip_busbw,ip_wrong,algorithm\n",
        );
        let cells = |m: Option<&Measure>| match m {
            Some(m) => format!(
                "{},{},{},{}",
                m.time_us,
                m.algbw,
                m.busbw,
                m.wrong.map_or(String::new(), |w| w.to_string())
            ),
            None => ",,,".into(),
        };
        for r in rows {
            let _ = writeln!(
                s,
                "{},{},{},{},{},{},{},{}",
                r.size,
                r.count,
                r.dtype.name(),
                r.op.map_or("none", |o| o.name()),
                r.root.map_or(-1, |x| x as i64),
                cells(Some(&r.out_of_place)),
                cells(r.in_place.as_ref()),
                r.algorithm
            );
        }
        write_file(path, &s)?;
    }
    if let Some(path) = &args.plot {
        let series = [
            (
                format!("{} out-of-place", test.program()),
                rows.iter()
                    .map(|r| (r.size, r.out_of_place))
                    .collect::<Vec<_>>(),
            ),
            (
                format!("{} in-place", test.program()),
                rows.iter()
                    .filter_map(|r| r.in_place.map(|m| (r.size, m)))
                    .collect(),
            ),
        ];
        plot(
            path,
            &format!("{} on {} ranks (ferroccl)", test.program(), comm.size()),
            &series,
        )?;
    }
    Ok(())
}

/// Draws bus bandwidth and time against size (log-x), one line per series.
pub fn plot(path: &Path, title: &str, series: &[(String, Vec<(usize, Measure)>)]) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: String| Error::invalid(format!("plot {}: {e}", path.display()));
    let points: Vec<&(usize, Measure)> = series.iter().flat_map(|(_, p)| p).collect();
    if points.is_empty() {
        return Err(err("nothing to draw".into()));
    }
    let x_min = points.iter().map(|p| p.0.max(1)).min().unwrap_or(1) as f64;
    let x_max = (points.iter().map(|p| p.0).max().unwrap_or(2) as f64).max(x_min * 2.0);
    let bw_max = points
        .iter()
        .map(|p| p.1.busbw)
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.1;
    let t_min = points
        .iter()
        .map(|p| p.1.time_us)
        .fold(f64::MAX, f64::min)
        .max(1e-3);
    let t_max = points
        .iter()
        .map(|p| p.1.time_us)
        .fold(0.0, f64::max)
        .max(t_min * 2.0);

    let root = SVGBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let root = root
        .titled(title, ("sans-serif", 20))
        .map_err(|e| err(e.to_string()))?;
    let (left, right) = root.split_horizontally(600);
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];

    let mut bw = ChartBuilder::on(&left)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .caption("bus bandwidth", ("sans-serif", 16))
        .build_cartesian_2d((x_min..x_max).log_scale(), 0.0..bw_max)
        .map_err(|e| err(e.to_string()))?;
    bw.configure_mesh()
        .x_desc("size (bytes)")
        .y_desc("busbw (GB/s)")
        .x_label_formatter(&|v| human_bytes(*v))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    let mut lat = ChartBuilder::on(&right)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .caption("time per call", ("sans-serif", 16))
        .build_cartesian_2d((x_min..x_max).log_scale(), (t_min..t_max).log_scale())
        .map_err(|e| err(e.to_string()))?;
    lat.configure_mesh()
        .x_desc("size (bytes)")
        .y_desc("time (us)")
        .x_label_formatter(&|v| human_bytes(*v))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (name, pts)) in series.iter().enumerate() {
        if pts.is_empty() {
            continue;
        }
        let color = colors[i % colors.len()];
        let bw_pts: Vec<(f64, f64)> = pts.iter().map(|(s, m)| (*s as f64, m.busbw)).collect();
        bw.draw_series(LineSeries::new(bw_pts.clone(), color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        bw.draw_series(bw_pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(e.to_string()))?;
        let t_pts: Vec<(f64, f64)> = pts.iter().map(|(s, m)| (*s as f64, m.time_us)).collect();
        lat.draw_series(LineSeries::new(t_pts.clone(), color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?;
        lat.draw_series(t_pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(e.to_string()))?;
    }
    bw.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Axis labels: sizes in decimal units (the log axis puts its ticks at powers of ten).
fn human_bytes(v: f64) -> String {
    for (unit, name) in [(1e9, "G"), (1e6, "M"), (1e3, "k")] {
        if v >= unit {
            return format!("{}{name}", (v / unit * 10.0).round() / 10.0);
        }
    }
    format!("{}", v.round())
}
