//! `print(model)`: `Display` of a module is PyTorch's repr, checked against the text PyTorch
//! prints for the same models (`fixtures/pytorch/repr.txt`, written by
//! `fixtures/make_repr_fixtures.py`).

use std::collections::BTreeMap;

use module_runtime::nn::*;
use module_runtime::prelude::*;
use module_runtime::ExtraRepr;

/// PyTorch's text for each model of `make_repr_fixtures.py`, by name.
fn expected() -> BTreeMap<String, String> {
    let text = include_str!("../../fixtures/pytorch/repr.txt");
    let mut out = BTreeMap::new();
    for section in text.split("=== ").skip(1) {
        let (name, repr) = section.split_once('\n').unwrap();
        out.insert(name.to_owned(), repr.trim_end_matches('\n').to_owned());
    }
    out
}

fn check(name: &str, model: &dyn std::fmt::Display) {
    let expected = expected();
    let want = expected
        .get(name)
        .unwrap_or_else(|| panic!("no fixture `{name}`"));
    assert_eq!(
        &model.to_string(),
        want,
        "`{name}` does not print as PyTorch does"
    );
}

#[derive(Module)]
struct Net {
    fc1: Linear,
    act: ReLU,
    seq: Sequential,
}

#[derive(Module)]
struct Blocks {
    layers: ModuleList,
    heads: ModuleDict<Linear>,
    norm: LayerNorm,
}

#[test]
fn nested_modules_and_containers_print_as_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    let net = Net {
        fc1: Linear::new(64, 32, &dev)?,
        act: ReLU::new(),
        seq: Sequential::new()
            .add(Linear::new(32, 16, &dev)?)
            .add(GELU::new())
            .add(Dropout::new(0.1)),
    };
    check("net", &net);

    let mut layers = ModuleList::new();
    for _ in 0..3 {
        layers.push_layer(Linear::new(4, 4, &dev)?);
    }
    layers.push_layer(ReLU::new());
    let blocks = Blocks {
        layers,
        heads: ModuleDict::from_entries([
            ("cls", Linear::new(4, 2, &dev)?),
            ("reg", Linear::new(4, 1, &dev)?),
        ])?,
        norm: LayerNorm::new(4, &dev)?,
    };
    check("blocks", &blocks);

    let seq = Sequential::new()
        .add(Linear::new(4, 3, &dev)?)
        .add(Linear::new(4, 3, &dev)?)
        .add(ReLU::new());
    check("sequential", &seq);
    check("module_list_empty", &ModuleList::<Linear>::new());
    Ok(())
}

#[test]
fn activations_print_their_settings_as_pytorch() -> Result<()> {
    check("relu", &ReLU::new());
    check("gelu", &GELU::new());
    check("gelu_tanh", &GELU::tanh());
    check("tanh", &Tanh::new());
    check("sigmoid", &Sigmoid::new());
    check("silu", &SiLU::new());
    check("softmax", &Softmax::new(-1));
    check("log_softmax", &LogSoftmax::new(1));
    check("leaky_relu", &LeakyReLU::new());
    check("elu", &ELU::with_alpha(0.5));
    check("celu", &CELU::new());
    check("hardtanh", &Hardtanh::new());
    check("relu6", &ReLU6::new());
    check("softplus", &Softplus::new());
    check("glu", &GLU::new());
    check("prelu", &PReLU::new(1, &Device::Cpu)?);
    Ok(())
}

#[test]
fn shape_dropout_and_loss_layers_print_as_pytorch() {
    check("flatten", &Flatten::new());
    check("identity", &Identity::new());
    check("pixel_shuffle", &PixelShuffle::new(2));
    check("dropout", &Dropout::new(0.1));
    check("mse_loss", &MSELoss::new());
    check("cross_entropy_loss", &CrossEntropyLoss::new());
    check("smooth_l1_loss", &SmoothL1Loss::new());
}

