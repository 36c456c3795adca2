use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
#[module(paths)]
struct Attention {
    query: Linear,
    key: Linear,
}

#[derive(Module)]
#[module(paths)]
struct Layer {
    attention: Attention,
}

fn main() {
    let _ = Layer::path().attention().qeury();
}
