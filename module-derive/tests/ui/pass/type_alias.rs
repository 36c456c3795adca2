//! Fields are classified by trait, so aliases and re-exports of runtime layers just work.
use module_runtime::{Module, ModuleExt};

type Proj = module_runtime::nn::Linear;
type Layers = Vec<Proj>;

mod reexport {
    pub use module_runtime::nn::Linear as Dense;
}

#[derive(Module)]
struct Net {
    proj: Proj,
    layers: Layers,
    dense: reexport::Dense,
}

#[test]
fn compiles_and_runs() {
    let dev = module_runtime::candle_core::Device::Cpu;
    let net = Net {
        proj: Proj::no_bias(2, 2, &dev).unwrap(),
        layers: vec![Proj::no_bias(2, 2, &dev).unwrap()],
        dense: reexport::Dense::no_bias(2, 2, &dev).unwrap(),
    };
    let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["proj.weight", "layers.0.weight", "dense.weight"]);
}