#[test]
fn norms_convolutions_and_pools_print_as_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    check("batch_norm1d", &BatchNorm1d::new(16, &dev)?);
    check("batch_norm2d", &BatchNorm2d::new(16, &dev)?);
    check("layer_norm", &LayerNorm::new(64, &dev)?);
    let config = LayerNormConfig {
        eps: 1e-12,
        elementwise_affine: false,
        ..Default::default()
    };
    check(
        "layer_norm_2d",
        &LayerNorm::with_config((2, 3), config, &dev)?,
    );
    check("group_norm", &GroupNorm::new(4, 16, &dev)?);
    check("conv1d", &Conv1d::new(3, 8, 3, &dev)?);
    check("conv2d", &Conv2d::new(3, 8, 3, &dev)?);
    let config = ConvConfig {
        stride: 2.into(),
        padding: 1.into(),
        bias: false,
        ..Default::default()
    };
    check(
        "conv2d_strided",
        &Conv2d::with_config(3, 8, 3, config, &dev)?,
    );
    check("max_pool2d", &MaxPool2d::new(2));
    check("avg_pool2d", &AvgPool2d::new(2));
    check("adaptive_avg_pool2d", &AdaptiveAvgPool2d::new((3, 4)));
    check("adaptive_avg_pool2d_global", &AdaptiveAvgPool2d::new(1));
    check(
        "adaptive_avg_pool2d_none",
        &AdaptiveAvgPool2d::new((None, Some(2))),
    );
    check("adaptive_max_pool1d", &AdaptiveMaxPool1d::new(4));
    let pool1d = Pool1dConfig {
        stride: Some(2),
        padding: 1,
        ..Default::default()
    };
    check("max_pool1d", &MaxPool1d::with_config(3, pool1d));
    check("avg_pool1d", &AvgPool1d::with_config(3, pool1d));
    check("lp_pool2d", &LPPool2d::new(4.0, 2));
    let lp1 = LPPool1d {
        stride: Some([2]),
        ..LPPool1d::new(2.0, 3)
    };
    check("lp_pool1d", &lp1);
    check("instance_norm2d", &InstanceNorm2d::new(3, &dev)?);
    let tracked = InstanceNormConfig {
        affine: true,
        track_running_stats: true,
        ..Default::default()
    };
    check(
        "instance_norm1d_affine_tracked",
        &InstanceNorm1d::with_config(4, tracked, &dev)?,
    );
    check("local_response_norm", &LocalResponseNorm::new(3));
    Ok(())
}

#[test]
fn recurrent_and_embedding_layers_print_as_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    let config = RnnConfig {
        num_layers: 2,
        batch_first: true,
        ..Default::default()
    };
    check("lstm", &Lstm::with_config(10, 20, config, &dev)?);
    check("gru", &Gru::new(10, 20, &dev)?);
    check("embedding", &Embedding::new(100, 16, &dev)?);
    Ok(())
}

#[test]
fn more_activations_dropouts_and_shape_layers_print_as_pytorch() {
    check("threshold", &Threshold::new(0.1, 20.0));
    check("softshrink", &Softshrink::new());
    check("hardshrink", &Hardshrink::with_lambda(0.25));
    check("rrelu", &RReLU::new());
    check("softmin", &Softmin::new(1));
    check("dropout1d", &Dropout1d::new(0.2));
    check("dropout2d", &Dropout2d::new(0.5));
    check("dropout3d", &Dropout3d::new(0.5));
    check("alpha_dropout", &AlphaDropout::new(0.2));
    check("feature_alpha_dropout", &FeatureAlphaDropout::new(0.5));
    check("unflatten", &Unflatten::new(1, [2, -1]));
    check("pixel_unshuffle", &PixelUnshuffle::new(2));
    check("channel_shuffle", &ChannelShuffle::new(2));
    check("fold", &Fold::new((4, 5), 2));
    let strided = FoldConfig {
        padding: 1.into(),
        stride: 2.into(),
        ..Default::default()
    };
    check("fold_strided", &Fold::with_config(4, (2, 3), strided));
    check("unfold", &Unfold::new(2));
    let dilated = FoldConfig {
        dilation: (1, 2).into(),
        stride: 2.into(),
        ..Default::default()
    };
    check("unfold_dilated", &Unfold::with_config(3, dilated));
}

