use module_runtime::nn::Linear;
use module_runtime::Module;

#[derive(Module)]
struct Block {
    fc: Linear,
}

#[derive(Module)]
#[module(paths)]
struct Net {
    block: Block,
}

fn main() {}
