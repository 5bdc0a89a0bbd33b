//! The study tools' numbers come from the real plans: the 4-rank ring table of the
//! README, the bytes each rank sends per phase, the time simulator against the α-β
//! formula, and the animated page in a real headless browser (when Chromium is
//! installed; `.ci/run` installs it).

use ferroccl::plan::{Algorithm, Collective};
use ferroccl::viz::predict::{self, Topology};
use ferroccl::viz::{self, html};

fn cell(t: &viz::StepTable, round: usize, rank: usize, chunk: usize) -> (i64, u32) {
    let v = t.rounds[round].held[rank][chunk].expect("held");
    (v.value, v.contributions())
}

#[test]
fn four_rank_ring_table_has_the_textbook_numbers() {
    let t = viz::step_table(Collective::AllReduce, Algorithm::Ring, 4).unwrap();
    // Start, 3 reduce-scatter rounds, 3 all-gather rounds.
    assert_eq!(t.rounds.len(), 7);
    for r in 0..4 {
        for c in 0..4 {
            assert_eq!(cell(&t, 0, r, c), ((r as i64 + 1) * 10 + c as i64, 1));
        }
    }
    // After the first reduce-scatter round rank 1 holds 10 + 20 = 30 in chunk a.
    assert_eq!(cell(&t, 1, 1, 0), (30, 2));
    assert_eq!(t.phase_of(&t.rounds[1]), "reduce-scatter");
    // After three rounds every rank owns one chunk summed over all four ranks.
    let mut owned: Vec<i64> = (0..4)
        .flat_map(|r| (0..4).map(move |c| (r, c)))
        .map(|(r, c)| cell(&t, 3, r, c))
        .filter(|&(_, k)| k == 4)
        .map(|(v, _)| v)
        .collect();
    owned.sort();
    assert_eq!(owned, [100, 104, 108, 112]);
    // After the all-gather rounds every rank holds all of them.
    for r in 0..4 {
        let row: Vec<(i64, u32)> = (0..4).map(|c| cell(&t, 6, r, c)).collect();
        assert_eq!(row, [(100, 4), (104, 4), (108, 4), (112, 4)]);
    }
    assert_eq!(t.phase_of(&t.rounds[6]), "all-gather");
    // Every round moves one chunk from each rank to the next.
    for round in &t.rounds[1..] {
        let mut hops: Vec<(usize, usize)> =
            round.transfers.iter().map(|x| (x.from, x.to)).collect();
        hops.sort();
        assert_eq!(hops, [(0, 1), (1, 2), (2, 3), (3, 0)]);
    }
    let text = t.render_text();
    assert!(
        text.contains("*30[2]") && text.contains("*112[4]"),
        "{text}"
    );
}

#[test]
fn ring_all_reduce_sends_2_n_minus_1_over_n_of_the_buffer() {
    for n in 2..=16 {
        let count = n * 64;
        let s = count * 4;
        let bytes = viz::phase_bytes(Collective::AllReduce, Algorithm::Ring, n, count, 4).unwrap();
        assert_eq!(bytes.len(), n);
        for (rank, b) in bytes.iter().enumerate() {
            assert_eq!(
                b.reduce * n,
                (n - 1) * s,
                "n {n} rank {rank} reduce-scatter"
            );
            assert_eq!(b.gather * n, (n - 1) * s, "n {n} rank {rank} all-gather");
        }
        // Reduce-scatter and all-gather alone each send (n-1)/n of the whole.
        for (c, (reduce, gather)) in [
            (Collective::ReduceScatter, (n - 1, 0)),
            (Collective::AllGather, (0, n - 1)),
        ] {
            let per_rank = 64;
            let b = viz::phase_bytes(c, Algorithm::Ring, n, per_rank, 4).unwrap();
            for x in b {
                assert_eq!(
                    (x.reduce, x.gather),
                    (reduce * per_rank * 4, gather * per_rank * 4)
                );
            }
        }
    }
}

#[test]
fn tree_table_reaches_every_rank() {
    let t = viz::step_table(Collective::AllReduce, Algorithm::Tree, 8).unwrap();
    let last = t.rounds.last().unwrap();
    let want: Vec<i64> = (0..8).map(|c| (1..=8).map(|r| r * 10 + c).sum()).collect();
    for r in 0..8 {
        let row: Vec<i64> = last.held[r].iter().map(|v| v.unwrap().value).collect();
        assert_eq!(row, want, "rank {r}");
    }
    assert_eq!(t.tree_parents.len(), 2);
}

#[test]
fn tree_reduce_table_completes_the_sum_at_the_root_only() {
    let (n, root) = (6, 4);
    let t = viz::step_table(Collective::Reduce { root }, Algorithm::Tree, n).unwrap();
    assert_eq!(t.algorithm_label(), "tree");
    assert_eq!(t.tree_parents.len(), 1);
    assert_eq!(
        t.tree_parents[0][root], None,
        "the tree is rooted at the root"
    );
    let last = t.rounds.last().unwrap();
    let want: Vec<i64> = (0..n as i64)
        .map(|c| (1..=n as i64).map(|r| r * 10 + c).sum())
        .collect();
    let row: Vec<i64> = last.held[root].iter().map(|v| v.unwrap().value).collect();
    assert_eq!(row, want);
    // Everyone else holds at most a partial sum (inner ranks keep theirs in scratch).
    for r in (0..n).filter(|&r| r != root) {
        assert!(
            last.held[r]
                .iter()
                .zip(&want)
                .all(|(v, w)| v.is_none_or(|v| v.value < *w)),
            "rank {r}: {:?}",
            last.held[r]
        );
    }
}

