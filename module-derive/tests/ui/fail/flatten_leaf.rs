use std::sync::Arc;

use module_runtime::nn::Linear;
use module_runtime::{Buffer, Module, Param};

// A leaf has no children to lift: flattening one would drop it from every list and checkpoint.
#[derive(Module)]
struct Net {
    #[module(flatten)]
    weight: Param,
    #[module(flatten)]
    scale: Option<Buffer>,
    #[module(flatten)]
    shared: Arc<Param>,
    fc: Linear,
}

fn main() {}
