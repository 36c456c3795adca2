//! Expansion snapshots: representative inputs go through [`expand::derive`] in-process, are
//! formatted with `prettyplease`, and must match `tests/snapshots/NAME.expanded.rs`.
//!
//! A change to the generated code shows up here as a readable diff (expect-test's). After an
//! intended change, regenerate with `UPDATE_EXPECT=1 cargo test -p module-derive` and review the
//! files' diff.

use std::path::PathBuf;

use expect_test::expect_file;
use proc_macro2::TokenStream;
use quote::quote;

use crate::expand;

/// Expands `input`, pretty-prints it, and compares it with (or, under `UPDATE_EXPECT=1`, writes)
/// the snapshot `name`.
fn assert_snapshot(name: &str, input: TokenStream) {
    let expanded = expand::derive(input);
    let file: syn::File = syn::parse2(expanded.clone()).unwrap_or_else(|e| {
        panic!("the expansion of `{name}` is not a valid file: {e}\n{expanded}")
    });
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(format!("{name}.expanded.rs"));
    expect_file![path].assert_eq(&prettyplease::unparse(&file));
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

/// `#[module(paths)]`: the path type, its glue impls and one method per field (renamed,
/// flattened, skipped).
#[test]
fn typed_paths() {
    assert_snapshot(
        "typed_paths",
        quote! {
            #[module(paths)]
            pub struct Block {
                #[module(rename = "LayerNorm")]
                norm: LayerNorm,
                layers: Vec<Linear>,
                #[module(flatten)]
                inner: Inner,
                #[module(skip)]
                cache: usize,
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

/// A generic type whose field is a bare type parameter: its class name shows that argument's
/// (`Block<Conv2d>`).
#[test]
fn generic_class_name() {
    assert_snapshot(
        "generic_class_name",
        quote! {
            struct Block<L, S> {
                layer: L,
                #[module(skip)]
                scale: S,
            }
        },
    );
}

/// `#[module(class_name = ...)]`: the expression, using the type's parameters.
#[test]
fn class_name_attribute() {
    assert_snapshot(
        "class_name_attribute",
        quote! {
            #[module(class_name = format!("Conv{D}d"))]
            struct Conv<const D: usize> {
                weight: Param,
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

/// `#[derive(TensorStruct)]`: named, skipped and generic fields.
#[test]
fn tensor_struct() {
    let input = quote! {
        struct Encoded<T> {
            hidden: Tensor,
            pooled: Option<T>,
            #[tensor(skip)]
            lengths: Vec<usize>,
        }
    };
    let expanded = crate::tensor_struct::derive(input);
    let file: syn::File = syn::parse2(expanded).expect("a valid file");
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/tensor_struct.expanded.rs");
    expect_file![path].assert_eq(&prettyplease::unparse(&file));
}
