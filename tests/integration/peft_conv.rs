//! LoRA and DoRA on `Conv1d`/`Conv2d` against `peft` (`fixtures/peft/make_fixtures.py`'s
//! `ConvNet` and `Grouped`): logits within 1e-4, merged weights within 1e-6, 4 AdamW steps within
//! 1e-5, `print(model)` as PEFT's, the saved adapter read back (and by peft: `--check`), and the
//! convolutions an adapter cannot fit, as typed errors.

use module_runtime::nn::peft::{get_peft_model, LoraConfig, PeftExt, TargetModules};
use module_runtime::nn::{Conv1d, Conv2d, Conv3d, ConvConfig};
use module_runtime::prelude::*;
use module_runtime::{Error, LoadOptions, PeftError};

use super::{check_inference_of, check_saved, check_training_of, dir, get, max_diff, read};

/// The fixture script's `ConvNet`, field for field.
#[derive(Module, Clone)]
struct ConvNet {
    conv: Conv2d,
    down: Conv2d,
    point: Conv2d,
    seq: Conv1d,
    head: Linear,
}

impl Forward<&Tensor> for ConvNet {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv.call(x)?.tanh()?;
        let h = self.down.call(&h)?.tanh()?;
        let h = self.point.call(&h)?.tanh()?;
        let h = self.seq.call(&h.flatten_from(2)?)?.tanh()?;
        self.head.call(&h.mean(candle_core::D::Minus1)?)
    }
}

/// The script's `Grouped`: one convolution in two groups.
#[derive(Module, Clone)]
struct Grouped {
    conv: Conv2d,
}

impl Forward<&Tensor> for Grouped {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.call(x)
    }
}

/// The script's `Volume`: a 3-D convolution and a head over its pooled channels.
#[derive(Module, Clone)]
struct Volume {
    conv: Conv3d,
    head: Linear,
}

impl Forward<&Tensor> for Volume {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv.call(x)?.tanh()?.flatten_from(2)?;
        self.head.call(&h.mean(2)?)
    }
}

fn volume() -> Volume {
    let dev = Device::Cpu;
    let padded = ConvConfig {
        padding: 1.into(),
        ..Default::default()
    };
    let model = Volume {
        conv: Conv3d::with_config(2, 4, 3, padded, &dev).unwrap(),
        head: Linear::new(4, 3, &dev).unwrap(),
    };
    let sd = read(dir("").join("conv3d_base.safetensors"));
    model.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    model
}

/// `ConvNet` with the fixture's base weights (`channels` 8 in the fixtures; another width makes
/// a model the fixture's adapters do not fit).
fn conv_net(channels: usize) -> ConvNet {
    let dev = Device::Cpu;
    let padded = ConvConfig {
        padding: 1.into(),
        ..Default::default()
    };
    let down = ConvConfig {
        stride: (2, 1).into(),
        padding: (1, 0).into(),
        ..Default::default()
    };
    let strided = ConvConfig {
        stride: 2.into(),
        padding: 1.into(),
        ..Default::default()
    };
    let model = ConvNet {
        conv: Conv2d::with_config(3, channels, 3, padded, &dev).unwrap(),
        down: Conv2d::with_config(channels, 8, (3, 1), down, &dev).unwrap(),
        point: Conv2d::new(8, 6, 1, &dev).unwrap(),
        seq: Conv1d::with_config(6, 6, 3, strided, &dev).unwrap(),
        head: Linear::new(6, 5, &dev).unwrap(),
    };
    if channels == 8 {
        let sd = read(dir("").join("conv_base.safetensors"));
        model.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    }
    model
}

fn grouped() -> Grouped {
    let config = ConvConfig {
        padding: 1.into(),
        groups: 2,
        ..Default::default()
    };
    let model = Grouped {
        conv: Conv2d::with_config(4, 6, 3, config, &Device::Cpu).unwrap(),
    };
    let sd = read(dir("").join("conv_groups_base.safetensors"));
    model.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    model
}

#[test]
fn conv_lora_adapter_from_peft_gives_peft_logits_and_merged_weights() {
    check_inference_of("conv", conv_net(8));
}

#[test]
fn conv_dora_adapter_from_peft_gives_peft_logits_and_merged_weights() {
    check_inference_of("conv_dora", conv_net(8));
}

#[test]
fn conv3d_lora_and_dora_adapters_from_peft_give_peft_logits_and_merged_weights() {
    check_inference_of("conv3d", volume());
    check_inference_of("conv3d_dora", volume());
}

