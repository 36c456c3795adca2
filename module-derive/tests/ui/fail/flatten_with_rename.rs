use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    #[module(flatten, rename = "inner")]
    fc: Linear,
}

fn main() {}
