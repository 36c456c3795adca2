//! `#[module(bound = "...")]` replaces the inferred bounds.
use module_runtime::nn::Linear;
use module_runtime::{Module, ModuleExt};

pub trait Backbone {
    type Layer;
}

pub struct Small;

impl Backbone for Small {
    type Layer = Linear;
}

#[derive(Module)]
#[module(bound = "B::Layer: Module, B: Send + Sync")]
struct Net<B: Backbone> {
    body: B::Layer,
    #[module(skip)]
    marker: std::marker::PhantomData<B>,
}

#[test]
fn compiles_and_runs() {
    let dev = module_runtime::candle_core::Device::Cpu;
    let net = Net::<Small> {
        body: Linear::new(2, 2, &dev).unwrap(),
        marker: std::marker::PhantomData,
    };
    assert_eq!(net.named_parameters().len(), 2);
}