#[test]
fn padding_and_resampling_layers_print_as_pytorch() {
    check("zero_pad1d", &ZeroPad1d::new(2));
    check("zero_pad2d", &ZeroPad2d::new((1, 2, 3, 4)));
    check("zero_pad3d", &ZeroPad3d::new(1));
    check("constant_pad1d", &ConstantPad1d::new(2, 3.5));
    check("constant_pad2d", &ConstantPad2d::new((1, 2, 3, 4), 0.0));
    check("constant_pad3d", &ConstantPad3d::new(1, -1.0));
    check("reflection_pad1d", &ReflectionPad1d::new((2, 1)));
    check("reflection_pad2d", &ReflectionPad2d::new(1));
    check("reflection_pad3d", &ReflectionPad3d::new(1));
    check("replication_pad1d", &ReplicationPad1d::new(2));
    check("replication_pad2d", &ReplicationPad2d::new((1, 1, 2, 0)));
    check("replication_pad3d", &ReplicationPad3d::new(1));
    check("circular_pad1d", &CircularPad1d::new(2));
    check("circular_pad2d", &CircularPad2d::new(1));
    check("circular_pad3d", &CircularPad3d::new(1));
    check(
        "upsample",
        &Upsample::scale_factor(2.0, UpsampleMode::Nearest),
    );
    let bilinear = UpsampleMode::Bilinear {
        align_corners: true,
    };
    check("upsample_size", &Upsample::size([4, 5], bilinear));
    check(
        "upsample_size_one",
        &Upsample::size([7], UpsampleMode::NearestExact),
    );
    let bicubic = UpsampleMode::Bicubic {
        align_corners: false,
    };
    let scales = UpsampleTarget::ScaleFactor(vec![2.0, 1.5]);
    check("upsample_scales", &Upsample::new(scales, bicubic));
}

#[test]
fn more_norms_convolutions_cells_and_embeddings_print_as_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    check("rms_norm", &RmsNorm::new(16, &dev)?);
    let config = RmsNormConfig {
        eps: Some(1e-6),
        elementwise_affine: false,
        ..Default::default()
    };
    check("rms_norm_2d", &RmsNorm::with_config((2, 3), config, &dev)?);
    check("conv_transpose2d", &ConvTranspose2d::new(3, 8, 3, &dev)?);
    let config = ConvTransposeConfig {
        stride: 2,
        padding: 1,
        output_padding: 1,
        bias: false,
        ..Default::default()
    };
    check(
        "conv_transpose2d_strided",
        &ConvTranspose2d::with_config(3, 8, 3, config, &dev)?,
    );
    let config = ConvTransposeConfig {
        stride: 2,
        padding: 1,
        output_padding: 1,
        dilation: 2,
        groups: 2,
        ..Default::default()
    };
    check(
        "conv_transpose1d",
        &ConvTranspose1d::with_config(4, 6, 3, config, &dev)?,
    );
    check("lstm_cell", &LstmCell::new(10, 20, &dev)?);
    let config = RnnCellConfig {
        bias: false,
        ..Default::default()
    };
    check(
        "gru_cell_no_bias",
        &GruCell::with_config(10, 20, config, &dev)?,
    );
    let config = EmbeddingConfig {
        padding_idx: Some(0),
        ..Default::default()
    };
    check(
        "embedding_padding",
        &Embedding::with_config(10, 3, config, &dev)?,
    );
    let config = EmbeddingConfig {
        padding_idx: Some(-1),
        max_norm: Some(2.0),
        norm_type: 1.0,
        ..Default::default()
    };
    check(
        "embedding_max_norm",
        &Embedding::with_config(10, 3, config, &dev)?,
    );
    check("embedding_bag", &EmbeddingBag::new(10, 3, &dev)?);
    let config = EmbeddingBagConfig {
        mode: EmbeddingBagMode::Sum,
        padding_idx: Some(0),
        max_norm: Some(1.0),
        ..Default::default()
    };
    check(
        "embedding_bag_sum",
        &EmbeddingBag::with_config(10, 3, config, &dev)?,
    );
    Ok(())
}

