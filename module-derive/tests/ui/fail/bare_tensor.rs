use module_runtime::candle_core::Tensor;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    weight: Tensor,
}

fn main() {}
