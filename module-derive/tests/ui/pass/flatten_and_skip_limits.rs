//! What the `skip` and `flatten` checks let through: `skip` on types that hold no tensor
//! (`PhantomData<Param>` holds none), and `flatten` on containers that name their elements.
use std::marker::PhantomData;

use module_runtime::{Module, ModuleExt, Param};

#[derive(Module)]
struct Net {
    #[module(flatten)]
    weights: Vec<Param>,
    #[module(skip)]
    marker: PhantomData<Param>,
}

#[test]
fn compiles_and_runs() {
    let dev = module_runtime::candle_core::Device::Cpu;
    let w = |n| {
        Param::new(
            module_runtime::candle_core::Tensor::zeros(
                n,
                module_runtime::candle_core::DType::F32,
                &dev,
            )
            .unwrap(),
        )
        .unwrap()
    };
    let net = Net {
        weights: vec![w(2), w(3)],
        marker: PhantomData,
    };
    let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0", "1"]);
}
