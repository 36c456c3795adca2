//! PyTorch's Transformer blocks (issue 29): `TransformerEncoderLayer`, `TransformerEncoder`,
//! `TransformerDecoderLayer`, `TransformerDecoder` and `Transformer`, forward and input/parameter
//! gradients against the fixtures of `fixtures/make_transformer_fixtures.py` (post- and pre-norm,
//! ReLU, GELU and a closure, batch first or not, padding, causal and explicit masks, no biases), a
//! pre-norm classifier ported from a `torch.save` state dict, and the errors of bad masks.

use candle_core::{DType, Device, Tensor};
use module_runtime::nn::{
    generate_square_subsequent_mask, AttentionInput, DecoderInput, EncoderInput, LayerNorm,
    MultiheadAttention, Transformer, TransformerActivation, TransformerConfig, TransformerDecoder,
    TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer, TransformerInput,
    TransformerLayerConfig,
};
use module_runtime::{without_grad, Error, ModuleExt};

use crate::nn_fixture::check;

const D: usize = 8;
const H: usize = 2;

/// The fixtures' layer arguments: `d_model = 8`, `nhead = 2`, `dim_feedforward = 16`.
fn config() -> TransformerLayerConfig {
    TransformerLayerConfig {
        dim_feedforward: 16,
        ..Default::default()
    }
}

fn encoder_layer(config: TransformerLayerConfig) -> TransformerEncoderLayer {
    let layer = TransformerEncoderLayer::with_config(D, H, config, &Device::Cpu).unwrap();
    layer.eval();
    layer
}

fn decoder_layer(config: TransformerLayerConfig) -> TransformerDecoderLayer {
    let layer = TransformerDecoderLayer::with_config(D, H, config, &Device::Cpu).unwrap();
    layer.eval();
    layer
}

#[test]
fn encoder_layer_post_norm_with_key_padding_mask() {
    let layer = encoder_layer(config());
    assert_eq!(
        layer.state_dict().unwrap().keys().collect::<Vec<_>>(),
        [
            "self_attn.in_proj_weight",
            "self_attn.in_proj_bias",
            "self_attn.out_proj.weight",
            "self_attn.out_proj.bias",
            "linear1.weight",
            "linear1.bias",
            "linear2.weight",
            "linear2.bias",
            "norm1.weight",
            "norm1.bias",
            "norm2.weight",
            "norm2.bias",
        ]
    );
    check(
        "transformer_encoder_layer",
        &layer,
        &["src", "src_key_padding_mask"],
        |t| layer.call(EncoderInput::new(&t[0]).src_key_padding_mask(&t[1])),
    );
}

/// The fused inference passes (no graph: `Linear::call_then`, `LayerNorm::call_residual`) give
/// what the differentiable path gives, post-norm and pre-norm, encoder and decoder.
#[test]
fn inference_without_a_graph_matches_the_differentiable_path() {
    let dev = Device::Cpu;
    for norm_first in [false, true] {
        for activation in [TransformerActivation::relu(), TransformerActivation::gelu()] {
            let config = TransformerLayerConfig {
                norm_first,
                activation,
                ..config()
            };
            let encoder = encoder_layer(config.clone());
            let decoder = decoder_layer(config);
            let x = Tensor::randn(0f32, 1., (5, 3, D), &dev).unwrap();
            let memory = Tensor::randn(0f32, 1., (4, 3, D), &dev).unwrap();
            let input = || DecoderInput::new(&x, &memory).tgt_is_causal(true);
            let pairs = [
                (
                    encoder.call(&x).unwrap(),
                    without_grad(|| encoder.call(&x)).unwrap(),
                ),
                (
                    decoder.call(input()).unwrap(),
                    without_grad(|| decoder.call(input())).unwrap(),
                ),
            ];
            for (graph, fused) in pairs {
                assert!(graph.track_op() && !fused.track_op());
                crate::nn_fixture::assert_close("fused vs graph", &fused, &graph);
            }
        }
    }
}

