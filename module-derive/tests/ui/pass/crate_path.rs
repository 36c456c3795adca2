//! `#[module(crate = ...)]` for a runtime reached through another path.
use module_runtime as mr;

mod nested {
    pub use module_runtime as runtime;
}

#[derive(mr::Module)]
#[module(crate = mr)]
struct Net {
    fc: mr::nn::Linear,
}

#[derive(nested::runtime::Module)]
#[module(crate = crate::pass::crate_path::nested::runtime)]
struct Outer {
    net: Net,
}

#[test]
fn compiles_and_runs() {
    use mr::ModuleExt;
    let dev = mr::candle_core::Device::Cpu;
    let outer = Outer {
        net: Net {
            fc: mr::nn::Linear::no_bias(2, 2, &dev).unwrap(),
        },
    };
    assert_eq!(outer.named_parameters()[0].0, "net.fc.weight");
}
