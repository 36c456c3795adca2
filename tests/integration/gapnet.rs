//! `GapNet` from `fixtures/pytorch/checkpoints/README.md`, ported the way a PyTorch user
//! would write it: `Sequential`s that keep the original indices (`slice2.4.weight`), tuple
//! kernel/stride/padding, a padded max pool, a ceil-mode average pool that does not count padding,
//! a dilated convolution, BatchNorm buffers. No hand-written loops, padding or key fixing: every
//! checkpoint form of the fixture loads strictly through `load_state_dict(path, ..)` and reproduces
//! PyTorch's outputs.

use std::path::PathBuf;

use candle_module::fixtures::max_abs_diff as max_diff;
use module_runtime::nn::{
    AvgPool2d, BatchNorm2d, Conv2d, ConvConfig, Linear, MaxPool2d, Pool2dConfig, ReLU, Sequential,
    SequentialLayer,
};
use module_runtime::prelude::*;
use module_runtime::{LoadOptions, StateDict};

#[derive(Module)]
struct GapNet {
    slice1: Sequential,
    slice2: Sequential,
    head: Linear,
}

/// `(slice1 output, slice2 output, logits)`, as the PyTorch `forward` returns them.
impl Forward<&Tensor> for GapNet {
    type Output = (Tensor, Tensor, Tensor);

    fn forward(&self, x: &Tensor) -> Result<Self::Output> {
        let a = self.slice1.call(x)?;
        let b = self.slice2.call(&a)?;
        let logits = self.head.call(&b.mean((2, 3))?)?;
        Ok((a, b, logits))
    }
}

fn boxed(layer: impl SequentialLayer) -> Box<dyn SequentialLayer> {
    Box::new(layer)
}

impl GapNet {
    fn new(dev: &Device) -> Result<Self> {
        let conv =
            |i, o, k: (usize, usize), config: ConvConfig| Conv2d::with_config(i, o, k, config, dev);
        let slice1 = Sequential::from_named([
            // nn.Conv2d(3, 8, 3, padding=1)
            (
                "0",
                boxed(conv(
                    3,
                    8,
                    (3, 3),
                    ConvConfig {
                        padding: 1.into(),
                        ..Default::default()
                    },
                )?),
            ),
            ("1", boxed(BatchNorm2d::new(8, dev)?)),
            ("2", boxed(ReLU::new())),
            // nn.MaxPool2d(3, stride=1, padding=1)
            (
                "3",
                boxed(MaxPool2d::with_config(
                    3,
                    Pool2dConfig {
                        stride: Some(1.into()),
                        padding: 1.into(),
                        ..Default::default()
                    },
                )),
            ),
        ])?;
        let slice2 = Sequential::from_named([
            // nn.Conv2d(8, 12, (3, 5), stride=(1, 2), padding=(1, 2))
            (
                "4",
                boxed(conv(
                    8,
                    12,
                    (3, 5),
                    ConvConfig {
                        stride: (1, 2).into(),
                        padding: (1, 2).into(),
                        ..Default::default()
                    },
                )?),
            ),
            ("5", boxed(BatchNorm2d::new(12, dev)?)),
            ("6", boxed(ReLU::new())),
            // nn.AvgPool2d(3, stride=2, ceil_mode=True, count_include_pad=False, padding=1)
            (
                "7",
                boxed(AvgPool2d::with_config(
                    3,
                    Pool2dConfig {
                        stride: Some(2.into()),
                        padding: 1.into(),
                        ceil_mode: true,
                        count_include_pad: false,
                        ..Default::default()
                    },
                )),
            ),
            // nn.Conv2d(12, 16, 3, dilation=2, padding=2)
            (
                "8",
                boxed(conv(
                    12,
                    16,
                    (3, 3),
                    ConvConfig {
                        dilation: 2.into(),
                        padding: 2.into(),
                        ..Default::default()
                    },
                )?),
            ),
            ("9", boxed(ReLU::new())),
        ])?;
        Ok(Self {
            slice1,
            slice2,
            head: Linear::new(16, 5, dev)?,
        })
    }
}

fn fixtures() -> PathBuf {
    candle_module::fixtures::checkpoints_dir()
}

/// The largest difference between the model's eval-mode outputs and PyTorch's.
fn output_error(net: &GapNet) -> f32 {
    let reference = StateDict::read(
        fixtures().join("gapnet_reference.safetensors"),
        &LoadOptions::default(),
    )
    .unwrap();
    net.eval();
    let (a, b, y) = net.call(reference.get("input").unwrap()).unwrap();
    [
        max_diff(&a, reference.get("output.slice1").unwrap()),
        max_diff(&b, reference.get("output.slice2").unwrap()),
        max_diff(&y, reference.get("output").unwrap()),
    ]
    .into_iter()
    .fold(0f32, f32::max)
}