#[test]
fn encoder_layer_pre_norm_gelu_batch_first_causal() {
    let layer = encoder_layer(TransformerLayerConfig {
        activation: TransformerActivation::gelu(),
        batch_first: true,
        norm_first: true,
        ..config()
    });
    assert!(layer.norm_first() && layer.batch_first());
    // `is_causal` alone makes the causal mask; PyTorch was given it with the mask.
    check(
        "transformer_encoder_layer_pre_gelu_causal",
        &layer,
        &["src"],
        |t| layer.call(EncoderInput::new(&t[0]).is_causal(true)),
    );
    // The mask given explicitly, as a float mask, is the same.
    let mask =
        generate_square_subsequent_mask(5, DType::F32, &crate::nn_fixture::device()).unwrap();
    check(
        "transformer_encoder_layer_pre_gelu_causal",
        &layer,
        &["src"],
        |t| layer.call(EncoderInput::new(&t[0]).src_mask(&mask).is_causal(true)),
    );
}

#[test]
fn encoder_layer_without_biases_and_an_attention_mask() {
    let layer = encoder_layer(TransformerLayerConfig {
        layer_norm_eps: 1e-6,
        bias: false,
        batch_first: true,
        ..config()
    });
    assert_eq!(layer.named_parameters().len(), 6);
    check(
        "transformer_encoder_layer_nobias_mask",
        &layer,
        &["src", "src_mask"],
        |t| layer.call(EncoderInput::new(&t[0]).src_mask(&t[1])),
    );
}

#[test]
fn encoder_layer_with_a_closure_activation() {
    let layer = encoder_layer(TransformerLayerConfig {
        activation: TransformerActivation::custom(|x: &Tensor| x.silu()),
        batch_first: true,
        ..config()
    });
    check("transformer_encoder_layer_silu", &layer, &["src"], |t| {
        layer.call(&t[0])
    });
}

#[test]
fn encoder_stack_pre_norm_with_final_norm_and_padding() {
    let layer = encoder_layer(TransformerLayerConfig {
        batch_first: true,
        norm_first: true,
        ..config()
    });
    let norm = LayerNorm::new(D, &Device::Cpu).unwrap();
    let encoder = TransformerEncoder::new(&layer, 2, Some(norm)).unwrap();
    encoder.eval();
    // The copies have parameters of their own.
    let w0 = encoder.layers[0].linear1.weight.tensor().unwrap();
    let w1 = encoder.layers[1].linear1.weight.tensor().unwrap();
    assert_ne!(w0.id(), w1.id());
    assert!(encoder.state_dict().unwrap().contains_key("norm.weight"));
    // Typed paths, and PyTorch's class name in summaries.
    let path = TransformerEncoder::path()
        .layers()
        .at(1)
        .self_attn()
        .in_proj_weight();
    assert_eq!(path.to_string(), "layers.1.self_attn.in_proj_weight");
    assert!(encoder
        .get(TransformerEncoder::path().layers().at(1).linear1())
        .is_some());
    assert_eq!(
        <TransformerEncoder as module_runtime::Module>::type_class_name(),
        "TransformerEncoder"
    );
    check(
        "transformer_encoder_pre_norm",
        &encoder,
        &["src", "src_key_padding_mask"],
        |t| encoder.call(EncoderInput::new(&t[0]).src_key_padding_mask(&t[1])),
    );
}

#[test]
fn encoder_stack_post_norm_causal_seq_first() {
    let encoder = TransformerEncoder::new(&encoder_layer(config()), 2, None).unwrap();
    encoder.eval();
    check("transformer_encoder_causal", &encoder, &["src"], |t| {
        encoder.call(EncoderInput::new(&t[0]).is_causal(true))
    });
}