#[test]
fn conv_lora_training_follows_peft_for_4_adamw_steps() {
    check_training_of("train_conv", conv_net(8));
}

/// `get_peft_model` on convolutions: PEFT's parameter names and shapes (DoRA's magnitude
/// `[1, out, 1, 1]`), `print(model)`, PEFT's init leaving the output unchanged, unbatched input.
#[test]
fn get_peft_model_on_convolutions_matches_peft() {
    let mut model = conv_net(8);
    let x = get(&read(dir("conv").join("io.safetensors")), "ids");
    let before = model.call(&x).unwrap();
    let config = LoraConfig {
        r: 4,
        lora_alpha: 6.0,
        use_dora: true,
        ..LoraConfig::new(TargetModules::names(["conv", "point", "seq", "head"]))
    };
    let paths = get_peft_model(&mut model, &config).unwrap();
    assert_eq!(paths, ["conv", "point", "seq", "head"]);
    let repr = std::fs::read_to_string(dir("conv_dora").join("repr.txt")).unwrap();
    assert_eq!(model.to_string(), repr);
    assert!(max_diff(&model.call(&x).unwrap(), &before) < 1e-6);
    let shapes: Vec<(String, Vec<usize>)> = model
        .named_parameters()
        .into_iter()
        .filter(|(_, p)| p.requires_grad())
        .map(|(k, p)| (k, p.shape().dims().to_vec()))
        .take(6)
        .collect();
    let expect = |k: &str, d: &[usize]| (k.to_owned(), d.to_vec());
    assert_eq!(
        shapes,
        [
            expect("conv.lora_A.default.weight", &[4, 3, 3, 3]),
            expect("conv.lora_B.default.weight", &[8, 4, 1, 1]),
            expect("conv.lora_magnitude_vector.default.weight", &[1, 8, 1, 1]),
            expect("point.lora_A.default.weight", &[4, 8, 1, 1]),
            expect("point.lora_B.default.weight", &[6, 4, 1, 1]),
            expect("point.lora_magnitude_vector.default.weight", &[1, 6, 1, 1]),
        ]
    );
    // An unbatched image goes through the adapted convolution as PyTorch takes it.
    let one = x.get(0).unwrap();
    let y = model.conv.call(&one).unwrap();
    let batched = model.conv.call(&x).unwrap().get(0).unwrap();
    assert!(max_diff(&y, &batched) < 1e-5);
}

/// Convolution adapters (LoRA and DoRA) saved here and read back give the same logits, under
/// PEFT's keys (`make_fixtures.py --check` reads them in peft).
#[test]
fn saved_conv_adapters_reload_with_the_same_logits() {
    for case in ["conv", "conv_dora"] {
        let mut model = conv_net(8);
        model
            .load_adapter(dir(case).join("adapter"), "default", false)
            .unwrap();
        let x = get(&read(dir(case).join("io.safetensors")), "ids");
        let weights = check_saved(case, &model, &x, conv_net(8));
        let key = "base_model.model.seq.lora_B.weight";
        assert_eq!(weights.get(key).unwrap().dims()[2], 1, "{key}");
        let magnitude = weights.get("base_model.model.conv.lora_magnitude_vector");
        assert_eq!(
            magnitude.map(|m| m.dims().to_vec()),
            (case == "conv_dora").then(|| vec![1, 8, 1, 1])
        );
    }
    let mut model = volume();
    model
        .load_adapter(dir("conv3d_dora").join("adapter"), "default", false)
        .unwrap();
    let x = get(&read(dir("conv3d_dora").join("io.safetensors")), "ids");
    let weights = check_saved("conv3d_dora", &model, &x, volume());
    let magnitude = weights.get("base_model.model.conv.lora_magnitude_vector");
    assert_eq!(magnitude.unwrap().dims(), [1, 4, 1, 1, 1]);
}

/// A grouped convolution: PEFT's `lora_B` in the base's groups gives PEFT's logits; merging is
/// refused (as PEFT refuses it), typed and naming the layer, the model unchanged.
#[test]
fn grouped_conv_adapter_gives_peft_logits_and_refuses_to_merge() {
    let io = read(dir("conv_groups").join("io.safetensors"));
    let mut model = grouped();
    model
        .load_adapter(dir("conv_groups").join("adapter"), "default", false)
        .unwrap();
    let x = get(&io, "ids");
    let logits = model.call(&x).unwrap();
    assert!(max_diff(&logits, &get(&io, "logits")) < 1e-4);
    let repr = std::fs::read_to_string(dir("conv_groups").join("repr.txt")).unwrap();
    assert_eq!(model.to_string(), repr);
    let err = model.merge_and_unload().unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::State { path, message }) if path == "conv" && message.contains("groups=2")),
        "{err}"
    );
    assert_eq!(max_diff(&model.call(&x).unwrap(), &logits), 0.0);
    assert!(model.conv.lora().unwrap().merged_adapters().is_empty());
}

