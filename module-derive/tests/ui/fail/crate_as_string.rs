use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
#[module(crate = "module_runtime")]
struct Net {
    fc: Linear,
}

fn main() {}
