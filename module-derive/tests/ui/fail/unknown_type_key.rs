use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
#[module(transparent)]
struct Net {
    fc: Linear,
}

fn main() {}
