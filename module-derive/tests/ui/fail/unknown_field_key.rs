use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    #[module(skipp)]
    fc: Linear,
}

fn main() {}
