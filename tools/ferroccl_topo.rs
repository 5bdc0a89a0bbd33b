//! `ferroccl-topo`: this host's topology, and the rings and trees a job would use.
//!
//! ```text
//! ferroccl-topo                                  # NUMA nodes, CPUs, NICs, GPUs, PCI distances,
//!                                                # the RDMA device ranks would use
//! ferroccl-topo --hosts 4 --ranks-per-host 2     # plus the rings and double binary tree
//! ferroccl-topo --json                           # the same as JSON
//! ferroccl-topo --completions bash               # the shell's completion script
//! ```
//!
//! A running job writes its own (actual ranks and addresses) with
//! `FERROCCL_TOPO_DUMP_FILE=FILE`.

#[path = "cli_support.rs"]
mod cli_support;

use std::process::ExitCode;

use clap::Parser;
use clap_complete::Shell;
use ferroccl::plan::PlanOptions;
use ferroccl::plan::tree::RankTree;
use ferroccl::topo::HostTopology;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "ferroccl-topo",
    version,
    about = "Prints this host's topology, and the rings and trees a job would use.",
    after_help = "A running job writes its own (actual ranks and addresses) with \
                  FERROCCL_TOPO_DUMP_FILE=FILE."
)]
struct Cli {
    /// Print everything as JSON.
    #[arg(long)]
    json: bool,

    /// Also print the rings and double binary tree of a job on this many hosts.
    #[arg(long, value_name = "H", value_parser = positive)]
    hosts: Option<usize>,

    /// Ranks on each of those hosts.
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = positive)]
    ranks_per_host: usize,

    /// Channels (rings) of that job.
    #[arg(long, value_name = "C", default_value_t = 2, value_parser = positive)]
    channels: usize,

    /// Print the completion script for SHELL on stdout and exit.
    #[arg(long, value_name = "SHELL", exclusive = true)]
    completions: Option<Shell>,
}

/// Reads a positive whole number.
fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("not a positive whole number".into()),
    }
}

/// The network ranks of this host would use, as JSON.
fn network_json() -> serde_json::Value {
    let (rdma, why) = match ferroccl::transport::rdma_device_here() {
        Ok(dev) => (Some(dev), None),
        Err(why) => (None, Some(why)),
    };
    serde_json::json!({
        "rdma_device": rdma,
        "no_rdma_because": why,
        "gpudirect_rdma": match ferroccl::topo::gpudirect_rdma() {
            Ok(module) => serde_json::json!({ "available": true, "module": module }),
            Err(why) => serde_json::json!({ "available": false, "why": why }),
        },
    })
}

fn main() -> ExitCode {
    // Help and the version on stdout with status 0; mistakes on stderr with 2.
    let cli = Cli::parse();
    if let Some(shell) = cli.completions {
        return cli_support::print_completions::<Cli>(shell);
    }
    let (json, hosts, per_host, channels) = (cli.json, cli.hosts, cli.ranks_per_host, cli.channels);
    let host = HostTopology::detect();
    let labels: Option<Vec<usize>> =
        hosts.map(|h| (0..h * per_host).map(|r| r / per_host).collect());
    if json {
        let mut doc = serde_json::json!({
            "this_host": host.to_json(),
            "network": network_json(),
        });
        if let Some(labels) = &labels {
            let rings = PlanOptions::for_hosts(labels, channels, 1).rings;
            let trees: Vec<_> = (0..2)
                .map(|w| {
                    let t = RankTree::new(labels, w);
                    serde_json::json!({"parent": t.parent, "children": t.children})
                })
                .collect();
            doc["job"] = serde_json::json!({"hosts": labels, "rings": rings, "trees": trees});
        }
        println!("{}", serde_json::to_string_pretty(&doc).expect("JSON"));
        return ExitCode::SUCCESS;
    }
    println!("host {}", host.hostname);
    for n in &host.numa {
        println!("  numa node {}: cpus {:?}", n.id, n.cpus);
    }
    for nic in &host.nics {
        println!(
            "  nic {}: {}{}{}",
            nic.name,
            nic.speed_mbps
                .map_or("speed unknown".to_string(), |s| format!("{s} Mbit/s")),
            if nic.rdma { ", RDMA" } else { "" },
            nic.pci
                .as_ref()
                .map_or(String::new(), |p| format!(", pci {p}"))
        );
    }
    for (i, g) in host.gpus.iter().enumerate() {
        let near = ferroccl::topo::nearest_nic(&host.nics, &g.pci_path)
            .map_or(String::new(), |(n, d)| {
                format!(", nearest nic {} ({})", n.name, d.name())
            });
        println!(
            "  gpu {i}: {} pci {}, numa node {}, {} NVLinks{near}",
            if g.name.is_empty() {
                "(name unknown)"
            } else {
                &g.name
            },
            g.pci,
            g.numa_node.map_or("?".into(), |n| n.to_string()),
            g.nvlinks.len()
        );
    }
    match &host.nvml_note {
        Some(why) if host.gpus.is_empty() => println!("  no GPUs ({why})"),
        Some(why) => println!("  ({why}: GPUs from sysfs, NVLink unknown)"),
        None => {}
    }
    match ferroccl::cuda::driver() {
        Ok(d) => match &d.simulated {
            Some(what) => println!(
                "  CUDA driver: SIMULATED ({what}; FERROCCL_CUDA_DRIVER): not a GPU, {} \
                 simulated device(s)",
                ferroccl::cuda::device_count()
            ),
            None => println!(
                "  CUDA driver: {}.{} ({} device(s))",
                d.version / 1000,
                d.version % 1000 / 10,
                ferroccl::cuda::device_count()
            ),
        },
        Err(why) => println!("  CUDA driver: none ({why})"),
    }
    match ferroccl::transport::rdma_device_here() {
        Ok(dev) => println!(
            "  network: every rank here reaches ranks on other hosts over RDMA through {dev}"
        ),
        Err(why) => println!("  network: TCP to ranks on other hosts (no RDMA: {why})"),
    }
    if !host.gpus.is_empty() {
        match ferroccl::topo::gpudirect_rdma() {
            Ok(module) => println!("  GPUDirect RDMA: available ({module} loaded)"),
            Err(why) => println!("  GPUDirect RDMA: not available ({why})"),
        }
    }
    let (names, rows) = host.distance_matrix();
    if names.len() > 1 {
        println!("  PCI distances (PIX < PXB < PHB < SYS; NVn = n NVLinks):");
        println!(
            "    {:>10} {}",
            "",
            names.iter().map(|n| format!("{n:>8}")).collect::<String>()
        );
        for (n, row) in names.iter().zip(&rows) {
            println!(
                "    {n:>10} {}",
                row.iter().map(|c| format!("{c:>8}")).collect::<String>()
            );
        }
    }
    if let Some(labels) = labels {
        println!("job: {} hosts x {per_host} ranks", labels.len() / per_host);
        for (c, ring) in PlanOptions::for_hosts(&labels, channels, 1)
            .rings
            .iter()
            .enumerate()
        {
            println!("  ring {c}: {ring:?}");
        }
        for w in 0..2 {
            let t = RankTree::new(&labels, w);
            let depth = (0..labels.len()).map(|r| t.depth(r)).max().unwrap_or(0);
            println!("  tree {w}: root {}, depth {depth}", t.root());
            for (r, kids) in t.children.iter().enumerate().filter(|(_, k)| !k.is_empty()) {
                println!("    {r} -> {kids:?}");
            }
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
