use std::sync::Arc;

use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
#[module(paths)]
struct Net {
    shared: Arc<Linear>,
}

fn main() {
    let mut net = Net { shared: Arc::new(Linear::new(2, 2, &module_runtime::candle_core::Device::Cpu).unwrap()) };
    // A module shared through an `Arc` has no `&mut`.
    let _ = net.get_mut(Net::path().shared());
}
