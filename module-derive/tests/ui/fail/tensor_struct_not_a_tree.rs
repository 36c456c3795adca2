use module_runtime::candle_core::Tensor;
use module_runtime::TensorStruct;

struct Config {
    steps: u32,
}

#[derive(TensorStruct)]
struct Output {
    logits: Tensor,
    config: Config,
    #[tensor(skip)]
    other: Config,
}

fn main() {}
