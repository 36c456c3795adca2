use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    #[module(rename = "")]
    fc: Linear,
}

fn main() {}
