//! What the derive costs a user's build: the time to expand it and the size of what it emits, for
//! a 200-field struct and for a real model's derives (a BERT encoder's, [`bert_model`]).
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
    let wide_paths = with_paths(&wide);
    let (time, lines, bytes) = measure(&[wide], 200);
    println!("200-field struct: {time:?} per expansion, {lines} lines / {bytes} bytes emitted");
    let (time, lines, bytes) = measure(&[wide_paths], 200);
    println!(
        "200-field struct with #[module(paths)]: {time:?} per expansion, {lines} lines / {bytes} bytes emitted"
    );
    let derived = bert_model();
    let derived_paths: Vec<_> = derived.iter().map(with_paths).collect();
    let (time, lines, bytes) = measure(&derived, 200);
    println!(
        "BERT model ({} derived types): {time:?} for all expansions, {lines} lines / {bytes} bytes emitted",
        derived.len()
    );
    let (time, lines, bytes) = measure(&derived_paths, 200);
    println!(
        "BERT model with #[module(paths)]: {time:?} for all expansions, {lines} lines / {bytes} bytes emitted"
    );
}

/// The same input with `#[module(paths)]` (the typed path type and its methods).
fn with_paths(input: &TokenStream) -> TokenStream {
    quote!(#[module(paths)] #input)
}

/// The derived types of a BERT encoder, as the derive sees them (the type headers; doc comments
/// left out): the nine structs of `minilm/src/bert.rs`, Hugging Face's `BertModel`. A copy, so the
/// measurement stays put when that model changes and the derive crate reads no file outside itself.
fn bert_model() -> Vec<TokenStream> {
    vec![
        quote! {
            #[derive(Module)]
            pub struct BertEmbeddings {
                pub word_embeddings: Embedding,
                pub position_embeddings: Embedding,
                pub token_type_embeddings: Embedding,
                #[module(rename = "LayerNorm")]
                pub layer_norm: LayerNorm,
                pub dropout: Dropout,
                pub position_ids: Buffer,
            }
        },
        quote! {
            #[derive(Module)]
            pub struct BertSelfAttention {
                pub query: Linear,
                pub key: Linear,
                pub value: Linear,
                pub dropout: Dropout,
                pub num_heads: usize,
            }
        },
        quote! {
            #[derive(Module)]
            pub struct BertAttention {
                #[module(rename = "self")]
                pub self_attention: BertSelfAttention,
                pub output: BertOutput,
            }
        },
        quote! {
            #[derive(Module)]
            pub struct BertIntermediate {
                pub dense: Linear,
                pub activation: GELU,
            }
        },
        quote! {
            #[derive(Module)]
            pub struct BertOutput {
                pub dense: Linear,
                #[module(rename = "LayerNorm")]
                pub layer_norm: LayerNorm,
                pub dropout: Dropout,
            }
        },
        quote! {
            #[derive(Module)]
            pub struct BertLayer {
                pub attention: BertAttention,
                pub intermediate: BertIntermediate,
                pub output: BertOutput,
            }
        },
        quote! {
            #[derive(Module)]
            pub struct BertEncoder {
                pub layer: Vec<BertLayer>,
            }
        },
        quote! {
            #[derive(Module)]
            pub struct BertPooler {
                pub dense: Linear,
            }
        },
        quote! {
            #[derive(Module)]
            pub struct BertModel {
                pub embeddings: BertEmbeddings,
                pub encoder: BertEncoder,
                pub pooler: BertPooler,
            }
        },
    ]
}
