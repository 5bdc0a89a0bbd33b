//! The library's structure, checked so that it stays readable:
//!
//! - its modules form layers, bottom to top, as `src/lib.rs` and DESIGN.md list them: a
//!   module uses only modules of lower layers (or itself), so there is no import cycle.
//!   Every `crate::<module>` path in the code of `src/` (comments and string literals
//!   aside) is checked against the table below;
//! - no function of the transports and the communicator (`src/transport/`, `src/comm/`)
//!   is longer than 100 lines: a function that needs more is several functions.

use std::path::Path;

// The shared test helpers (a directory walker here).
#[allow(unused_imports)]
mod common;

/// The layers, bottom to top. Modules in one entry are one layer and do not use each
/// other.
const LAYERS: &[&[&str]] = &[
    &["lock", "half", "with_element_type"],
    &["error"],
    &["env"],
    &["types"],
    &["trace"],
    &["store"],
    &["bootstrap"],
    &["plan"],
    &["topo"],
    &["tune"],
    &["reduce"],
    &["cuda"],
    &["transport"],
    &["fault"],
    &["engine"],
    &["comm"],
    &["launch"],
    &["pg", "capi"],
    &["ddp"],
    &["perf"],
    &["viz"],
];

/// Items of the crate root that are not modules (re-exports, the `lock` helper).
const ROOT_ITEMS: &[&str] = &[
    "Communicator",
    "Error",
    "Result",
    "DataType",
    "Element",
    "ReduceOp",
    "Scalar",
    "F8E4M3",
    "F8E5M2",
];

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// The code of a Rust file without comments and string literals (good enough for
/// finding paths: raw strings and char literals with quotes do not occur in `src/`
/// where it matters; a `'"'` is handled).
fn code_only(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
            }
            '\'' if chars.peek() == Some(&'"') => {
                out.push_str("'\"'");
                chars.next();
                chars.next();
            }
            '"' => {
                let mut escaped = false;
                for c in chars.by_ref() {
                    if escaped {
                        escaped = false;
                    } else if c == '\\' {
                        escaped = true;
                    } else if c == '"' {
                        break;
                    }
                }
                out.push_str("\"\"");
            }
            c => out.push(c),
        }
    }
    out
}

/// The Rust files under `dir`.
fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    common::files_under(dir, &["rs"])
}

/// The modules of `src/` (first path component of each file) and the crate modules each
/// file's code names.
fn uses() -> Vec<(String, String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    for path in rust_files(&src) {
        let rel = path
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if rel == "lib.rs" {
            continue;
        }
        let module = rel
            .split('/')
            .next()
            .unwrap()
            .trim_end_matches(".rs")
            .to_string();
        let code = code_only(&std::fs::read_to_string(&path).unwrap());
        // A file's tests may use anything (they are not part of the layering).
        let code = match code.find("#[cfg(test)]\nmod tests") {
            Some(at) => &code[..at],
            None => &code[..],
        };
        for (at, _) in code.match_indices("crate::") {
            let name: String = code[at + 7..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            out.push((rel.clone(), module.clone(), name));
        }
    }
    out
}

#[test]
fn every_module_uses_only_lower_layers() {
    let mut wrong = Vec::new();
    for (file, module, used) in uses() {
        if used == module || ROOT_ITEMS.contains(&used.as_str()) {
            continue;
        }
        let (Some(mine), Some(theirs)) = (layer(&module), layer(&used)) else {
            wrong.push(format!(
                "{file}: {module} or {used} is in no layer of this test"
            ));
            continue;
        };
        if theirs >= mine {
            wrong.push(format!(
                "{file}: {module} (layer {mine}) uses crate::{used} (layer {theirs})"
            ));
        }
    }
    wrong.sort();
    wrong.dedup();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_reader_of_code_skips_comments_and_strings() {
    let code =
        code_only("use crate::a; // crate::b\n/* crate::c */ let s = \"crate::d\"; '\"'; crate::e");
    assert!(
        code.contains("crate::a") && code.contains("crate::e"),
        "{code}"
    );
    assert!(!code.contains("crate::b") && !code.contains("crate::c") && !code.contains("crate::d"));
}

/// The functions of `code` (already without comments and strings) and their lengths in
/// lines, from `fn` to the closing brace of the body.
fn function_lengths(code: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("fn ") {
        let before = code[..at].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = code[at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let (Some(open), semi) = (code[at..].find('{'), code[at..].find(';')) else {
            continue;
        };
        if name.is_empty() || semi.is_some_and(|s| s < open) {
            continue; // a declaration without a body, or `fn(...)` types
        }
        let mut depth = 0usize;
        let mut end = at + open;
        for (i, c) in code[at + open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = at + open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((name, code[at..=end].lines().count()));
    }
    out
}

#[test]
fn no_function_of_the_transports_or_the_communicator_is_over_100_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut long = Vec::new();
    for dir in ["src/transport", "src/comm"] {
        for path in rust_files(&root.join(dir)) {
            let code = code_only(&std::fs::read_to_string(&path).unwrap());
            let code = match code.find("#[cfg(test)]\nmod tests") {
                Some(at) => &code[..at],
                None => &code[..],
            };
            for (name, lines) in function_lengths(code) {
                if lines > 100 {
                    long.push(format!(
                        "{}: fn {name} has {lines} lines",
                        path.strip_prefix(root).unwrap().display()
                    ));
                }
            }
        }
    }
    assert!(long.is_empty(), "{}", long.join("\n"));
}

#[test]
fn function_lengths_count_from_fn_to_the_closing_brace() {
    let code = "fn a() {\n    if x {\n        y();\n    }\n}\ntype F = fn(u8);\nfn b();\n";
    assert_eq!(function_lengths(code), vec![("a".to_string(), 5)]);
}
