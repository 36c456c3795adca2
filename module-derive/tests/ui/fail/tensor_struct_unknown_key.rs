use module_runtime::candle_core::Tensor;
use module_runtime::TensorStruct;

#[derive(TensorStruct)]
struct Output {
    #[tensor(rename = "x")]
    logits: Tensor,
}

fn main() {}
