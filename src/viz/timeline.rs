//! Timelines of real runs, from the records `FERROCCL_TRACE=DIR` makes every rank write
//! ([`crate::trace`]): an SVG with one row per rank and lane (each plan step a bar,
//! coloured by kind, collectives as brackets above), and the same as a Chrome /
//! Perfetto trace (`chrome://tracing`, ui.perfetto.dev).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// One record of a trace file.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// `collective` or `step`.
    pub kind: String,
    /// The rank that wrote it.
    pub rank: u64,
    /// The call's sequence number on its communicator.
    pub seq: u64,
    /// Operation (collectives) or primitive (steps: `send`, `recvReduceSend`, …).
    pub name: String,
    /// Lane of a step (0 for collectives).
    pub lane: u64,
    /// Index of a step in its lane (0 for collectives).
    pub index: u64,
    /// Peers of a step (`-1`: none).
    pub from: i64,
    /// See `from`.
    pub to: i64,
    /// Bytes moved.
    pub bytes: u64,
    /// Start, µs since the epoch.
    pub start_us: u64,
    /// End, µs since the epoch.
    pub end_us: u64,
}

fn parse_line(line: &str) -> Result<Record> {
    let v: serde_json::Value =
        serde_json::from_str(line).map_err(|e| Error::invalid(format!("trace line: {e}")))?;
    let num = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    let int = |k: &str| v.get(k).and_then(|x| x.as_i64()).unwrap_or(-1);
    let text = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
    let kind = text("kind");
    Ok(Record {
        name: if kind == "collective" {
            text("op")
        } else {
            text("step")
        },
        kind,
        rank: num("rank"),
        seq: num("seq"),
        lane: num("lane"),
        index: num("index"),
        from: int("from"),
        to: int("to"),
        bytes: num("bytes"),
        start_us: num("start_us"),
        end_us: num("end_us"),
    })
}

/// Reads every `*.jsonl` trace in `path` (a directory) or the one file `path`.
pub fn read(path: &Path) -> Result<Vec<Record>> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut f: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| Error::io(format!("read {}", path.display()), e))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .collect();
        f.sort();
        f
    } else {
        vec![path.to_path_buf()]
    };
    let mut out = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f)
            .map_err(|e| Error::io(format!("read {}", f.display()), e))?;
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            out.push(
                parse_line(line)
                    .map_err(|e| Error::invalid(format!("{}:{}: {e}", f.display(), i + 1)))?,
            );
        }
    }
    // Files are `rank<R>.<pid>.jsonl`: two files for one rank are two runs (or a
    // sub-communicator's ranks), which one timeline cannot show together.
    let mut seen: Vec<(u64, &str)> = Vec::new();
    for f in &files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if let Some((rank, _)) = name
            .strip_prefix("rank")
            .and_then(|r| r.split_once('.'))
            .and_then(|(r, rest)| Some((r.parse::<u64>().ok()?, rest)))
        {
            if let Some((_, other)) = seen.iter().find(|(r, _)| *r == rank) {
                return Err(Error::invalid(format!(
                    "{} holds traces of rank {rank} from two processes ({other} and {name}): \
                     trace each run into a directory of its own",
                    path.display()
                )));
            }
            seen.push((rank, name));
        }
    }
    if out.is_empty() {
        return Err(Error::invalid(format!(
            "no trace records in {} (run with FERROCCL_TRACE={})",
            path.display(),
            path.display()
        )));
    }
    Ok(out)
}

/// The Chrome / Perfetto trace: one process per rank, one thread per lane (collectives
/// on a thread of their own).
pub fn chrome_json(records: &[Record]) -> serde_json::Value {
    let t0 = records.iter().map(|r| r.start_us).min().unwrap_or(0);
    let events: Vec<serde_json::Value> = records
        .iter()
        .map(|r| {
            let collective = r.kind == "collective";
            serde_json::json!({
                "name": r.name,
                "cat": r.kind,
                "ph": "X",
                "ts": r.start_us - t0,
                "dur": r.end_us.saturating_sub(r.start_us).max(1),
                "pid": r.rank,
                "tid": if collective { "calls".to_string() } else { format!("lane {}", r.lane) },
                "args": { "seq": r.seq, "bytes": r.bytes, "from": r.from, "to": r.to },
            })
        })
        .collect();
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ns" })
}

