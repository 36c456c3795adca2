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

/// A convolution with the wrong number of channels: in_channels against the channel dimension and
/// the fix; an input of another rank; an image smaller than the kernel (candle's own arithmetic
/// overflowed on it). An unbatched image is taken, as PyTorch takes it.
#[test]
fn conv_names_in_channels_rank_and_size() {
    use module_runtime::nn::{Conv1d, Conv2d};
    #[derive(Module)]
    struct Net {
        stem: Conv2d,
    }
    impl Forward<&Tensor> for Net {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.stem.call(x)
        }
    }
    let dev = Device::Cpu;
    let net = Net {
        stem: Conv2d::new(3, 8, 3, &dev).unwrap(),
    };
    let z = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &dev).unwrap();
    let err = net.call(&z(&[1, 4, 8, 8])).unwrap_err();
    assert_eq!(printed(&err).1, "stem");
    assert_eq!(
        err.inner().to_string(),
        "Conv2d: expected an input of shape [N, 3, …] or [3, …] (2 spatial dimensions), got \
         [1, 4, 8, 8]: \
         in_channels = 3, got 4 channels (dimension 1): give it 3 channels, or make the layer \
         with in_channels = 4 (`Conv2d::new(4, 8, ..)`)"
    );
    let err = net.call(&z(&[1, 1, 3, 8, 8])).unwrap_err().to_string();
    assert!(
        err.contains("got [1, 1, 3, 8, 8]: it has 5 dimensions"),
        "{err}"
    );
    // One image without its batch dimension is PyTorch's unbatched input: `[C, H, W]`.
    assert_eq!(net.call(&z(&[3, 8, 8])).unwrap().dims(), [8, 6, 6]);
    let err = net.call(&z(&[1, 3, 2, 8])).unwrap_err().to_string();
    assert!(
        err.contains("spatial dimension 0 is 2 (2 padded), smaller than the kernel's span 3"),
        "{err}"
    );
    let conv1 = Conv1d::new(2, 4, 3, &dev).unwrap();
    let err = conv1.call(&z(&[1, 5, 9])).unwrap_err().to_string();
    assert!(err.contains("`Conv1d::new(5, 4, ..)`"), "{err}");
}

/// An id past the table: the range, the id and the fix, where candle said "index-select invalid
/// index 12 with dim size 10".
#[test]
fn embedding_names_the_id_out_of_range() {
    #[derive(Module)]
    struct Lm {
        embed_tokens: Embedding,
    }
    impl Forward<&Tensor> for Lm {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.embed_tokens.call(x)
        }
    }
    let dev = Device::Cpu;
    let lm = Lm {
        embed_tokens: Embedding::new(10, 4, &dev).unwrap(),
    };
    let err = lm
        .call(&Tensor::new(&[[1u32, 12], [3, 4]], &dev).unwrap())
        .unwrap_err();
    assert_eq!(printed(&err).1, "embed_tokens");
    assert_eq!(
        err.inner().to_string(),
        "Embedding: ids must be in 0..10 (num_embeddings = 10), got 12: make the table larger \
         (`Embedding::new(13, 4, ..)`), or check that the ids come from the vocabulary the model \
         was made for"
    );
    let err = lm
        .call(&Tensor::new(&[-1i64, 2], &dev).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ids must be in 0..10 (num_embeddings = 10), got -1"),
        "{err}"
    );
}

/// Attention inputs of another width: which tensor, embed_dim against its last dimension, the fix.
#[test]
fn attention_names_embed_dim_and_the_tensor() {
    use module_runtime::nn::{AttentionInput, MultiheadAttention};
    let dev = Device::Cpu;
    let mha = MultiheadAttention::new(8, 2, &dev).unwrap();
    let x = Tensor::zeros((5, 2, 6), DType::F32, &dev).unwrap();
    let err = mha.call(&x).unwrap_err();
    assert_eq!(
        err.inner().to_string(),
        "MultiheadAttention: query [5, 2, 6]: expected embed_dim = 8, got 6 (last dimension): give \
         it inputs of width 8, or make the layer `MultiheadAttention::new(6, 2, ..)`"
    );
    let q = Tensor::zeros((5, 2, 8), DType::F32, &dev).unwrap();
    let kv = Tensor::zeros((4, 8), DType::F32, &dev).unwrap();
    let err = mha
        .call(AttentionInput::new(&q, &kv, &kv))
        .unwrap_err()
        .to_string();
    assert!(err.contains("key [4, 8]: expected [L, B, E]"), "{err}");
}

/// A shape a layer does not take says what to change: the missing batch dimension of a single
/// sample, or the dimension whose size the layer fixes.
#[test]
fn input_shape_errors_say_what_to_change() {
    use module_runtime::nn::BatchNorm2d;
    let dev = Device::Cpu;
    let bn = BatchNorm2d::new(3, &dev).unwrap();
    let single = Tensor::zeros((3, 4, 4), DType::F32, &dev).unwrap();
    let err = bn.call(&single).unwrap_err().to_string();
    assert!(
        err.contains("one dimension short; for a single sample add the batch dimension (`x.unsqueeze(0)?`, giving [1, 3, 4, 4])"),
        "{err}"
    );
    let channels = Tensor::zeros((2, 4, 5, 5), DType::F32, &dev).unwrap();
    let err = bn.call(&channels).unwrap_err().to_string();
    assert!(
        err.contains("dimension 1 is 4, the layer takes 3; give it inputs of that size, or build the layer for this one"),
        "{err}"
    );
}
