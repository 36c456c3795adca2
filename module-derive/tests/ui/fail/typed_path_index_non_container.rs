use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
#[module(paths)]
struct Net {
    layers: Vec<Linear>,
    head: Linear,
}

fn main() {
    let _ = Net::path().layers().at(0);
    let _ = Net::path().head().at(0);
}