fn colour(step: &str) -> &'static str {
    match step {
        "send" | "copySend" => "#5dade2",
        "recv" => "#58d68d",
        "recvReduceSend" => "#f5b041",
        "recvReduceCopy" | "recvReduceCopySend" => "#ec7063",
        "recvCopySend" => "#af7ac5",
        _ => "#aab7b8",
    }
}

/// The SVG timeline.
pub fn svg(records: &[Record]) -> String {
    use std::fmt::Write;
    let t0 = records.iter().map(|r| r.start_us).min().unwrap_or(0);
    let t1 = records
        .iter()
        .map(|r| r.end_us)
        .max()
        .unwrap_or(t0 + 1)
        .max(t0 + 1);
    let mut rows: Vec<(u64, u64)> = records
        .iter()
        .filter(|r| r.kind == "step")
        .map(|r| (r.rank, r.lane))
        .collect();
    rows.sort_unstable();
    rows.dedup();
    let (left, top, row_h, width) = (110.0, 30.0, 18.0, 1000.0);
    let height = top + rows.len() as f64 * row_h + 40.0;
    let x = |t: u64| left + (t - t0) as f64 / (t1 - t0) as f64 * (width - left - 10.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="16">{} µs; bars are plan steps (colour: primitive), black lines collectives</text>"#,
        t1 - t0
    );
    for (i, (rank, lane)) in rows.iter().enumerate() {
        let y = top + i as f64 * row_h;
        let _ = writeln!(
            s,
            r#"<text x="4" y="{}">rank {rank} lane {lane}</text>"#,
            y + row_h * 0.7
        );
        for r in records
            .iter()
            .filter(|r| r.kind == "step" && r.rank == *rank && r.lane == *lane)
        {
            let (a, b) = (x(r.start_us), x(r.end_us.max(r.start_us)));
            let _ = writeln!(
                s,
                r#"<rect x="{a:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>#{} {} {}→{} {} B, {} µs</title></rect>"#,
                (b - a).max(0.5),
                row_h - 3.0,
                colour(&r.name),
                r.seq,
                r.name,
                r.from,
                r.to,
                r.bytes,
                r.end_us.saturating_sub(r.start_us)
            );
        }
        for c in records
            .iter()
            .filter(|c| c.kind == "collective" && c.rank == *rank && *lane == 0)
        {
            let _ = writeln!(
                s,
                r#"<line x1="{:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="black" stroke-width="2"><title>{} #{}</title></line>"#,
                x(c.start_us),
                x(c.end_us),
                c.name,
                c.seq
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

/// `ferroccl-viz trace DIR [--svg FILE] [--chrome FILE]` (defaults: `DIR/timeline.svg`
/// and `DIR/trace.json`).
pub fn command(path: &str, args: &[String]) -> std::result::Result<(), String> {
    let opts = super::Options::parse(args, &["svg", "chrome"])?;
    let get = |k: &str| opts.get(k).map(str::to_string);
    let p = Path::new(path);
    let records = read(p).map_err(|e| e.to_string())?;
    let base = if p.is_dir() {
        p.to_path_buf()
    } else {
        p.parent().unwrap_or(Path::new(".")).to_path_buf()
    };
    let svg_path = get("svg").unwrap_or_else(|| base.join("timeline.svg").display().to_string());
    let chrome_path =
        get("chrome").unwrap_or_else(|| base.join("trace.json").display().to_string());
    std::fs::write(&svg_path, svg(&records)).map_err(|e| format!("write {svg_path}: {e}"))?;
    std::fs::write(&chrome_path, chrome_json(&records).to_string())
        .map_err(|e| format!("write {chrome_path}: {e}"))?;
    let mut ranks: Vec<u64> = records.iter().map(|r| r.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for rank in ranks {
        let calls = records
            .iter()
            .filter(|r| r.rank == rank && r.kind == "collective")
            .count();
        let steps = records
            .iter()
            .filter(|r| r.rank == rank && r.kind == "step")
            .count();
        println!("rank {rank}: {calls} collectives, {steps} steps");
    }
    println!("wrote {svg_path} and {chrome_path}");
    Ok(())
}
