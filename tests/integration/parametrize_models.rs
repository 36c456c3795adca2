//! Parametrizations in models: registered by path (in containers, in lazy layers), trained,
//! chained, cached, assigned through `right_inverse`, converted and cloned, and beside the
//! fused and quantized paths of `Linear`.

use module_runtime::nn::parametrize::{
    orthogonal, parametrized_tensor, remove_parametrizations, spectral_norm, weight_norm,
    SpectralNormOptions,
};
use module_runtime::prelude::*;
use module_runtime::ParametrizeError;

use super::{dev, max_diff, net};

/// Registered by path inside a model: PyTorch's keys and `print(model)`; the optimizer trains
/// the originals.
#[test]
fn by_path_in_a_model() {
    let mut model = net();
    weight_norm(&mut model, "conv.weight", Some(0)).unwrap();
    spectral_norm(&mut model, "fc.weight", SpectralNormOptions::default()).unwrap();
    let keys: Vec<String> = model
        .state_dict()
        .unwrap()
        .keys()
        .map(str::to_owned)
        .collect();
    assert_eq!(
        keys,
        [
            "conv.bias",
            "conv.parametrizations.weight.original0",
            "conv.parametrizations.weight.original1",
            "embed.weight",
            "fc.bias",
            "fc.parametrizations.weight.original",
            "fc.parametrizations.weight.0._u",
            "fc.parametrizations.weight.0._v",
        ]
    );
    assert_eq!(
        model.conv.to_string(),
        "ParametrizedConv1d(
  2, 3, kernel_size=(3,), stride=(1,)
  (parametrizations): ModuleDict(
    (weight): ParametrizationList(
      (0): _WeightNorm()
    )
  )
)"
    );
    // The stand-in refuses to be read; the computed weight is PyTorch's `module.weight`.
    assert!(matches!(
        model.fc.weight.tensor(),
        Err(Error::Parametrize(ParametrizeError::StandIn))
    ));
    assert_eq!(
        parametrized_tensor(&model, "fc.weight").unwrap().dims(),
        [2, 3]
    );
    // A step of SGD on the originals changes the computed weight.
    let before = parametrized_tensor(&model, "conv.weight").unwrap();
    let mut opt = SGD::new(&model, module_runtime::optim::SgdOptions::new(0.5)).unwrap();
    let x = Tensor::randn(0f32, 1., (1, 2, 5), &dev()).unwrap();
    let loss = model
        .conv
        .call(&x)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    opt.backward_step(&loss).unwrap();
    let after = parametrized_tensor(&model, "conv.weight").unwrap();
    assert!(max_diff(&before, &after) > 1e-4);
}

/// Chained parametrizations (PyTorch's `ParametrizationList` of two), removed together.
#[test]
fn chained_and_removed() {
    let mut fc = Linear::new(4, 3, &dev()).unwrap();
    let w0 = fc.weight.tensor().unwrap();
    weight_norm(&mut fc, "weight", Some(0)).unwrap();
    spectral_norm(&mut fc, "weight", SpectralNormOptions::default()).unwrap();
    let keys: Vec<String> = fc.state_dict().unwrap().keys().map(str::to_owned).collect();
    assert_eq!(
        keys,
        [
            "bias",
            "parametrizations.weight.original0",
            "parametrizations.weight.original1",
            "parametrizations.weight.1._u",
            "parametrizations.weight.1._v",
        ]
    );
    fc.eval();
    let w = parametrized_tensor(&fc, "weight").unwrap();
    // Spectrally normalized: about w0 over its largest singular value.
    let ratio = (w0
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap())
        / (w.abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap());
    assert!(ratio > 0.1 && ratio < 10.0);
    remove_parametrizations(&mut fc, "weight", true).unwrap();
    assert!(max_diff(&fc.weight.tensor().unwrap(), &w) < 1e-6);
    assert_eq!(
        fc.to_string(),
        "Linear(in_features=4, out_features=3, bias=True)"
    );
}

/// `cached`: inside the scope the weight is computed once (a change to the original is not seen
/// until the scope ends, as in PyTorch's `parametrize.cached()`), and gradients still reach it.
#[test]
fn cached_computes_once() {
    use module_runtime::nn::parametrize::cached;
    let mut fc = Linear::new(3, 2, &dev()).unwrap();
    weight_norm(&mut fc, "weight", Some(0)).unwrap();
    let x = Tensor::ones((1, 3), DType::F32, &dev()).unwrap();
    let v = fc
        .get_parameter("parametrizations.weight.original1")
        .unwrap();
    let (first, second) = cached(|| {
        let first = fc.call(&x).unwrap();
        v.set(&(v.tensor().unwrap() * 2.0).unwrap().neg().unwrap())
            .unwrap();
        (first, fc.call(&x).unwrap())
    });
    assert_eq!(max_diff(&first, &second), 0.0);
    let grads = second.sum_all().unwrap().backward().unwrap();
    assert!(grads.get(&v.tensor().unwrap()).is_some());
    // Outside the scope, the changed original is seen: v's direction flipped.
    let third = fc.call(&x).unwrap();
    assert!(max_diff(&first, &third) > 1e-3);
}

