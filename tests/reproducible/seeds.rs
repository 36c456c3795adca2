//! `manual_seed`: every runtime initializer, dropout mask and random activation repeats under the
//! same seed and changes under another; the generator's state restores its draws.

use module_runtime::candle_core::Var;
use module_runtime::nn::functional::{scaled_dot_product_attention, SdpaOptions};
use module_runtime::nn::{
    Conv2d, Dropout, Dropout2d, Embedding, LazyLinear, Lstm, MultiheadAttention,
    MultiheadAttentionConfig, RReLU, RnnConfig, Transformer, TransformerConfig,
};
use module_runtime::prelude::*;
use module_runtime::{get_rng_state, initial_seed, set_rng_state};

use super::{bits, serial, Bits};

/// One of each kind of initializer: PyTorch's fan-in uniform (`Linear`, `Conv2d`, `Lstm`), the
/// normal (`Embedding`), Xavier (`MultiheadAttention`'s packed projection, `Transformer`'s reset),
/// and a lazy layer built after the others.
#[derive(Module)]
struct Zoo {
    linear: Linear,
    conv: Conv2d,
    embedding: Embedding,
    lstm: Lstm,
    attention: MultiheadAttention,
    transformer: Transformer,
    lazy: LazyLinear,
}

impl Zoo {
    fn new(dev: &Device) -> Result<Self> {
        let config = TransformerConfig {
            d_model: 8,
            nhead: 2,
            num_encoder_layers: 1,
            num_decoder_layers: 1,
            ..Default::default()
        };
        Ok(Self {
            linear: Linear::new(5, 3, dev)?,
            conv: Conv2d::new(2, 3, 3, dev)?,
            embedding: Embedding::new(10, 4, dev)?,
            lstm: Lstm::new(4, 6, dev)?,
            attention: MultiheadAttention::new(8, 2, dev)?,
            transformer: Transformer::with_config(config, dev)?,
            lazy: LazyLinear::new(3, dev)?,
        })
    }
}

/// A model seeded with `seed` (its lazy layer built by a call) and the values of every random
/// op in training: dropout composed (no gradient) and fused (a gradient recorded), channel
/// dropout, RReLU's slopes, attention's dropout, `MultiheadAttention`'s dropout on its weights and
/// an `Lstm`'s between its layers.
fn seeded_run(seed: u64) -> Result<(Bits, Vec<Vec<f32>>)> {
    let dev = Device::Cpu;
    module_runtime::manual_seed(seed);
    let model = Zoo::new(&dev)?;
    model.lazy.call(&Tensor::ones((2, 7), DType::F32, &dev)?)?;
    let x = Tensor::ones((4, 50), DType::F32, &dev)?;
    let dropout = Dropout::new(0.5);
    dropout.train();
    let composed = dropout.call(&x)?;
    let tracked = Var::from_tensor(&x)?;
    let fused = dropout.call(tracked.as_tensor())?;
    let channels = Dropout2d::new(0.5);
    channels.train();
    let channels = channels.call(&Tensor::ones((2, 8, 3, 3), DType::F32, &dev)?)?;
    let rrelu = RReLU::new();
    rrelu.train();
    let slopes = rrelu.call(&Tensor::full(-1f32, 40, &dev)?)?;
    let q = Tensor::ones((1, 2, 6, 4), DType::F32, &dev)?;
    let options = SdpaOptions {
        dropout_p: 0.5,
        ..Default::default()
    };
    let attention = scaled_dot_product_attention(&q, &q, &q, None, options)?;
    let mha = MultiheadAttentionConfig {
        dropout: 0.5,
        ..Default::default()
    };
    let mha = MultiheadAttention::with_config(8, 2, mha, &dev)?;
    mha.train();
    let seq = Tensor::ones((6, 1, 8), DType::F32, &dev)?;
    let mha = mha.call(&seq)?;
    let stacked = RnnConfig {
        num_layers: 2,
        dropout: 0.5,
        ..Default::default()
    };
    let lstm = Lstm::with_config(8, 8, stacked, &dev)?;
    lstm.train();
    let (lstm, _) = lstm.call(&seq)?;
    let draws = [composed, fused, channels, slopes, attention, mha, lstm]
        .iter()
        .map(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
        .collect::<Result<Vec<_>>>()?;
    Ok((bits(&model.state_dict()?), draws))
}

#[test]
fn runs_seeded_alike_are_bit_identical_and_other_seeds_differ() -> Result<()> {
    let _serial = serial();
    let (a, b, c) = (seeded_run(1234)?, seeded_run(1234)?, seeded_run(1235)?);
    assert_eq!(initial_seed(), 1235);
    assert_eq!(a.0, b.0, "the same seed gives the same state dict");
    assert_eq!(
        a.1, b.1,
        "the same seed gives the same dropout masks and slopes"
    );
    for ((key, x), (_, y)) in a.0.iter().zip(&c.0) {
        // Constant initializations (norms' ones, zeroed biases) are equal under any seed.
        let constant = x.chunks(4).all(|v| v == &x[..4]);
        assert!(constant || x != y, "{key}: another seed, the same values");
    }
    for (i, (x, y)) in a.1.iter().zip(&c.1).enumerate() {
        assert_ne!(x, y, "draw {i}: another seed, the same mask");
    }
    // The masks are masks: each element dropped (0) or kept and scaled by 1 / (1 - p).
    assert!(a.1[0].iter().all(|&v| v == 0.0 || v == 2.0));
    assert!(a.1[0].contains(&0.0) && a.1[0].contains(&2.0));
    Ok(())
}

#[test]
fn the_generator_state_restores_the_draws_that_followed_it() -> Result<()> {
    let _serial = serial();
    let dev = Device::Cpu;
    module_runtime::manual_seed(5);
    Linear::new(3, 3, &dev)?;
    let state = get_rng_state()?;
    let first = Linear::new(16, 16, &dev)?;
    let mask = Dropout::new(0.3);
    mask.train();
    let first_mask = mask.call(&Tensor::ones(64, DType::F32, &dev)?)?;
    module_runtime::manual_seed(6);
    Linear::new(3, 3, &dev)?;
    set_rng_state(&state)?;
    assert_eq!(initial_seed(), 5);
    let again = Linear::new(16, 16, &dev)?;
    let again_mask = mask.call(&Tensor::ones(64, DType::F32, &dev)?)?;
    assert_eq!(bits(&first.state_dict()?), bits(&again.state_dict()?));
    assert_eq!(first_mask.to_vec1::<f32>()?, again_mask.to_vec1::<f32>()?);
    Ok(())
}
