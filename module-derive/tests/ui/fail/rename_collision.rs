use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    query: Linear,
    #[module(rename = "query")]
    key: Linear,
}

fn main() {}
