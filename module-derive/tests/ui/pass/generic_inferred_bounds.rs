//! Bounds are inferred per field type: `T: Module`, `Vec<U>: Module`; a skipped `S` only needs to
//! be `Send + Sync + 'static`.
use module_runtime::nn::Linear;
use module_runtime::{Module, ModuleExt};

#[derive(Module)]
struct Wrapper<T, U, S> {
    inner: T,
    layers: Vec<U>,
    #[module(skip)]
    note: S,
}

#[test]
fn compiles_and_runs() {
    let dev = module_runtime::candle_core::Device::Cpu;
    let w = Wrapper {
        inner: Linear::no_bias(2, 2, &dev).unwrap(),
        layers: vec![Linear::no_bias(2, 2, &dev).unwrap()],
        note: "S is only Send + Sync + 'static",
    };
    let names: Vec<String> = w.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["inner.weight", "layers.0.weight"]);
}