/// Every parameter's path and values.
fn snapshot<M: Module>(model: &M) -> Vec<(String, Vec<f32>)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(k, p)| {
            let values = p
                .tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            (k, values)
        })
        .collect()
}

/// Convolutions an adapter cannot fit, and a convolution adapter for another model: typed
/// errors naming the layer, the model untouched.
#[test]
fn conv_adapters_that_do_not_fit_are_typed_errors() {
    // The fixture's adapter on a model whose `conv` has 6 output channels: shapes.
    let mut narrow = conv_net(6);
    let before = snapshot(&narrow);
    let err = narrow
        .load_adapter(dir("conv").join("adapter"), "default", false)
        .unwrap_err();
    let Error::Peft(PeftError::Shape {
        key,
        path,
        expected,
        found,
    }) = &err
    else {
        panic!("{err}")
    };
    assert_eq!(
        (key.as_str(), path.as_str()),
        ("base_model.model.conv.lora_B.weight", "conv")
    );
    assert_eq!(
        (&expected[..], &found[..]),
        (&[6, 4, 1, 1][..], &[8, 4, 1, 1][..])
    );
    assert_eq!(snapshot(&narrow), before);

    // A dilated convolution: PEFT's lora_A has no dilation, so its output would not fit.
    let dev = Device::Cpu;
    let dilated = ConvConfig {
        dilation: 2.into(),
        ..Default::default()
    };
    let mut model = Grouped {
        conv: Conv2d::with_config(4, 6, 3, dilated, &dev).unwrap(),
    };
    let all = LoraConfig::new(TargetModules::names(["conv"]));
    let err = get_peft_model(&mut model, &all).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::UnsupportedLayer { path, found }) if path == "conv" && found.contains("dilation")),
        "{err}"
    );
    assert!(model.conv.lora().is_none());

    // Groups that do not divide the rank, and DoRA over groups.
    let mut model = grouped();
    let odd = LoraConfig {
        r: 3,
        ..all.clone()
    };
    let err = get_peft_model(&mut model, &odd).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::InvalidConfig { field, message }) if field == "r" && message.contains("`conv`")),
        "{err}"
    );
    let dora = LoraConfig {
        use_dora: true,
        ..all
    };
    let err = get_peft_model(&mut model, &dora).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::Unsupported { field, .. }) if field == "use_dora"),
        "{err}"
    );
    assert!(model.conv.lora().is_none());
}

/// Two named adapters on the same convolutions: `set_adapter` switches the forward, merging
/// takes the active one, `disable_adapter` gives the base.
#[test]
fn named_conv_adapters_switch_merge_and_disable() {
    let mut model = conv_net(8);
    let x = get(&read(dir("conv").join("io.safetensors")), "ids");
    let base_logits = model.call(&x).unwrap();
    model
        .load_adapter(dir("conv").join("adapter"), "default", false)
        .unwrap();
    let peft_logits = model.call(&x).unwrap();
    let config = LoraConfig {
        r: 2,
        init_lora_weights: module_runtime::nn::peft::InitLoraWeights::Random,
        ..LoraConfig::new(TargetModules::names(["conv", "seq"]))
    };
    model.add_adapter("other", &config).unwrap();
    assert_eq!(max_diff(&model.call(&x).unwrap(), &peft_logits), 0.0);
    model.set_adapter("other").unwrap();
    let other = model.call(&x).unwrap();
    assert!(max_diff(&other, &peft_logits) > 1e-4);
    model.merge_adapter().unwrap();
    assert!(max_diff(&model.call(&x).unwrap(), &other) < 1e-5);
    let off = model.disable_adapter(|| model.call(&x)).unwrap().unwrap();
    assert!(max_diff(&off, &base_logits) < 1e-5);
    model.delete_adapter("other").unwrap();
    model.set_adapter("default").unwrap();
    assert!(max_diff(&model.call(&x).unwrap(), &peft_logits) < 1e-5);
}