#[test]
fn decoder_layer_post_norm_with_memory_padding_and_causal_target() {
    let layer = decoder_layer(config());
    let keys = layer.state_dict().unwrap();
    assert!(keys.contains_key("multihead_attn.in_proj_weight") && keys.contains_key("norm3.bias"));
    check(
        "transformer_decoder_layer",
        &layer,
        &["tgt", "memory", "memory_key_padding_mask"],
        |t| {
            let input = DecoderInput::new(&t[0], &t[1])
                .tgt_is_causal(true)
                .memory_key_padding_mask(&t[2]);
            layer.call(input)
        },
    );
}

#[test]
fn decoder_layer_pre_norm_gelu_batch_first_with_masks() {
    let layer = decoder_layer(TransformerLayerConfig {
        activation: TransformerActivation::gelu(),
        batch_first: true,
        norm_first: true,
        ..config()
    });
    check(
        "transformer_decoder_layer_pre_gelu",
        &layer,
        &["tgt", "memory", "tgt_key_padding_mask", "memory_mask"],
        |t| {
            let input = DecoderInput::new(&t[0], &t[1])
                .tgt_key_padding_mask(&t[2])
                .memory_mask(&t[3]);
            layer.call(input)
        },
    );
}

#[test]
fn decoder_stack_with_final_norm() {
    let layer = decoder_layer(TransformerLayerConfig {
        batch_first: true,
        ..config()
    });
    let decoder =
        TransformerDecoder::new(&layer, 2, Some(LayerNorm::new(D, &Device::Cpu).unwrap())).unwrap();
    decoder.eval();
    check(
        "transformer_decoder_norm",
        &decoder,
        &["tgt", "memory"],
        |t| decoder.call(DecoderInput::new(&t[0], &t[1]).tgt_is_causal(true)),
    );
}

#[test]
fn transformer_encoder_decoder_matches_pytorch() {
    let config = TransformerConfig {
        d_model: D,
        nhead: H,
        num_encoder_layers: 2,
        num_decoder_layers: 1,
        layer: TransformerLayerConfig {
            batch_first: true,
            ..config()
        },
    };
    let model = Transformer::with_config(config, &Device::Cpu).unwrap();
    model.eval();
    let sd = model.state_dict().unwrap();
    assert!(sd.contains_key("encoder.layers.1.norm2.bias"));
    assert!(sd.contains_key("decoder.layers.0.multihead_attn.out_proj.weight"));
    assert!(sd.contains_key("encoder.norm.weight") && sd.contains_key("decoder.norm.weight"));
    check(
        "transformer",
        &model,
        &["src", "tgt", "src_key_padding_mask"],
        |t| {
            let input = TransformerInput::new(&t[0], &t[1])
                .tgt_is_causal(true)
                .src_key_padding_mask(&t[2])
                .memory_key_padding_mask(&t[2]);
            model.call(input)
        },
    );
}

/// PyTorch's defaults and initialization: `Transformer` is Xavier-uniform on every matrix.
#[test]
fn defaults_and_initialization_follow_pytorch() {
    let c = TransformerLayerConfig::default();
    assert_eq!(
        (c.dim_feedforward, c.dropout, c.layer_norm_eps),
        (2048, 0.1, 1e-5)
    );
    assert!(!c.batch_first && !c.norm_first && c.bias);
    assert!(matches!(c.activation, TransformerActivation::Relu(_)));
    let config = TransformerConfig {
        d_model: 16,
        nhead: 2,
        num_encoder_layers: 1,
        num_decoder_layers: 1,
        layer: TransformerLayerConfig {
            dim_feedforward: 32,
            ..Default::default()
        },
    };
    let model = Transformer::with_config(config, &Device::Cpu).unwrap();
    let w = model.encoder.layers[0].linear1.weight.tensor().unwrap();
    let values: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
    let max = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let bound = (6.0f32 / 48.0).sqrt();
    assert!(max <= bound && max > 0.8 * bound, "{max} vs {bound}");
    let bad = TransformerLayerConfig {
        dropout: 1.5,
        ..Default::default()
    };
    let err = TransformerEncoderLayer::with_config(8, 2, bad, &Device::Cpu).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    let err = TransformerEncoderLayer::with_config(8, 3, Default::default(), &Device::Cpu);
    assert!(matches!(err.unwrap_err(), Error::InvalidConfig { .. }));
}