/// A parametrized bias, and `Linear::call_each` beside a quantized layer: each layer computes
/// its own parametrized tensors.
#[test]
fn a_parametrized_bias_and_call_each() {
    let mut q = Linear::new(32, 4, &dev()).unwrap();
    let mut k = Linear::new(32, 4, &dev()).unwrap();
    let bias = k.bias.as_ref().unwrap().tensor().unwrap();
    weight_norm(&mut q, "weight", Some(0)).unwrap();
    spectral_norm(&mut k, "bias", SpectralNormOptions::default()).unwrap();
    assert_eq!(
        k.state_dict().unwrap().keys().collect::<Vec<_>>(),
        ["weight", "parametrizations.bias.original"]
    );
    // A 1-D tensor's spectral norm is its normalization.
    let expected = bias.broadcast_div(&bias.sqr().unwrap().sum_all().unwrap().sqrt().unwrap());
    let got = parametrized_tensor(&k, "bias").unwrap();
    assert!(max_diff(&got, &expected.unwrap()) < 1e-6);
    let x = Tensor::randn(0f32, 1., (2, 32), &dev()).unwrap();
    let v = Linear::new(32, 4, &dev()).unwrap();
    v.weight.quantize(GgmlDType::Q8_0).unwrap();
    let [qx, kx, vx] =
        module_runtime::without_grad(|| Linear::call_each([&q, &k, &v], &x)).unwrap();
    assert!(max_diff(&qx, &q.call(&x).unwrap()) < 1e-6);
    assert!(max_diff(&kx, &k.call(&x).unwrap()) < 1e-6);
    assert!(max_diff(&vx, &v.call(&x).unwrap()) < 1e-6);
}

/// A parametrized model converts to another dtype (originals and buffers move; the weight is
/// computed in the new dtype), and `deep_clone` copies it independently.
#[test]
fn to_dtype_and_deep_clone() {
    let mut model = net();
    weight_norm(&mut model, "conv.weight", Some(0)).unwrap();
    spectral_norm(&mut model, "fc.weight", SpectralNormOptions::default()).unwrap();
    model.to_dtype(DType::F64).unwrap();
    assert_eq!(
        parametrized_tensor(&model, "fc.weight").unwrap().dtype(),
        DType::F64
    );
    let x = Tensor::randn(0f64, 1., (1, 2, 5), &dev()).unwrap();
    assert_eq!(model.conv.call(&x).unwrap().dtype(), DType::F64);
    let h = Tensor::randn(0f64, 1., (4, 3), &dev()).unwrap();
    assert_eq!(model.fc.call(&h).unwrap().dtype(), DType::F64);

    let copy = model.deep_clone().unwrap();
    let before = parametrized_tensor(&model, "conv.weight").unwrap();
    let v = copy
        .get_parameter("conv.parametrizations.weight.original1")
        .unwrap();
    v.set(&v.tensor().unwrap().ones_like().unwrap()).unwrap();
    let after = parametrized_tensor(&model, "conv.weight").unwrap();
    assert_eq!(
        max_diff(
            &before.to_dtype(DType::F32).unwrap(),
            &after.to_dtype(DType::F32).unwrap()
        ),
        0.0
    );
    let copied = parametrized_tensor(&copy, "conv.weight").unwrap();
    assert!(
        max_diff(
            &before.to_dtype(DType::F32).unwrap(),
            &copied.to_dtype(DType::F32).unwrap()
        ) > 1e-3
    );
}

/// Lazy layers take parametrizations once built (their paths are the layer's); before, a typed
/// error.
#[test]
fn lazy_layers_once_built() {
    use module_runtime::nn::LazyLinear;
    let mut fc = LazyLinear::new(3, &dev()).unwrap();
    let err = weight_norm(&mut fc, "weight", Some(0)).unwrap_err();
    assert!(err.to_string().contains("unbuilt"), "{err}");
    let x = Tensor::randn(0f32, 1., (2, 4), &dev()).unwrap();
    let y0 = fc.call(&x).unwrap();
    weight_norm(&mut fc, "weight", Some(0)).unwrap();
    assert!(max_diff(&y0, &fc.call(&x).unwrap()) < 1e-5);
    assert!(fc
        .get_parameter("parametrizations.weight.original0")
        .is_ok());

    #[derive(Module)]
    struct Cell {
        fc: Lazy<Linear>,
    }
    let mut cell = Cell { fc: Lazy::new() };
    let err = spectral_norm(&mut cell, "fc.weight", SpectralNormOptions::default()).unwrap_err();
    assert!(err.to_string().contains("not built"), "{err}");
    cell.fc.get_or_build(|| Linear::new(4, 3, &dev())).unwrap();
    spectral_norm(&mut cell, "fc.weight", SpectralNormOptions::default()).unwrap();
    assert!(cell.get_buffer("fc.parametrizations.weight.0._u").is_ok());
    assert_eq!(cell.fc.get().unwrap().call(&x).unwrap().dims(), [2, 3]);
}

