use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    #[module(rename = "dense")]
    #[module(rename = "proj")]
    fc: Linear,
}

fn main() {}
