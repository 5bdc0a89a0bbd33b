//! Predicting a collective's time on a described machine by running its real plans on
//! a cost model (`ferroccl-viz simulate`).
//!
//! A topology file (JSON) describes hosts, ranks per host, cores per host, and two
//! links: inside a host and between hosts, each a latency α and a bandwidth β:
//!
//! ```json
//! { "name": "8 GPUs on NVLink", "hosts": 1, "ranks_per_host": 8,
//!   "local": { "latency_us": 2, "bandwidth_GBps": 450 },
//!   "net": { "latency_us": 5, "bandwidth_GBps": 50 },
//!   "chunk_bytes": 524288, "channels": 1 }
//! ```
//!
//! Every rank's plan is played step by step: a message of `b` bytes from rank `i` to
//! rank `j` on another host occupies the link `i → j` for `b/β` (messages on one link
//! queue behind each other) and arrives `α` after it has been sent; inside a host it
//! occupies rank `i`'s engine thread instead (shared memory moves by copies, and one
//! thread runs all of a rank's lanes). A step that receives starts when its message has
//! arrived; sends do not wait (the FIFOs absorb them). When a host has more ranks than
//! cores (`cores_per_host`), each rank gets that share of the local β.

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};
use crate::plan::{self, Algorithm, Collective, PlanOptions};
use crate::transport::Protocol;
use crate::tune::{CostModel, Crowding, LinkCost, Shape};

/// A machine to predict for.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    /// What it is.
    pub name: String,
    /// Hosts.
    pub hosts: usize,
    /// Ranks on each host.
    pub ranks_per_host: usize,
    /// Cores per host, when copies are CPU-bound (host memory); `None` for GPUs.
    pub cores_per_host: Option<usize>,
    /// Link between ranks of one host.
    pub local: LinkCost,
    /// Link between hosts.
    pub net: LinkCost,
    /// Bytes per pipeline chunk (as `FERROCCL_CHUNK_SIZE`).
    pub chunk_bytes: usize,
    /// Parallel rings.
    pub channels: usize,
}

fn field<'a>(v: &'a serde_json::Value, key: &str) -> Result<&'a serde_json::Value> {
    v.get(key)
        .ok_or_else(|| Error::invalid(format!("topology: missing field {key:?}")))
}

fn number(v: &serde_json::Value, key: &str) -> Result<f64> {
    field(v, key)?
        .as_f64()
        .filter(|x| x.is_finite() && *x > 0.0)
        .ok_or_else(|| Error::invalid(format!("topology: {key:?} must be a positive number")))
}

fn link(v: &serde_json::Value, key: &str) -> Result<LinkCost> {
    let l = field(v, key)?;
    Ok(LinkCost::new(
        number(l, "latency_us")?,
        number(l, "bandwidth_GBps")?,
    ))
}

impl Topology {
    /// Reads a topology file's JSON.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid(format!("topology: not JSON: {e}")))?;
        let count = |key: &str| -> Result<usize> {
            let x = number(&v, key)?;
            if x.fract() != 0.0 {
                return Err(Error::invalid(format!(
                    "topology: {key:?} must be a whole number"
                )));
            }
            Ok(x as usize)
        };
        let t = Topology {
            name: v
                .get("name")
                .and_then(|n| n.as_str())
                .unwrap_or("unnamed")
                .to_string(),
            hosts: count("hosts")?,
            ranks_per_host: count("ranks_per_host")?,
            cores_per_host: v
                .get("cores_per_host")
                .map(|_| count("cores_per_host"))
                .transpose()?,
            local: link(&v, "local")?,
            net: link(&v, "net")?,
            chunk_bytes: v
                .get("chunk_bytes")
                .map_or(Ok(512 << 10), |_| count("chunk_bytes"))?,
            channels: v.get("channels").map_or(Ok(1), |_| count("channels"))?,
        };
        let ranks = t.hosts.saturating_mul(t.ranks_per_host);
        if !(2..=4096).contains(&ranks) {
            return Err(Error::invalid(format!(
                "topology: {} hosts x {} ranks: simulate 2 to 4096 ranks",
                t.hosts, t.ranks_per_host
            )));
        }
        if t.channels > 64 {
            return Err(Error::invalid(format!(
                "topology: {} channels: use 1 to 64",
                t.channels
            )));
        }
        Ok(t)
    }

    /// Ranks in all.
    pub fn ranks(&self) -> usize {
        self.hosts * self.ranks_per_host
    }

    /// The host of each rank (hosts hold consecutive ranks).
    pub fn host_labels(&self) -> Vec<usize> {
        (0..self.ranks()).map(|r| r / self.ranks_per_host).collect()
    }

    /// The local link as ranks get it: a share of β when ranks outnumber cores.
    pub fn effective_local(&self) -> LinkCost {
        let share = self
            .cores_per_host
            .map_or(1.0, |c| (c as f64 / self.ranks_per_host as f64).min(1.0));
        LinkCost {
            alpha: self.local.alpha,
            beta: self.local.beta * share,
        }
    }
}