#[test]
fn simulated_ring_time_matches_the_alpha_beta_formula() {
    // One chunk per ring step: each of the 2(n-1) steps waits for the previous one's
    // message, so the time is 2(n-1)(α + (S/n)/β) exactly.
    let topo = Topology::from_json(
        r#"{"name":"t","hosts":1,"ranks_per_host":4,
            "local":{"latency_us":10,"bandwidth_GBps":1},
            "net":{"latency_us":100,"bandwidth_GBps":1},"chunk_bytes":1073741824}"#,
    )
    .unwrap();
    let s = 4 << 20;
    let t = predict::predict(&topo, Collective::AllReduce, Algorithm::Ring, s).unwrap();
    let want = 6.0 * (10e-6 + (s as f64 / 4.0) / 1e9);
    assert!((t - want).abs() / want < 1e-9, "{t} vs {want}");
    // Sharing two cores between four ranks halves the local bandwidth.
    let shared = Topology {
        cores_per_host: Some(2),
        ..topo.clone()
    };
    let t2 = predict::predict(&shared, Collective::AllReduce, Algorithm::Ring, s).unwrap();
    let want2 = 6.0 * (10e-6 + (s as f64 / 4.0) / 0.5e9);
    assert!((t2 - want2).abs() / want2 < 1e-9, "{t2} vs {want2}");
    // Bad files are refused with the field named.
    let err = Topology::from_json(r#"{"hosts":1}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("ranks_per_host"), "{err}");
}

#[test]
fn shipped_topologies_simulate_with_a_crossover() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("topologies");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let topo = Topology::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let rows = predict::all_reduce_rows(&topo, 1 << 30).unwrap();
        assert!(
            rows.iter()
                .all(|r| r.ring.is_finite() && r.ring > 0.0 && r.tree > 0.0),
            "{}",
            path.display()
        );
        // Small messages take longer than nothing, big ones longer than small ones.
        assert!(
            rows.windows(2).all(|w| w[1].ring >= w[0].ring),
            "{}",
            path.display()
        );
        if topo.hosts == 1 {
            // On one host the tree is a chain that sends the buffer twice: the
            // bandwidth-optimal ring wins for big messages.
            let last = rows.last().unwrap();
            assert!(last.ring <= last.tree, "{}: {last:?}", path.display());
        }
        seen += 1;
    }
    assert!(
        seen >= 3,
        "expected the shipped topology files in {}",
        dir.display()
    );
}

/// Chromium, if installed (`.ci/run` installs Debian's).
fn chromium() -> Option<std::path::PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            let out = std::process::Command::new("which")
                .arg(name)
                .output()
                .ok()?;
            out.status
                .success()
                .then(|| std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        })
}

#[test]
fn animated_page_shows_the_round_in_a_real_browser() {
    let t = viz::step_table(Collective::AllReduce, Algorithm::Ring, 4).unwrap();
    let page = html::page(&t);
    // Self-contained: nothing is fetched (the SVG namespace URI is only a name).
    for external in [
        "src=\"http",
        "href=\"http",
        "<script src",
        "<link ",
        "@import",
    ] {
        assert!(!page.contains(external), "the page loads {external}...");
    }
    let Some(browser) = chromium() else {
        eprintln!(
            "\n*** SKIPPED animated_page_shows_the_round_in_a_real_browser: no chromium \
             (apt-get install chromium; .ci/run does) ***\n"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ring.html");
    std::fs::write(&file, page).unwrap();
    let url = format!("file://{}#round=3", file.display());
    let headless = |extra: &[&str]| {
        let out = std::process::Command::new(&browser)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
            ])
            .arg(format!(
                "--user-data-dir={}",
                dir.path().join("profile").display()
            ))
            .args(extra)
            .arg(&url)
            .output()
            .expect("run chromium");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let dom = headless(&["--dump-dom"]);
    assert!(
        dom.contains(r#"data-round="3""#),
        "body should show round 3:\n{dom}"
    );
    // At round 3 each rank owns one chunk with all four contributions.
    for value in [100, 104, 108, 112] {
        assert!(
            dom.contains(&format!(r#"data-value="{value}" data-contrib="4""#)),
            "no full chunk {value} in the DOM"
        );
    }
    let shot = dir.path().join("ring.png");
    headless(&[
        &format!("--screenshot={}", shot.display()),
        "--window-size=800,720",
    ]);
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    if let Some(keep) = std::env::var_os("FERROCCL_KEEP_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }
}

/// Recursive doubling on 3 ranks: rank 1 hands its input to rank 0, ranks 0 and 2
/// exchange partial sums, and rank 0 hands the result back; every rank ends with the
/// sum of all three, and the phases and byte counts are named as doubling's.
#[test]
fn three_rank_doubling_table_hands_over_exchanges_and_hands_back() {
    let t = viz::step_table(Collective::AllReduce, Algorithm::Doubling, 3).unwrap();
    let last = t.rounds.len() - 1;
    for r in 0..3 {
        // Chunk a: 10 + 20 + 30.
        assert_eq!(cell(&t, last, r, 0), (60, 3), "rank {r}");
    }
    let phases: Vec<&str> = t.rounds.iter().map(|r| t.phase_of(r)).collect();
    assert_eq!(phases[1], "exchange partial sums", "{phases:?}");
    assert_eq!(phases[last], "hand results back", "{phases:?}");
    let bytes = viz::bytes_summary(Collective::AllReduce, Algorithm::Doubling, 3).unwrap();
    // Rank 0 sends the buffer twice (its partial to rank 2, the result to rank 1).
    assert!(
        bytes.contains("rank 0  partial sums 1.0000 S, results 1.0000 S, total 2.0000 S"),
        "{bytes}"
    );
}
