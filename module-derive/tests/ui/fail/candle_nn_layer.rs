use module_runtime::candle_nn;
use module_runtime::Module;

#[derive(Module)]
struct Net {
    fc: candle_nn::Linear,
    norm: candle_nn::RmsNorm,
}

fn main() {}
