//! Expansion snapshots: representative inputs go through [`expand::derive`] in-process, are
//! formatted with `prettyplease`, and must match `tests/snapshots/NAME.expanded.rs`.
//!
//! A change to the generated code shows up here as a readable diff. After an intended change,
//! regenerate with `UPDATE_SNAPSHOTS=1 cargo test -p module-derive` and review the files.

use std::path::PathBuf;

use proc_macro2::TokenStream;
use quote::quote;

use crate::expand;

/// Expands `input`, pretty-prints it, and compares it with (or, under `UPDATE_SNAPSHOTS=1`,
/// writes) the snapshot `name`.
fn assert_snapshot(name: &str, input: TokenStream) {
    let expanded = expand::derive(input);
    let file: syn::File = syn::parse2(expanded.clone()).unwrap_or_else(|e| {
        panic!("the expansion of `{name}` is not a valid file: {e}\n{expanded}")
    });
    let actual = prettyplease::unparse(&file);
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(format!("{name}.expanded.rs"));
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "no snapshot at {} ({e}); create it with UPDATE_SNAPSHOTS=1",
            path.display()
        )
    });
    if actual != expected {
        panic!(
            "the expansion of `{name}` differs from {}; if the change is intended, rerun with \
             UPDATE_SNAPSHOTS=1 and review the diff\n{}",
            path.display(),
            line_diff(&expected, &actual)
        );
    }
}

/// A line diff (longest common subsequence): `-` lines are the snapshot's, `+` lines are the
/// expansion's, and unchanged lines are left out. Snapshots are a few hundred lines at most, so the
/// quadratic table is no concern.
fn line_diff(expected: &str, actual: &str) -> String {
    let (old, new): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    // common[i][j]: the length of the longest common subsequence of old[i..] and new[j..].
    let mut common = vec![vec![0usize; new.len() + 1]; old.len() + 1];
    for i in (0..old.len()).rev() {
        for j in (0..new.len()).rev() {
            common[i][j] = if old[i] == new[j] {
                common[i + 1][j + 1] + 1
            } else {
                common[i + 1][j].max(common[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < old.len() || j < new.len() {
        if i < old.len() && j < new.len() && old[i] == new[j] {
            (i, j) = (i + 1, j + 1);
        } else if i < old.len() && (j == new.len() || common[i + 1][j] >= common[i][j + 1]) {
            out += &format!("{:>4} - {}\n", i + 1, old[i]);
            i += 1;
        } else {
            out += &format!("{:>4} + {}\n", j + 1, new[j]);
            j += 1;
        }
    }
    out
}

#[test]
fn plain_struct() {
    assert_snapshot(
        "plain_struct",
        quote! {
            struct Mlp {
                fc1: Linear,
                fc2: Linear,
                dropout: f64,
            }
        },
    );
}

#[test]
fn tuple_and_unit_structs() {
    assert_snapshot(
        "tuple_struct",
        quote!(
            struct Pair(Linear, Linear);
        ),
    );
    assert_snapshot(
        "unit_struct",
        quote!(
            struct Identity;
        ),
    );
}

#[test]
fn generic_struct_with_inferred_bounds() {
    assert_snapshot(
        "generic_struct",
        quote! {
            struct Encoder<'a, T, U: Clone, const N: usize> {
                layers: Vec<T>,
                head: Option<U>,
                norms: [LayerNorm; N],
                #[module(skip)]
                config: &'a T,
            }
        },
    );
}

#[test]
fn explicit_bound() {
    assert_snapshot(
        "explicit_bound",
        quote! {
            #[module(bound = "B::Layer: Module")]
            struct Net<B: Backbone> {
                body: B::Layer,
            }
        },
    );
}

#[test]
fn enum_with_every_variant_kind() {
    assert_snapshot(
        "enum_variants",
        quote! {
            enum Head {
                Linear(Linear),
                Pair(Linear, #[module(skip)] usize),
                Scaled { proj: Linear, #[module(rename = "gamma")] scale: Param },
                Identity,
            }
        },
    );
}

#[test]
fn rename_flatten_skip() {
    assert_snapshot(
        "rename_flatten_skip",
        quote! {
            struct Block {
                #[module(rename = "LayerNorm")]
                norm: LayerNorm,
                #[module(flatten)]
                attention: Attention,
                #[module(skip)]
                activation: Activation,
                r#type: Linear,
            }
        },
    );
}

#[test]
fn crate_path() {
    assert_snapshot(
        "crate_path",
        quote! {
            #[module(crate = mr)]
            struct Net {
                fc: mr::nn::Linear,
            }
        },
    );
}

#[test]
fn errors_then_stub_impl() {
    assert_snapshot(
        "errors_stub",
        quote! {
            #[module(crate = mr, transparent)]
            struct Net<T> {
                #[module(skip, rename = "x")]
                inner: T,
                #[module(skip)]
                weight: Param,
            }
        },
    );
}