/// PyTorch's `module.weight = value` on a parametrized layer: `ParametrizationList::right_inverse`
/// sets the originals so that the layer computes `value` (a plain checkpoint's weight into a
/// weight-normed layer); a value of another shape changes nothing.
#[test]
fn assigning_through_right_inverse() {
    use module_runtime::nn::parametrize::ParametrizationList;
    let w = Tensor::randn(0f32, 1., (4, 4), &dev()).unwrap();
    let mut fc = Linear::new(4, 4, &dev()).unwrap();
    weight_norm(&mut fc, "weight", Some(0)).unwrap();
    let list: &ParametrizationList = fc.get_submodule("parametrizations.weight").unwrap();
    list.right_inverse(&w).unwrap();
    assert!(max_diff(&parametrized_tensor(&fc, "weight").unwrap(), &w) < 1e-5);

    // Orthogonal: an orthogonal value is kept (its base becomes it).
    let mut q = Linear::new(4, 4, &dev()).unwrap();
    orthogonal(&mut q, "weight", None).unwrap();
    let target = parametrized_tensor(&fc, "weight").unwrap();
    let list: &ParametrizationList = q.get_submodule("parametrizations.weight").unwrap();
    list.right_inverse(&Tensor::eye(4, DType::F32, &dev()).unwrap())
        .unwrap();
    let eye = Tensor::eye(4, DType::F32, &dev()).unwrap();
    assert!(max_diff(&parametrized_tensor(&q, "weight").unwrap(), &eye) < 1e-6);

    let before: Vec<(String, Tensor)> = (fc.state_dict().unwrap().iter())
        .map(|(k, t)| (k.to_owned(), t.copy().unwrap()))
        .collect();
    let list: &ParametrizationList = fc.get_submodule("parametrizations.weight").unwrap();
    let err = list
        .right_inverse(&w.t().unwrap().narrow(0, 0, 3).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("[3, 4]"), "{err}");
    for (k, t) in &before {
        assert_eq!(max_diff(t, fc.state_dict().unwrap().get(k).unwrap()), 0.0);
    }
    assert!(max_diff(&parametrized_tensor(&fc, "weight").unwrap(), &target) < 1e-6);
}

/// Inside containers, as vocoders hold their layers: a `ModuleList` of upsampling convolutions
/// and a `Sequential`, by index in the path.
#[test]
fn inside_containers() {
    use module_runtime::nn::{ConvTranspose1d, ModuleList, ReLU, Sequential};
    #[derive(Module)]
    struct Vocoder {
        ups: ModuleList<ConvTranspose1d>,
        post: Sequential,
    }
    let mut ups = ModuleList::new();
    ups.push(ConvTranspose1d::new(4, 2, 4, &dev()).unwrap());
    ups.push(ConvTranspose1d::new(2, 2, 4, &dev()).unwrap());
    let mut post = Sequential::new();
    post.push(Linear::new(7, 3, &dev()).unwrap());
    post.push(ReLU::new());
    let mut model = Vocoder { ups, post };
    let x = Tensor::randn(0f32, 1., (1, 4, 1), &dev()).unwrap();
    let run = |m: &Vocoder| {
        let h = m.ups[1].call(&m.ups[0].call(&x).unwrap()).unwrap();
        m.post.call(&h).unwrap()
    };
    let before = run(&model);
    for i in 0..2 {
        weight_norm(&mut model, &format!("ups.{i}.weight"), Some(0)).unwrap();
    }
    weight_norm(&mut model, "post.0.weight", Some(0)).unwrap();
    assert!(max_diff(&before, &run(&model)) < 1e-5);
    let keys: Vec<String> = model
        .state_dict()
        .unwrap()
        .keys()
        .map(str::to_owned)
        .collect();
    assert!(keys.contains(&"ups.1.parametrizations.weight.original1".to_owned()));
    assert!(keys.contains(&"post.0.parametrizations.weight.original0".to_owned()));
    assert!(model
        .to_string()
        .contains("(0): ParametrizedConvTranspose1d("));
}
