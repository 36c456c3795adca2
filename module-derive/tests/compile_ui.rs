//! Compile-fail and compile-pass tests of `#[derive(Module)]` (trybuild).
//!
//! `tests/ui/fail/*.rs` must each fail with exactly the diagnostic in the `.stderr` beside it;
//! `tests/ui/pass/*.rs` must compile. Regenerate the `.stderr` files with
//! `TRYBUILD=overwrite cargo test -p module-derive --test compile_ui`, and read them: they are the user's view.
//!
//! Diagnostics change between compiler releases, so the `.stderr` files are pinned to one
//! toolchain ([`PINNED`]). On any other, the test says so loudly and passes, so that `cargo test`
//! stays green for a user on another compiler.

use std::io::Write;
use std::process::Command;

/// The compiler the `.stderr` files were generated with, as a `rustc --version` prefix.
const PINNED: &str = "rustc 1.95.";

#[test]
fn ui() {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let version = Command::new(&rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|out| {
            let stdout = String::from_utf8_lossy(&out.stdout);
            stdout.lines().next().map(|line| line.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown (`rustc --version` failed)".to_owned());
    if !version.starts_with(PINNED) {
        // Straight to the process's stderr: libtest captures `eprintln!` of a passing test, and
        // this message must be seen.
        let _ = writeln!(
            std::io::stderr(),
            "\n=== SKIPPED: derive UI tests ===\n\
             The .stderr files in module-derive/tests/ui/fail are pinned to `{PINNED}x`, but the compiler is \
             `{version}`.\nCompiler diagnostics differ between releases, so these tests only run \
             on the pinned toolchain.\n================================\n"
        );
        return;
    }
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
