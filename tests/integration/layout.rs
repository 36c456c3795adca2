//! The runtime's layout as docs/ARCHITECTURE.md maps it: every source file of every runtime crate
//! is listed there (and every listed file exists), and no file is over 600 lines. Which crate may
//! depend on which is `crate_order.rs`'s check of the same doc's crate table.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 600;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file below `dir`, relative to it.
fn rust_files(dir: &Path, base: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, base, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(base).unwrap();
            out.insert(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

/// The runtime's source files, as `module-runtime/<crate>/src/<file>`.
fn source_files() -> BTreeSet<String> {
    let runtime = root().join("module-runtime");
    let mut files = BTreeSet::new();
    for entry in std::fs::read_dir(&runtime).unwrap() {
        let dir = entry.unwrap().path();
        let src = dir.join("src");
        if dir.is_dir() && src.is_dir() {
            let mut found = BTreeSet::new();
            rust_files(&src, &src, &mut found);
            let krate = dir.file_name().unwrap().to_string_lossy().into_owned();
            files.extend(
                found
                    .into_iter()
                    .map(|f| format!("module-runtime/{krate}/src/{f}")),
            );
        }
    }
    let mut facade = BTreeSet::new();
    rust_files(&runtime.join("src"), &runtime.join("src"), &mut facade);
    files.extend(
        facade
            .into_iter()
            .map(|f| format!("module-runtime/src/{f}")),
    );
    files
}

/// The files docs/ARCHITECTURE.md lists: each `## crate (`folder`)` section's table rows.
fn mapped_files() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap();
    let mut folder = None;
    let mut files = BTreeSet::new();
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            folder = heading
                .split('`')
                .nth(1)
                .filter(|f| f.starts_with("module-runtime"))
                .map(str::to_owned);
        } else if let (Some(folder), Some(row)) = (&folder, line.strip_prefix("| `")) {
            let file = row.split('`').next().unwrap();
            if file.ends_with(".rs") {
                files.insert(format!("{folder}/{file}"));
            }
        }
    }
    files
}

#[test]
fn architecture_md_maps_every_runtime_file() {
    let sources = source_files();
    let mapped = mapped_files();
    let unmapped: Vec<_> = sources.difference(&mapped).collect();
    let stale: Vec<_> = mapped.difference(&sources).collect();
    assert!(
        unmapped.is_empty() && stale.is_empty(),
        "docs/ARCHITECTURE.md is out of date: files it does not list: {unmapped:?}; \
         files it lists that do not exist: {stale:?}"
    );
}

#[test]
fn no_runtime_file_is_over_600_lines() {
    let long: Vec<(String, usize)> = source_files()
        .into_iter()
        .map(|f| {
            let lines = std::fs::read_to_string(root().join(&f))
                .unwrap()
                .lines()
                .count();
            (f, lines)
        })
        .filter(|(_, lines)| *lines > MAX_LINES)
        .collect();
    assert!(long.is_empty(), "files over {MAX_LINES} lines: {long:?}");
}
