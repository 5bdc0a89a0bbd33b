//! The book (`docs/`, an mdBook) and the README checked against the repository and the
//! code, so that they cannot drift from either:
//!
//! - every internal link (to a file, and to a heading in it) and every `{{#include}}`
//!   (to a file, and to an `ANCHOR:` in it) resolves, in the book and the README;
//! - every chapter file is in `SUMMARY.md`, and everything `SUMMARY.md` lists exists;
//! - the Tools page shows each tool's `--help` as the tool prints it;
//! - the environment-variable page lists exactly the variables the code reads;
//! - the README stays a front door (at most 250 lines).
//!
//! `.ci/run` also builds the book with mdBook itself (`mdbook build docs`, warnings as
//! errors).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

// The shared test helpers (a directory walker here).
#[allow(unused_imports)]
mod common;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn book() -> PathBuf {
    root().join("docs/src")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The chapter files of the book.
fn chapters() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(book())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    files.sort();
    files
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// The id mdBook gives a heading (lowercase; letters, digits, `_` and `-` kept, spaces
/// to `-`, the rest dropped), as its links to headings use.
fn heading_id(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_ascii_lowercase())
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The ids of the headings of a Markdown file.
fn heading_ids(text: &str) -> BTreeSet<String> {
    prose(text)
        .into_iter()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| heading_id(h.trim_start_matches('#').trim()))
        .collect()
}

/// The targets of the Markdown links and images in `text` (outside code).
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

/// What is wrong with the links of `file` (empty when nothing is).
fn broken_links(file: &Path) -> Vec<String> {
    let text = read(file);
    let dir = file.parent().unwrap();
    let mut broken = Vec::new();
    for target in link_targets(&text) {
        if target.starts_with("http://") || target.starts_with("https://") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() {
            file.to_path_buf()
        } else {
            dir.join(path)
        };
        if !resolved.exists() {
            broken.push(format!("{target}: no file {}", resolved.display()));
            continue;
        }
        if let Some(anchor) = anchor
            && !heading_ids(&read(&resolved)).contains(anchor)
        {
            broken.push(format!("{target}: no heading #{anchor} in {path}"));
        }
    }
    for line in text.lines() {
        let Some(start) = line.find("{{#include ") else {
            continue;
        };
        let inner = &line[start + "{{#include ".len()..];
        let inner = &inner[..inner.find("}}").expect("an include ends with }}")];
        let (path, anchor) = match inner.split_once(':') {
            Some((p, a)) => (p, Some(a)),
            None => (inner, None),
        };
        let resolved = dir.join(path.trim());
        match std::fs::read_to_string(&resolved) {
            Err(e) => broken.push(format!("include {path}: {e}")),
            Ok(included) => {
                if let Some(anchor) = anchor
                    && !included.contains(&format!("ANCHOR: {anchor}"))
                {
                    broken.push(format!("include {path}: no ANCHOR: {anchor}"));
                }
            }
        }
    }
    broken
}

#[test]
fn every_link_and_include_of_the_book_and_the_readme_resolves() {
    let mut files = chapters();
    files.push(root().join("README.md"));
    let broken: Vec<String> = files
        .iter()
        .flat_map(|f| {
            broken_links(f)
                .into_iter()
                .map(move |b| format!("{}: {b}", f.strip_prefix(root()).unwrap().display()))
        })
        .collect();
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_summary_lists_every_chapter_and_only_chapters_that_exist() {
    let summary = read(&book().join("SUMMARY.md"));
    let listed: BTreeSet<String> = link_targets(&summary).into_iter().collect();
    let files: BTreeSet<String> = chapters()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .filter(|n| n != "SUMMARY.md")
        .collect();
    let missing: Vec<_> = files.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&files).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "chapters not in SUMMARY.md: {missing:?}; listed but missing: {extra:?}"
    );
}

#[test]
fn the_tools_page_shows_every_tools_help_as_it_prints_it() {
    let page = read(&book().join("tools.md"));
    for exe in [
        env!("CARGO_BIN_EXE_ferrorun"),
        env!("CARGO_BIN_EXE_ferroccl-topo"),
        env!("CARGO_BIN_EXE_ferroccl-tune"),
        env!("CARGO_BIN_EXE_ferroccl-limits"),
        env!("CARGO_BIN_EXE_ferroccl-viz"),
        env!("CARGO_BIN_EXE_ferroccl-rendezvous"),
        env!("CARGO_BIN_EXE_all_reduce_perf"),
    ] {
        let out = Command::new(exe)
            .arg("--help")
            .env_remove("COLUMNS")
            .env_remove("LINES")
            .output()
            .unwrap();
        assert!(out.status.success(), "{exe} --help");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            page.contains(help.trim_end()),
            "docs/src/tools.md does not show {exe} --help as it prints it now:\n{help}"
        );
    }
}

/// The `FERROCCL_*` and `NCCL_*` names in string literals of the code that reads them.
fn variables_in_code() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let dirs = ["src", "tools", "python/src", "python/ferroccl"];
    for path in dirs
        .iter()
        .flat_map(|d| common::files_under(&root().join(d), &["rs", "py"]))
    {
        let text = read(&path);
        names.extend(variables_after(&text, '"'));
    }
    names
}

/// The `FERROCCL_*` / `NCCL_*` names that follow a `quote` in `text`.
fn variables_after(text: &str, quote: char) -> Vec<String> {
    text.match_indices(quote)
        .map(|(at, _)| &text[at + 1..])
        .filter(|rest| rest.starts_with("FERROCCL_") || rest.starts_with("NCCL_"))
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn the_environment_page_lists_exactly_the_variables_the_code_reads() {
    let page = read(&book().join("environment.md"));
    // `FERROCCL_SIM_*`: a family, read by the tests' simulated driver.
    let documented: BTreeSet<String> = variables_after(&page, '`')
        .into_iter()
        .filter(|name| !name.ends_with('_'))
        .collect();
    let read_by_code = variables_in_code();
    let undocumented: Vec<_> = read_by_code.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&read_by_code).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "docs/src/environment.md: read by the code but not listed: {undocumented:?}; \
         listed but read nowhere: {stale:?}"
    );
}

#[test]
fn the_readme_is_a_front_door() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(
        lines <= 250,
        "README.md has {lines} lines: move the detail into the book"
    );
}

#[test]
fn headings_get_mdbooks_ids() {
    assert_eq!(heading_id("Channels on a GPU"), "channels-on-a-gpu");
    assert_eq!(heading_id("Across hosts: RDMA"), "across-hosts-rdma");
    assert_eq!(
        heading_id("`ncclCommInitAll` (devlist)"),
        "ncclcomminitall-devlist"
    );
}
