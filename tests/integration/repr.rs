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