#[test]
fn attention_and_transformer_blocks_print_as_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    check("attention", &MultiheadAttention::new(16, 4, &dev)?);
    let config = MultiheadAttentionConfig {
        batch_first: true,
        bias: false,
        ..Default::default()
    };
    let attention = MultiheadAttention::with_config(16, 4, config, &dev)?;
    check("attention_kv", &attention);
    // Names only: the state-dict keys stay PyTorch's.
    assert!(attention.state_dict()?.contains_key("out_proj.weight"));

    let layer = TransformerLayerConfig {
        dim_feedforward: 32,
        ..Default::default()
    };
    let encoder_layer = TransformerEncoderLayer::with_config(16, 4, layer.clone(), &dev)?;
    check("transformer_encoder_layer", &encoder_layer);
    let pre_norm = TransformerLayerConfig {
        batch_first: true,
        norm_first: true,
        ..layer.clone()
    };
    let block = TransformerEncoderLayer::with_config(16, 4, pre_norm, &dev)?;
    let encoder = TransformerEncoder::new(&block, 2, Some(LayerNorm::new(16, &dev)?))?;
    check("transformer_encoder", &encoder);
    let gelu = TransformerLayerConfig {
        activation: TransformerActivation::gelu(),
        ..layer.clone()
    };
    let decoder_layer = TransformerDecoderLayer::with_config(16, 4, gelu, &dev)?;
    check("transformer_decoder_layer", &decoder_layer);
    let config = TransformerConfig {
        d_model: 16,
        nhead: 4,
        num_encoder_layers: 1,
        num_decoder_layers: 2,
        layer,
    };
    check("transformer", &Transformer::with_config(config, &dev)?);
    Ok(())
}

/// A module of the user's with its own `extra_repr`, and one that keeps its own `Display`.
#[derive(Module)]
#[module(extra_repr)]
struct Scaled {
    factor: f64,
    inner: Linear,
}

impl ExtraRepr for Scaled {
    fn extra_repr(&self) -> String {
        format!("factor={}", module_runtime::py_float(self.factor))
    }
}

#[derive(Module)]
#[module(no_display)]
struct OwnDisplay {
    inner: ReLU,
}

impl std::fmt::Display for OwnDisplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("mine")
    }
}

#[test]
fn user_modules_add_their_extra_repr_or_keep_their_display() -> Result<()> {
    let m = Scaled {
        factor: 1e-5,
        inner: Linear::new(2, 2, &Device::Cpu)?,
    };
    assert_eq!(
        m.to_string(),
        "Scaled(\n  factor=1e-05\n  (inner): Linear(in_features=2, out_features=2, bias=True)\n)"
    );
    let own = OwnDisplay { inner: ReLU::new() };
    assert_eq!(own.to_string(), "mine");
    assert_eq!(
        module_runtime::module_repr(&own),
        "OwnDisplay(\n  (inner): ReLU()\n)"
    );
    Ok(())
}

#[derive(Module)]
struct Block {
    fc: Linear,
    act: ReLU,
}

#[derive(Module)]
struct Stack {
    blocks: Vec<Block>,
    pair: [Linear; 2],
    heads: BTreeMap<String, Linear>,
}

/// A `Vec` (or array) of modules prints as the `nn.ModuleList` PyTorch code would hold, runs of
/// equal entries collapsed; a map as `nn.ModuleDict`. The text is PyTorch's for
/// `blocks = nn.ModuleList([Block(), Block()])`, `pair = nn.ModuleList([nn.Linear(4, 4),
/// nn.Linear(4, 3)])` and `heads = nn.ModuleDict({"cls": ..., "reg": ...})`.
#[test]
fn vec_and_map_fields_print_as_module_list_and_module_dict() -> Result<()> {
    let dev = Device::Cpu;
    let block = || -> Result<Block> {
        Ok(Block {
            fc: Linear::new(4, 4, &dev)?,
            act: ReLU::new(),
        })
    };
    let stack = Stack {
        blocks: vec![block()?, block()?],
        pair: [Linear::new(4, 4, &dev)?, Linear::new(4, 3, &dev)?],
        heads: BTreeMap::from([
            ("cls".to_owned(), Linear::new(4, 2, &dev)?),
            ("reg".to_owned(), Linear::new(4, 1, &dev)?),
        ]),
    };
    let want = "\
Stack(
  (blocks): ModuleList(
    (0-1): 2 x Block(
      (fc): Linear(in_features=4, out_features=4, bias=True)
      (act): ReLU()
    )
  )
  (pair): ModuleList(
    (0): Linear(in_features=4, out_features=4, bias=True)
    (1): Linear(in_features=4, out_features=3, bias=True)
  )
  (heads): ModuleDict(
    (cls): Linear(in_features=4, out_features=2, bias=True)
    (reg): Linear(in_features=4, out_features=1, bias=True)
  )
)";
    assert_eq!(stack.to_string(), want);
    assert_eq!(
        module_runtime::module_repr(&Vec::<Block>::new()),
        "ModuleList()"
    );
    Ok(())
}
