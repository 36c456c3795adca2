//! What the derive costs a user's build: the time to expand it and the size of what it emits, for
//! a 200-field struct and for every derive in the workspace's BERT model (`src/bert.rs`).
//!
//! A measurement, not a test: it is ignored by default and asserts nothing about time. Run it with
//!
//! ```text
//! cargo test -p module-derive --release expansion_cost -- --ignored --nocapture
//! ```

use std::time::{Duration, Instant};

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use crate::expand;

/// Expands `inputs` `rounds` times; returns the mean time of one round and the pretty-printed
/// size (lines, bytes) of one round's output.
fn measure(inputs: &[TokenStream], rounds: u32) -> (Duration, usize, usize) {
    let started = Instant::now();
    for _ in 0..rounds {
        for input in inputs {
            std::hint::black_box(expand::derive(input.clone()));
        }
    }
    let per_round = started.elapsed() / rounds;
    let mut text = String::new();
    for input in inputs {
        let file: syn::File = syn::parse2(expand::derive(input.clone())).expect("a valid file");
        text.push_str(&prettyplease::unparse(&file));
    }
    (per_round, text.lines().count(), text.len())
}

#[test]
#[ignore = "a measurement; run with --ignored --nocapture"]
fn expansion_cost() {
    let fields = (0..200).map(|i| {
        let name = format_ident!("field_{i}");
        match i % 4 {
            0 => quote!(#name: Linear),
            1 => quote!(#name: Option<Param>),
            2 => quote!(#name: Vec<Block>),
            _ => quote!(#name: usize),
        }
    });
    let wide = quote! {
        struct Wide { #(#fields,)* }
    };
    let (time, lines, bytes) = measure(&[wide], 200);
    println!("200-field struct: {time:?} per expansion, {lines} lines / {bytes} bytes emitted");

    let bert = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../src/bert.rs"))
        .expect("src/bert.rs");
    let bert: syn::File = syn::parse_str(&bert).expect("src/bert.rs parses");
    let derived: Vec<TokenStream> = bert
        .items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Struct(s) => Some(quote!(#s)),
            syn::Item::Enum(e) => Some(quote!(#e)),
            _ => None,
        })
        .filter(|tokens| tokens.to_string().contains("derive (Module)"))
        .collect();
    let (time, lines, bytes) = measure(&derived, 200);
    println!(
        "BERT model ({} derived types): {time:?} for all expansions, {lines} lines / {bytes} bytes emitted",
        derived.len()
    );
}