/// Predicted seconds for `collective` of `bytes` per rank (4-byte elements) with
/// `algorithm` on `topo`: the real plans played on the link model.
pub fn predict(
    topo: &Topology,
    collective: Collective,
    algorithm: Algorithm,
    bytes: usize,
) -> Result<f64> {
    let n = topo.ranks();
    let count = bytes / 4;
    let hosts = topo.host_labels();
    let options = PlanOptions::for_hosts(&hosts, topo.channels, (topo.chunk_bytes / 4).max(1))
        .with_algorithm(algorithm);
    let plans = (0..n)
        .map(|r| plan::plan(collective, count, r, n, &options))
        .collect::<Result<Vec<_>>>()?;
    let local = topo.effective_local();
    let cost = |a: usize, b: usize| {
        if hosts[a] == hosts[b] {
            local
        } else {
            topo.net
        }
    };
    // (channel, from, to) → arrival times of messages in flight.
    let mut queues: HashMap<(usize, usize, usize), VecDeque<f64>> = HashMap::new();
    let mut link_free: HashMap<(usize, usize), f64> = HashMap::new();
    let mut cursor: Vec<Vec<usize>> = plans.iter().map(|p| vec![0; p.lanes.len()]).collect();
    let mut clock: Vec<Vec<f64>> = plans.iter().map(|p| vec![0.0; p.lanes.len()]).collect();
    loop {
        let mut progressed = false;
        let mut pending = false;
        for (rank, p) in plans.iter().enumerate() {
            for (li, lane) in p.lanes.iter().enumerate() {
                while let Some(step) = lane.steps.get(cursor[rank][li]) {
                    let mut t = clock[rank][li];
                    if let Some(from) = step.recv_from() {
                        match queues
                            .get_mut(&(lane.channel, from, rank))
                            .and_then(VecDeque::pop_front)
                        {
                            Some(arrival) => t = t.max(arrival),
                            None => {
                                pending = true;
                                break;
                            }
                        }
                    }
                    if let Some(to) = step.send_to() {
                        let c = cost(rank, to);
                        let wire = (step.len() * 4) as f64 / c.beta;
                        // Inside a host the data moves by copies of the rank's one engine
                        // thread, whatever the lane; between hosts, over the NIC's link.
                        let resource = if hosts[rank] == hosts[to] {
                            (rank, rank)
                        } else {
                            (rank, to)
                        };
                        let free = link_free.entry(resource).or_insert(0.0);
                        let start = t.max(*free);
                        *free = start + wire;
                        queues
                            .entry((lane.channel, rank, to))
                            .or_default()
                            .push_back(start + wire + c.alpha);
                    }
                    clock[rank][li] = t;
                    cursor[rank][li] += 1;
                    progressed = true;
                }
            }
        }
        if !pending {
            break;
        }
        if !progressed {
            return Err(Error::invalid(format!(
                "simulate: the plans of {collective} deadlock on the link model"
            )));
        }
    }
    Ok(clock.iter().flatten().cloned().fold(0.0, f64::max))
}

/// nccl-tests' bus bandwidth factor for all-reduce on `n` ranks.
fn bus_factor(n: usize) -> f64 {
    crate::perf::Test::AllReduce.bus_factor(n)
}

/// One row of a prediction: size, then (time s, algbw GB/s, busbw GB/s) for ring and
/// tree, and the tuner's pick.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Bytes per rank.
    pub bytes: usize,
    /// Ring: seconds.
    pub ring: f64,
    /// Tree: seconds.
    pub tree: f64,
    /// What the cost model (`tune`) would choose.
    pub pick: Algorithm,
}

/// All-reduce predictions for sizes from 8 B by ×2 up to `max_bytes`.
pub fn all_reduce_rows(topo: &Topology, max_bytes: usize) -> Result<Vec<Row>> {
    // The plans simulated here have no protocol: the model picks among algorithms with
    // Simple only.
    let local = topo.effective_local();
    let model = CostModel {
        local,
        local_ll: local,
        local_single: local,
        local_in_place: local,
        net: topo.net,
    };
    let shape = Shape {
        ranks: topo.ranks(),
        hosts: topo.hosts,
        ranks_per_host: topo.ranks_per_host,
        // A topology file says nothing of CPUs.
        crowding: Crowding::NONE,
    };
    let mut rows = Vec::new();
    let mut bytes = 8usize;
    while bytes <= max_bytes {
        rows.push(Row {
            bytes,
            ring: predict(topo, Collective::AllReduce, Algorithm::Ring, bytes)?,
            tree: predict(topo, Collective::AllReduce, Algorithm::Tree, bytes)?,
            pick: model
                .best(
                    Collective::AllReduce,
                    bytes,
                    shape,
                    &[Algorithm::Ring, Algorithm::Tree],
                    &[Protocol::Simple],
                )
                .algorithm,
        });
        bytes *= 2;
    }
    Ok(rows)
}

