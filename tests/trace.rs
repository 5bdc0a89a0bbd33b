//! `FERROCCL_TRACE=DIR`: every rank of a real 4-rank all-reduce writes a record for
//! every step of the plan it ran, and the timeline tool reads them back. (Its own test
//! binary: tracing installs one process-wide subscriber.)

use std::collections::BTreeSet;
use std::time::Duration;

use ferroccl::comm::CommConfig;
use ferroccl::plan::Collective;
use ferroccl::viz::timeline;
use ferroccl::{Communicator, DataType, ReduceOp};

#[test]
fn a_traced_all_reduce_records_every_step_of_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: set before any thread of this test binary starts (this is its only test).
    unsafe { std::env::set_var("FERROCCL_TRACE", dir.path()) };
    let config = CommConfig {
        timeout: Duration::from_secs(60),
        slot_bytes: 16 << 10,
        chunk_bytes: 4 * (16 << 10),
        channels: 2,
        ..CommConfig::default()
    };
    let count = 100_003;
    let comms = Communicator::init_all_with(4, config).unwrap();
    let plans: Vec<_> = comms
        .iter()
        .map(|c| {
            c.plan_for(Collective::AllReduce, count, DataType::Float32)
                .unwrap()
        })
        .collect();
    std::thread::scope(|s| {
        for comm in &comms {
            s.spawn(move || {
                let mut buf = vec![1.0f32; count];
                comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
                assert!(buf.iter().all(|&x| x == 4.0));
            });
        }
    });
    drop(comms);
    let records = timeline::read(dir.path()).unwrap();
    for (rank, plan) in plans.iter().enumerate() {
        let want: BTreeSet<(u64, u64, String)> = plan
            .lanes
            .iter()
            .enumerate()
            .flat_map(|(li, lane)| {
                lane.steps
                    .iter()
                    .enumerate()
                    .map(move |(i, s)| (li as u64, i as u64, s.name().to_string()))
            })
            .collect();
        let steps: Vec<&timeline::Record> = records
            .iter()
            .filter(|r| r.kind == "step" && r.rank == rank as u64)
            .collect();
        let got: BTreeSet<(u64, u64, String)> = steps
            .iter()
            .map(|r| (r.lane, r.index, r.name.clone()))
            .collect();
        assert!(want.len() > 10, "a real plan has many steps");
        assert_eq!(got, want, "rank {rank}: traced steps differ from its plan");
        assert_eq!(steps.len(), want.len(), "rank {rank}: a step traced twice");
        assert!(
            steps
                .iter()
                .all(|r| r.end_us >= r.start_us && r.start_us > 0)
        );
        let calls: Vec<_> = records
            .iter()
            .filter(|r| r.kind == "collective" && r.rank == rank as u64)
            .collect();
        assert_eq!(calls.len(), 1, "rank {rank}: one all_reduce call");
        assert_eq!(calls[0].name, "all_reduce");
        assert_eq!(calls[0].bytes, (count * 4) as u64);
    }
    // The timeline tool turns them into an SVG and a Chrome trace.
    let chrome = timeline::chrome_json(&records);
    assert_eq!(
        chrome["traceEvents"].as_array().unwrap().len(),
        records.len()
    );
    assert!(timeline::svg(&records).contains("rank 3 lane"));
}