#[test]
fn the_port_has_pytorchs_state_dict_keys_in_pytorchs_order() {
    let net = GapNet::new(&Device::Cpu).unwrap();
    let ours: Vec<String> = net
        .state_dict()
        .unwrap()
        .keys()
        .map(str::to_owned)
        .collect();
    let theirs: Vec<String> =
        StateDict::read(fixtures().join("gapnet_zip.pth"), &LoadOptions::default())
            .unwrap()
            .keys()
            .map(str::to_owned)
            .collect();
    assert_eq!(ours, theirs);
}

/// Every checkpoint form of the fixture, loaded strictly through the one entry point.
#[test]
fn every_checkpoint_form_loads_strictly_and_reproduces_pytorch() {
    let forms: [(&str, LoadOptions); 8] = [
        ("gapnet_zip.pth", LoadOptions::default()),
        ("gapnet_legacy.pth", LoadOptions::default()),
        (
            "gapnet_dataparallel.pth",
            LoadOptions::default().strip_prefix("module"),
        ),
        (
            "gapnet_nested.pt",
            LoadOptions::default().nested_in("model"),
        ),
        // float64 values and an int64 `num_batches_tracked`: converted as `copy_` does.
        ("gapnet_f64.pth", LoadOptions::default()),
        ("gapnet_sharded_safetensors", LoadOptions::default()),
        (
            "gapnet_sharded_bin/pytorch_model.bin.index.json",
            LoadOptions::default(),
        ),
        (
            "gapnet_sharded_safetensors/model.safetensors.index.json",
            LoadOptions::default(),
        ),
    ];
    for (file, options) in forms {
        let net = GapNet::new(&Device::Cpu).unwrap();
        let report = net
            .load_state_dict(fixtures().join(file), &options)
            .unwrap();
        assert_eq!(report.loaded, 18, "{file}");
        // Every file holds the same state dict, so every one reproduces PyTorch's outputs.
        let error = output_error(&net);
        assert!(error < 1e-5, "{file}: max |ours - PyTorch| = {error:e}");
    }
}

#[test]
fn a_nested_checkpoint_without_a_key_says_which_key_holds_the_state_dict() {
    let net = GapNet::new(&Device::Cpu).unwrap();
    let err = net
        .load_state_dict(fixtures().join("gapnet_nested.pt"), &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("model"), "{err}");
}

/// The checkpoint's optimizer state, `SGD(lr=0.1, momentum=0.9)` after one step on the reference
/// input with `loss = logits.sum()` (train mode), read from PyTorch's numbering into parameter
/// paths: after one step a momentum buffer is that step's gradient, so each buffer must equal the
/// gradient computed here at the same parameters. A buffer on the wrong path would not.
#[test]
fn the_nested_checkpoints_sgd_state_continues_here() {
    use module_runtime::optim::{read_pth_state, SgdOptions};

    let net = GapNet::new(&Device::Cpu).unwrap();
    let path = fixtures().join("gapnet_nested.pt");
    net.load_state_dict(&path, &LoadOptions::default().nested_in("model"))
        .unwrap();
    let mut opt = SGD::new(&net, SgdOptions::new(1.0).momentum(0.5)).unwrap();
    let state = read_pth_state(&path, Some("optimizer"), &opt).unwrap();
    opt.load_state_dict(&state).unwrap();
    assert_eq!(opt.lrs(), vec![0.1]);
    assert_eq!(opt.param_groups()[0].options.momentum, 0.9);

    let reference = StateDict::read(
        fixtures().join("gapnet_reference.safetensors"),
        &LoadOptions::default(),
    )
    .unwrap();
    net.train();
    let (_, _, logits) = net.call(reference.get("input").unwrap()).unwrap();
    let grads = logits.sum_all().unwrap().backward().unwrap();
    let saved = opt.state_dict().unwrap();
    let mut checked = 0;
    for (p, param) in net.named_parameters() {
        let buffer = saved
            .get(&format!("state.{p}.momentum_buffer"))
            .unwrap_or_else(|| panic!("no momentum buffer for {p}"));
        let grad = grads.get(param.var().unwrap().as_tensor()).unwrap();
        let scale = grad
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let error = max_diff(buffer, grad);
        assert!(
            error <= 1e-4 * scale.max(1.0),
            "{p}: |buffer - grad| = {error:e}"
        );
        checked += 1;
    }
    assert_eq!(checked, 12);
}
