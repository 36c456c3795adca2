//! Graded boundary messages: an input a layer cannot take is an error that names the layer's path,
//! what it expected and what it got, and what to change. One test per message.

use module_runtime::nn::Embedding;
use module_runtime::prelude::*;
use module_runtime::Error;

#[derive(Module)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Forward<&Tensor> for Mlp {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.fc1.call(x)?.relu()?)
    }
}

fn mlp() -> Mlp {
    let dev = Device::Cpu;
    Mlp {
        fc1: Linear::new(20, 64, &dev).unwrap(),
        fc2: Linear::new(64, 4, &dev).unwrap(),
    }
}

/// What `main` prints for an error (`Debug`), and its path.
fn printed(err: &Error) -> (String, String) {
    let path = match err {
        Error::Forward { path, .. } => path.clone(),
        other => panic!("expected a forward error, got {other}"),
    };
    (format!("{err:?}"), path)
}

/// `[8, 16]` into `Linear(20, 64)`: in_features against the input's last dimension, not candle's
/// product error with the transposed weight's shape.
#[test]
fn linear_names_in_features_and_the_last_dimension() {
    let x = Tensor::zeros((8, 16), DType::F32, &Device::Cpu).unwrap();
    let err = mlp().call(&x).unwrap_err();
    let (text, path) = printed(&err);
    assert_eq!(path, "fc1");
    assert!(matches!(
        err.inner(),
        Error::InvalidInput {
            layer: "Linear",
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        "forward of `fc1` (Linear) failed: Linear: expected in_features = 20, got 16 (last \
         dimension of the input [8, 16]): give it inputs of shape [.., 20], or make the layer \
         `Linear::new(16, 64, ..)`"
    );
    assert!(!text.contains("matmul"), "{text}");
    // A quantized weight checks the same.
    let model = Linear::new(64, 8, &Device::Cpu).unwrap();
    let report = quantize(&model, "**", GgmlDType::Q8_0).unwrap();
    assert!(model.weight.is_quantized(), "{report:?}");
    let err = model.call(&x).unwrap_err();
    assert!(
        err.to_string()
            .contains("expected in_features = 64, got 16"),
        "{err}"
    );
}

/// Token ids (integers) into a float model: convert them, or look them up in an `Embedding`;
/// never "convert the model to U32", which cannot be.
#[test]
fn integer_input_advises_converting_it_or_an_embedding() {
    let ids = Tensor::zeros((8, 20), DType::U32, &Device::Cpu).unwrap();
    let err = mlp().call(&ids).unwrap_err();
    let (text, path) = printed(&err);
    assert_eq!(path, "fc1");
    assert!(matches!(
        err.inner(),
        Error::InputDType {
            input: DType::U32,
            params: DType::F32,
            ..
        }
    ));
    assert!(
        text.contains(
            "the input is U32 and the parameters F32: convert the input \
             (`x.to_dtype(DType::F32)?`); if it holds token or class ids, look them up with an \
             `Embedding` layer first"
        ),
        "{text}"
    );
    assert!(!text.contains("model.to_dtype"), "{text}");
    // The advice works: ids through an `Embedding` first.
    let emb = Embedding::new(10, 20, &Device::Cpu).unwrap();
    let ids = Tensor::zeros(8, DType::U32, &Device::Cpu).unwrap();
    let y = mlp().call(&emb.call(&ids).unwrap()).unwrap();
    assert_eq!(y.dims(), [8, 4]);
}
