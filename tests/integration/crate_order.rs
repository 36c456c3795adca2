//! The order of the runtime's crates, checked against the rule docs/ARCHITECTURE.md states: its
//! table `| crate | folder | depends on (runtime crates) |` is read from the doc, and `cargo
//! metadata` says what each workspace crate depends on. A crate that depends on a workspace crate
//! its row does not allow, a runtime crate (one under `module-runtime/`) without a row, a row
//! whose folder is not the crate's, and a row naming no crate all fail, so the doc is the rule and
//! a new crate or dependency only needs its row.
//!
//! Dev-dependencies are not checked: the lower crates' doctests use the façade through one, as
//! users do, and cargo allows that cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One row of the doc's crate table.
#[derive(Debug)]
struct Row {
    folder: String,
    /// The workspace crates it may depend on.
    allowed: BTreeSet<String>,
}

/// A workspace crate, as `cargo metadata` describes it.
#[derive(Debug)]
struct Package {
    /// Its folder, relative to the workspace root (`module-runtime/core`).
    folder: String,
    /// The workspace crates it depends on (normal and build dependencies).
    depends_on: BTreeSet<String>,
}

/// The crate table of docs/ARCHITECTURE.md: crate name -> row. A cell names crates in full
/// (`module-runtime`) or by the part after `module-` (`core`, `derive`); `—` is none, and
/// `all of the above` is every crate of the rows above it.
fn crate_table(doc: &str, workspace: &BTreeSet<String>) -> BTreeMap<String, Row> {
    let mut lines = doc.lines().skip_while(|l| {
        !(l.starts_with("| crate | folder | depends on") || l.starts_with("|crate|folder|"))
    });
    assert!(
        lines.next().is_some(),
        "docs/ARCHITECTURE.md has no `| crate | folder | depends on (runtime crates) |` table"
    );
    let mut rows = BTreeMap::new();
    let mut above: Vec<String> = Vec::new();
    for line in lines.skip(1).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let [name, folder, deps] = cells[..] else {
            panic!("a crate table row without three cells: {line}");
        };
        let name = name.trim_matches('`').to_owned();
        let mut allowed = BTreeSet::new();
        for item in deps.split(',').map(str::trim) {
            match item {
                "—" | "-" | "" => {}
                "all of the above" => allowed.extend(above.iter().cloned()),
                short => {
                    let short = short.trim_matches('`');
                    let full = [short.to_owned(), format!("module-{short}")]
                        .into_iter()
                        .find(|n| workspace.contains(n))
                        .unwrap_or_else(|| {
                            panic!(
                                "the row of `{name}` names `{short}`, which is no workspace crate"
                            )
                        });
                    allowed.insert(full);
                }
            }
        }
        above.push(name.clone());
        let folder = folder.trim_matches('`').to_owned();
        assert!(
            rows.insert(name.clone(), Row { folder, allowed }).is_none(),
            "two rows for `{name}`"
        );
    }
    rows
}

/// The workspace's crates, from `cargo metadata --no-deps`.
fn workspace_packages() -> BTreeMap<String, Package> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .expect("running cargo metadata");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let text = |v: &serde_json::Value, key: &str| -> String {
        v[key]
            .as_str()
            .unwrap_or_else(|| panic!("`{key}` is not a string in {v}"))
            .to_owned()
    };
    let workspace_root = PathBuf::from(text(&metadata, "workspace_root"));
    let packages = metadata["packages"]
        .as_array()
        .expect("`packages` is a list");
    let names: BTreeSet<String> = packages.iter().map(|p| text(p, "name")).collect();
    packages
        .iter()
        .map(|p| {
            let manifest = PathBuf::from(text(p, "manifest_path"));
            let dir = manifest.parent().unwrap();
            let folder = dir.strip_prefix(&workspace_root).unwrap();
            let depends_on = p["dependencies"]
                .as_array()
                .expect("`dependencies` is a list")
                .iter()
                .filter(|d| d["kind"].as_str() != Some("dev"))
                .map(|d| text(d, "name"))
                .filter(|n| names.contains(n))
                .collect();
            let package = Package {
                folder: folder.to_string_lossy().replace('\\', "/"),
                depends_on,
            };
            (text(p, "name"), package)
        })
        .collect()
}

/// Every way the workspace breaks the table's rule, as messages.
fn violations(table: &BTreeMap<String, Row>, packages: &BTreeMap<String, Package>) -> Vec<String> {
    let mut out = Vec::new();
    for (name, package) in packages {
        let is_runtime =
            package.folder == "module-runtime" || package.folder.starts_with("module-runtime/");
        let Some(row) = table.get(name) else {
            if is_runtime {
                out.push(format!(
                    "`{name}` ({}) is a runtime crate without a row in the table",
                    package.folder
                ));
            }
            continue;
        };
        if row.folder != package.folder {
            out.push(format!(
                "the row of `{name}` says folder `{}`, but the crate is in `{}`",
                row.folder, package.folder
            ));
        }
        for dep in package.depends_on.difference(&row.allowed) {
            out.push(format!(
                "`{name}` depends on `{dep}`, which its row does not allow (it allows: {})",
                row.allowed.iter().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
    }
    for name in table.keys().filter(|n| !packages.contains_key(*n)) {
        out.push(format!(
            "the table has a row for `{name}`, which is no workspace crate"
        ));
    }
    out
}

#[test]
fn crates_depend_only_on_what_architecture_md_allows() {
    let doc = std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap();
    let packages = workspace_packages();
    let names = packages.keys().cloned().collect();
    let table = crate_table(&doc, &names);
    assert!(table.contains_key("module-core"), "{table:?}");
    let broken = violations(&table, &packages);
    assert!(
        broken.is_empty(),
        "the crates break docs/ARCHITECTURE.md's crate table:\n  {}",
        broken.join("\n  ")
    );
}

/// The check itself: a dependency the table does not allow, a runtime crate without a row and a
/// row for no crate are each reported.
#[test]
fn the_crate_order_check_reports_what_breaks_the_table() {
    let workspace: BTreeSet<String> = ["module-core", "module-state", "module-derive"]
        .map(str::to_owned)
        .into();
    let doc = "text\n\n| crate | folder | depends on (runtime crates) |\n|---|---|---|\n\
               | `module-core` | `module-runtime/core` | — |\n\
               | `module-state` | `module-runtime/state` | core, derive |\n\
               | `module-gone` | `module-runtime/gone` | all of the above |\n\nmore text";
    let table = crate_table(doc, &workspace);
    assert_eq!(
        table["module-gone"].allowed,
        ["module-core", "module-state"].map(str::to_owned).into()
    );
    let package = |folder: &str, deps: &[&str]| Package {
        folder: folder.to_owned(),
        depends_on: deps.iter().map(|d| d.to_string()).collect(),
    };
    let packages: BTreeMap<String, Package> = [
        (
            "module-core",
            package("module-runtime/core", &["module-state"]),
        ),
        (
            "module-state",
            package("module-runtime/state", &["module-core"]),
        ),
        ("module-new", package("module-runtime/new", &[])),
        ("module-derive", package("module-derive", &[])),
    ]
    .into_iter()
    .map(|(n, p)| (n.to_owned(), p))
    .collect();
    assert_eq!(
        violations(&table, &packages),
        [
            "`module-core` depends on `module-state`, which its row does not allow (it allows: )",
            "`module-new` (module-runtime/new) is a runtime crate without a row in the table",
            "the table has a row for `module-gone`, which is no workspace crate",
        ]
    );
}
