//! The README's "Training" example is the crate's doctest (README blocks are not compiled): the two
//! must stay the same code.

use std::path::Path;

#[test]
fn the_readme_training_example_is_the_crate_doctest() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("../../README.md")).unwrap();
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let section = &readme[readme.find("\n## Training\n").expect("a Training section")..];
    let start = section.find("```rust\n").expect("a rust block") + "```rust\n".len();
    let block = &section[start..start + section[start..].find("\n```").unwrap()];
    let as_doc: String = block
        .lines()
        .map(|l| {
            if l.is_empty() {
                "//!\n".to_owned()
            } else {
                format!("//! {l}\n")
            }
        })
        .collect();
    assert!(
        lib.contains(&format!("//! ```\n{as_doc}//! ```\n")),
        "README.md's Training block and src/lib.rs's doctest differ"
    );
}
