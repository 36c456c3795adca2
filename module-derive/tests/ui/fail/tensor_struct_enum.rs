use module_runtime::candle_core::Tensor;
use module_runtime::TensorStruct;

#[derive(TensorStruct)]
enum Output {
    Logits(Tensor),
    Loss(Tensor),
}

fn main() {}
