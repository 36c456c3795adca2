//! `#[module(paths)]` on generic, const-generic and lifetime-generic types, tuple structs, enums
//! and raw identifiers compiles under `deny(warnings)` (unused path types included), with the
//! user's own `Result`, `Option`, `String` and `Module` in scope.
#![deny(warnings)]
#![allow(dead_code)]

use module_runtime::nn::Linear;

pub struct Result;
pub struct Option;
pub struct String;
pub trait Module {}
pub mod core {}

#[derive(module_runtime::Module)]
#[module(paths)]
struct Stack<const N: usize> {
    layers: [Linear; N],
}

#[derive(module_runtime::Module)]
#[module(paths)]
pub struct Tagged<'a, T, const N: usize> {
    pub inner: T,
    #[module(skip)]
    pub tag: &'a str,
    pub sizes: [usize; N],
    pub r#type: Linear,
}

#[derive(module_runtime::Module)]
#[module(paths)]
struct Unused(Linear, #[module(rename = "LayerNorm")] Linear);

#[derive(module_runtime::Module)]
#[module(paths)]
enum Either<T> {
    Left(T),
    Right { fc: Linear, r#type: Linear },
    Nothing,
}

#[test]
fn compiles_and_runs() {
    let p = Tagged::<'static, Stack<2>, 3>::path();
    assert_eq!(
        p.inner().layers().at(1).weight().as_str(),
        "inner.layers.1.weight"
    );
    assert_eq!(p.r#type().as_str(), "type");
    assert_eq!(Either::<Linear>::path().right_type().as_str(), "type");
    assert_eq!(Either::<Linear>::path().left().bias().as_str(), "bias");
}
