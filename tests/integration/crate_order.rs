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
use std::path::{Path, PathBuf};
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
    let metadata = json::parse(&String::from_utf8(output.stdout).unwrap());
    let workspace_root = PathBuf::from(metadata.get("workspace_root").as_str());
    let packages = metadata.get("packages").as_array();
    let names: BTreeSet<&str> = packages.iter().map(|p| p.get("name").as_str()).collect();
    packages
        .iter()
        .map(|p| {
            let manifest = Path::new(p.get("manifest_path").as_str());
            let dir = manifest.parent().unwrap();
            let folder = dir.strip_prefix(&workspace_root).unwrap();
            let depends_on = p
                .get("dependencies")
                .as_array()
                .iter()
                .filter(|d| d.get("kind").as_opt_str() != Some("dev"))
                .map(|d| d.get("name").as_str())
                .filter(|n| names.contains(n))
                .map(str::to_owned)
                .collect();
            let package = Package {
                folder: folder.to_string_lossy().replace('\\', "/"),
                depends_on,
            };
            (p.get("name").as_str().to_owned(), package)
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

/// Just enough JSON for `cargo metadata`: objects, arrays, strings (with escapes), numbers,
/// `true`, `false` and `null`. The root package keeps its dev-dependencies to the examples' needs,
/// so it does not take serde_json for this one read.
mod json {
    use std::collections::BTreeMap;

    /// A JSON value.
    #[derive(Debug)]
    pub enum Value {
        Null,
        Bool(bool),
        Number(String),
        String(String),
        Array(Vec<Value>),
        Object(BTreeMap<String, Value>),
    }

    impl Value {
        /// The member `key` of an object (`Null` if absent).
        pub fn get(&self, key: &str) -> &Value {
            match self {
                Value::Object(members) => members.get(key).unwrap_or(&Value::Null),
                other => panic!("`{key}` of a non-object: {other:?}"),
            }
        }

        pub fn as_str(&self) -> &str {
            self.as_opt_str()
                .unwrap_or_else(|| panic!("not a string: {self:?}"))
        }

        pub fn as_opt_str(&self) -> Option<&str> {
            match self {
                Value::String(s) => Some(s),
                _ => None,
            }
        }

        pub fn as_array(&self) -> &[Value] {
            match self {
                Value::Array(items) => items,
                other => panic!("not an array: {other:?}"),
            }
        }
    }

    /// Parses a whole JSON text; panics on malformed input (a test's input).
    pub fn parse(text: &str) -> Value {
        let mut parser = Parser {
            chars: text.chars().collect(),
            at: 0,
        };
        let value = parser.value();
        parser.skip_space();
        assert_eq!(parser.at, parser.chars.len(), "trailing text after JSON");
        value
    }

    struct Parser {
        chars: Vec<char>,
        at: usize,
    }

    impl Parser {
        fn skip_space(&mut self) {
            while self.chars.get(self.at).is_some_and(|c| c.is_whitespace()) {
                self.at += 1;
            }
        }

        fn next(&mut self) -> char {
            let c = *self.chars.get(self.at).expect("unexpected end of JSON");
            self.at += 1;
            c
        }

        fn expect_word(&mut self, word: &str) {
            for expected in word.chars() {
                assert_eq!(self.next(), expected, "malformed JSON literal");
            }
        }

        fn value(&mut self) -> Value {
            self.skip_space();
            match self.chars.get(self.at).copied() {
                Some('{') => {
                    self.at += 1;
                    let mut members = BTreeMap::new();
                    self.skip_space();
                    if self.chars.get(self.at) == Some(&'}') {
                        self.at += 1;
                        return Value::Object(members);
                    }
                    loop {
                        self.skip_space();
                        assert_eq!(self.next(), '"', "an object key must be a string");
                        let key = self.string();
                        self.skip_space();
                        assert_eq!(self.next(), ':', "expected `:` in an object");
                        members.insert(key, self.value());
                        self.skip_space();
                        match self.next() {
                            ',' => continue,
                            '}' => return Value::Object(members),
                            c => panic!("expected `,` or `}}` in an object, found {c:?}"),
                        }
                    }
                }
                Some('[') => {
                    self.at += 1;
                    let mut items = Vec::new();
                    self.skip_space();
                    if self.chars.get(self.at) == Some(&']') {
                        self.at += 1;
                        return Value::Array(items);
                    }
                    loop {
                        items.push(self.value());
                        self.skip_space();
                        match self.next() {
                            ',' => continue,
                            ']' => return Value::Array(items),
                            c => panic!("expected `,` or `]` in an array, found {c:?}"),
                        }
                    }
                }
                Some('"') => {
                    self.at += 1;
                    Value::String(self.string())
                }
                Some('t') => {
                    self.expect_word("true");
                    Value::Bool(true)
                }
                Some('f') => {
                    self.expect_word("false");
                    Value::Bool(false)
                }
                Some('n') => {
                    self.expect_word("null");
                    Value::Null
                }
                Some(c) if c == '-' || c.is_ascii_digit() => {
                    let start = self.at;
                    while self
                        .chars
                        .get(self.at)
                        .is_some_and(|c| matches!(c, '-' | '+' | '.' | 'e' | 'E' | '0'..='9'))
                    {
                        self.at += 1;
                    }
                    Value::Number(self.chars[start..self.at].iter().collect())
                }
                other => panic!("unexpected {other:?} in JSON"),
            }
        }

        /// The rest of a string whose opening quote was read.
        fn string(&mut self) -> String {
            let mut out = String::new();
            loop {
                match self.next() {
                    '"' => return out,
                    '\\' => match self.next() {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        'b' => out.push('\u{8}'),
                        'f' => out.push('\u{c}'),
                        'u' => {
                            let unit = self.hex4();
                            let code = if (0xD800..0xDC00).contains(&unit) {
                                // A surrogate pair: `\uD83D\uDE00`.
                                self.expect_word("\\u");
                                let low = self.hex4();
                                0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                            } else {
                                unit
                            };
                            out.push(char::from_u32(code).unwrap_or('\u{fffd}'));
                        }
                        c => out.push(c), // `\"`, `\\`, `\/`
                    },
                    c => out.push(c),
                }
            }
        }

        fn hex4(&mut self) -> u32 {
            let digits: String = (0..4).map(|_| self.next()).collect();
            u32::from_str_radix(&digits, 16).expect("a \\u escape of four hex digits")
        }
    }

    #[test]
    fn parses_what_cargo_metadata_writes() {
        let v = parse(
            r#" {"a": [1, -2.5e3, true, false, null, {}], "s": "q\"\\\u00e9\ud83d\ude00", "e": []} "#,
        );
        assert_eq!(v.get("s").as_str(), "q\"\\é😀");
        assert_eq!(v.get("a").as_array().len(), 6);
        assert!(matches!(v.get("a").as_array()[1], Value::Number(ref n) if n == "-2.5e3"));
        assert!(matches!(
            v.get("a").as_array()[2..4],
            [Value::Bool(true), Value::Bool(false)]
        ));
        assert!(v.get("e").as_array().is_empty());
        assert!(matches!(v.get("missing"), Value::Null));
    }
}
