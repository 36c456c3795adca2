//! Tuple-struct fields are named by position; a unit struct has no children.
use module_runtime::nn::Linear;
use module_runtime::{Module, ModuleExt};

#[derive(Module)]
struct Pair(
    Linear,
    #[module(rename = "second")] Linear,
    #[module(skip)] f32,
);

#[derive(Module)]
struct Identity;

#[derive(Module)]
struct Net {
    pair: Pair,
    id: Identity,
}

#[test]
fn compiles_and_runs() {
    let dev = module_runtime::candle_core::Device::Cpu;
    let net = Net {
        pair: Pair(
            Linear::no_bias(2, 2, &dev).unwrap(),
            Linear::no_bias(2, 2, &dev).unwrap(),
            0.5,
        ),
        id: Identity,
    };
    let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["pair.0.weight", "pair.second.weight"]);
}
