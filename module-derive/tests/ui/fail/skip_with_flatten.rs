use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    #[module(skip, flatten)]
    fc: Linear,
}

fn main() {}