/// A `[3, 10]` key padding mask for `[3, 12]` inputs names both shapes, from the attention and
/// from a Transformer layer.
#[test]
fn a_key_padding_mask_of_the_wrong_shape_names_both_shapes() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((3, 12, D), DType::F32, &dev).unwrap();
    let mask = Tensor::zeros((3, 10), DType::U8, &dev).unwrap();
    let mha = MultiheadAttention::with_config(
        D,
        H,
        module_runtime::nn::MultiheadAttentionConfig {
            batch_first: true,
            ..Default::default()
        },
        &dev,
    )
    .unwrap();
    let err = mha
        .call(AttentionInput::self_attention(&x).key_padding_mask(&mask))
        .unwrap_err();
    let expected = "key_padding_mask must be [B, S] = [3, 12], got [3, 10]";
    assert!(err.to_string().contains(expected), "{err}");
    assert!(matches!(
        err.inner(),
        Error::InvalidInput {
            layer: "MultiheadAttention",
            ..
        }
    ));

    let layer = encoder_layer(TransformerLayerConfig {
        batch_first: true,
        ..config()
    });
    let err = layer
        .call(EncoderInput::new(&x).src_key_padding_mask(&mask))
        .unwrap_err();
    assert!(err.to_string().contains(expected), "{err}");
    // And a wrong attention mask.
    let bad = Tensor::zeros((12, 10), DType::U8, &dev).unwrap();
    let err = layer
        .call(EncoderInput::new(&x).src_mask(&bad))
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("attn_mask must be [L, S] = [12, 12]"),
        "{err}"
    );
}

#[test]
fn transformer_refuses_mismatched_batches_and_widths() {
    let config = TransformerConfig {
        d_model: D,
        nhead: H,
        num_encoder_layers: 1,
        num_decoder_layers: 1,
        layer: TransformerLayerConfig {
            batch_first: true,
            ..config()
        },
    };
    let model = Transformer::with_config(config, &Device::Cpu).unwrap();
    let src = Tensor::zeros((2, 5, D), DType::F32, &Device::Cpu).unwrap();
    let tgt = Tensor::zeros((3, 4, D), DType::F32, &Device::Cpu).unwrap();
    let err = model.call(TransformerInput::new(&src, &tgt)).unwrap_err();
    assert!(
        err.to_string().contains("batch number of src and tgt"),
        "{err}"
    );
    let tgt = Tensor::zeros((2, 4, 6), DType::F32, &Device::Cpu).unwrap();
    let err = model.call(TransformerInput::new(&src, &tgt)).unwrap_err();
    assert!(err.to_string().contains("d_model = 8"), "{err}");
}

/// In training mode the layer's dropouts are active (two calls differ), in evaluation mode they
/// are the identity (two calls agree), for the layer and every copy in a stack.
#[test]
fn dropout_follows_the_train_and_eval_modes() {
    let layer = TransformerEncoderLayer::with_config(D, H, config(), &Device::Cpu).unwrap();
    let encoder = TransformerEncoder::new(&layer, 2, None).unwrap();
    let x = Tensor::randn(0f32, 1., (5, 3, D), &Device::Cpu).unwrap();
    let differ = |a: Tensor, b: Tensor| -> bool {
        let d = (a - b).unwrap().abs().unwrap().sum_all().unwrap();
        d.to_scalar::<f32>().unwrap() > 0.0
    };
    assert!(encoder.is_training());
    assert!(differ(encoder.call(&x).unwrap(), encoder.call(&x).unwrap()));
    encoder.eval();
    assert!(encoder.layers.iter().all(|l| !l.is_training()));
    assert!(!differ(
        encoder.call(&x).unwrap(),
        encoder.call(&x).unwrap()
    ));
}
