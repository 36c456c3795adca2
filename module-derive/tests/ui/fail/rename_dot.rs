use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    #[module(rename = "encoder.fc")]
    fc: Linear,
}

fn main() {}
