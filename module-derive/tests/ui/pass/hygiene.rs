//! The expansion names nothing through the user's scope: it compiles under `deny(warnings)` with
//! the user's own `Result`, `Option`, `Ok`, `Some`, `Module` and `Param` in scope.
#![deny(warnings)]
#![allow(dead_code)]

use module_runtime::nn::Linear;

pub struct Result;
pub struct Option;
pub struct Param;
pub trait Module {}
#[allow(non_snake_case)]
pub fn Ok() {}
#[allow(non_snake_case)]
pub fn Some() {}
pub struct Name;
pub struct Child;
pub struct ChildMut;
pub mod core {}

#[derive(module_runtime::Module)]
struct Net {
    fc: Linear,
    #[module(rename = "LayerNorm")]
    norm: Linear,
    r#type: Linear,
    #[module(skip)]
    note: Result,
}

#[derive(module_runtime::Module)]
struct Tuple(Linear, #[module(skip)] Option);

#[derive(module_runtime::Module)]
enum Head<T> {
    Plain(T),
    Named { proj: Linear, extra: T },
    Empty,
}

#[derive(module_runtime::Module)]
struct Unit;

#[derive(module_runtime::Module)]
struct Empty {}

#[derive(module_runtime::Module)]
enum OnlySkipped {
    Config(#[module(skip)] Option),
    Named {
        #[module(skip)]
        config: Result,
    },
}

#[derive(module_runtime::Module)]
struct Generic<T, const N: usize> {
    heads: [Head<T>; N],
    #[module(flatten)]
    net: Net,
}

#[test]
fn compiles_and_runs() {
    Ok();
    Some();
}
