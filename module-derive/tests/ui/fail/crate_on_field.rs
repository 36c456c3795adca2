use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    #[module(crate = module_runtime)]
    fc: Linear,
}

fn main() {}