/// `ferroccl-viz simulate --topology FILE --size MAX [--plot FILE.svg]`.
pub fn command(args: &[String]) -> std::result::Result<(), String> {
    let opts = super::Options::parse(args, &["topology", "size", "plot"])?;
    let get = |k: &str| opts.get(k);
    let path = get("topology").ok_or("simulate needs --topology FILE.json")?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("read {path}: {e}"))?;
    let topo = Topology::from_json(&text).map_err(|e| format!("{path}: {e}"))?;
    let max = crate::perf::args::parse_size(get("size").unwrap_or("1G"))
        .map_err(|e| format!("--size: {e}"))?;
    if max < 16 {
        return Err(format!(
            "--size {max}: simulate at least 16 bytes (sizes start at 8)"
        ));
    }
    let rows = all_reduce_rows(&topo, max).map_err(|e| e.to_string())?;
    let n = topo.ranks();
    println!(
        "# {}: {} hosts x {} ranks; local {:.1} us, {:.1} GB/s{}; net {:.1} us, {:.1} GB/s",
        topo.name,
        topo.hosts,
        topo.ranks_per_host,
        topo.local.alpha * 1e6,
        topo.effective_local().beta / 1e9,
        topo.cores_per_host.map_or(String::new(), |c| format!(
            " (shared by {} ranks on {c} cores)",
            topo.ranks_per_host
        )),
        topo.net.alpha * 1e6,
        topo.net.beta / 1e9,
    );
    println!("# predicted all_reduce (float), busbw = algbw x 2(n-1)/n");
    println!(
        "# {:>12} {:>12} {:>9} {:>9} {:>12} {:>9} {:>9}  tuner",
        "size (B)", "ring (us)", "algbw", "busbw", "tree (us)", "algbw", "busbw"
    );
    for r in &rows {
        let bw = |t: f64| r.bytes as f64 / t / 1e9;
        println!(
            "  {:>12} {:>12.2} {:>9.3} {:>9.3} {:>12.2} {:>9.3} {:>9.3}  {}",
            r.bytes,
            r.ring * 1e6,
            bw(r.ring),
            bw(r.ring) * bus_factor(n),
            r.tree * 1e6,
            bw(r.tree),
            bw(r.tree) * bus_factor(n),
            r.pick.name()
        );
    }
    match crossover(&rows) {
        Some(b) => println!("# ring becomes faster than tree at {b} B (simulated)"),
        None => println!("# no ring/tree crossover in this range"),
    }
    if let Some(svg) = get("plot") {
        plot(&topo, &rows, svg).map_err(|e| format!("plot {svg}: {e}"))?;
        println!("# wrote {svg}");
    }
    Ok(())
}

/// The first size at which the ring is faster than the tree after the tree was faster.
pub fn crossover(rows: &[Row]) -> Option<usize> {
    let mut tree_won = false;
    for r in rows {
        if r.tree < r.ring {
            tree_won = true;
        } else if tree_won {
            return Some(r.bytes);
        }
    }
    None
}

fn plot(topo: &Topology, rows: &[Row], path: &str) -> std::result::Result<(), String> {
    use plotters::prelude::*;
    let n = topo.ranks();
    let busbw = |t: f64, b: usize| b as f64 / t / 1e9 * bus_factor(n);
    let max = rows
        .iter()
        .flat_map(|r| [busbw(r.ring, r.bytes), busbw(r.tree, r.bytes)])
        .fold(0.0, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let x_max = rows.last().map_or(1.0, |r| (r.bytes as f64).log2());
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{}: predicted all_reduce busbw", topo.name),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(3.0..x_max, 0.0..max.max(1e-6))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("message size (log2 bytes)")
        .y_desc("busbw (GB/s)")
        .draw()
        .map_err(|e| e.to_string())?;
    for (name, colour, pick) in [("ring", &BLUE, true), ("tree", &RED, false)] {
        let points: Vec<(f64, f64)> = rows
            .iter()
            .map(|r| {
                let t = if pick { r.ring } else { r.tree };
                ((r.bytes as f64).log2(), busbw(t, r.bytes))
            })
            .collect();
        chart
            .draw_series(LineSeries::new(points, colour))
            .map_err(|e| e.to_string())?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
