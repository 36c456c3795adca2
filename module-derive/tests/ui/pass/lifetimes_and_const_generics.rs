//! Lifetimes and const generics pass through.
use module_runtime::nn::Linear;
use module_runtime::{Module, ModuleExt};

#[derive(Module)]
struct Stack<const N: usize> {
    layers: [Linear; N],
}

#[derive(Module)]
struct Tagged<'a, T, const N: usize> {
    inner: T,
    #[module(skip)]
    tag: &'a str,
    sizes: [usize; N],
}

#[test]
fn compiles_and_runs() {
    let dev = module_runtime::candle_core::Device::Cpu;
    let stack = Stack::<2> {
        layers: [
            Linear::no_bias(2, 2, &dev).unwrap(),
            Linear::no_bias(2, 2, &dev).unwrap(),
        ],
    };
    let tagged: Tagged<'static, Stack<2>, 3> = Tagged {
        inner: stack,
        tag: "stack",
        sizes: [1, 2, 3],
    };
    let names: Vec<String> = tagged
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["inner.layers.0.weight", "inner.layers.1.weight"]);
}
