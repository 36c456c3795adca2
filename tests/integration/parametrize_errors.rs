//! The parametrizations' errors: each names the path (and the shapes or values involved), and
//! leaves the model as it was.

use module_runtime::nn::parametrize::{
    is_parametrized, remove_parametrizations, spectral_norm, weight_norm, SpectralNormOptions,
};
use module_runtime::prelude::*;
use module_runtime::ParametrizeError;

use super::{keys_and_shapes, net, Net};

/// Every error names the path, and leaves the model as it was.
#[test]
fn errors_leave_the_model_untouched() {
    let mut model = net();
    weight_norm(&mut model, "conv.weight", Some(0)).unwrap();
    let keys = |m: &Net| keys_and_shapes(&m.state_dict().unwrap());
    let before = keys(&model);

    let err = weight_norm(&mut model, "fc.wieght", Some(0)).unwrap_err();
    assert!(
        matches!(&err, Error::Parametrize(ParametrizeError::NoTensor { path, available, .. })
            if path == "fc.wieght" && available == &["weight", "bias"]),
        "{err}"
    );
    // The model itself is no layer that takes parametrizations.
    let err = weight_norm(&mut model, "weight", Some(0)).unwrap_err();
    assert!(
        matches!(&err, Error::Parametrize(ParametrizeError::UnsupportedModule { path, found })
            if path.is_empty() && found == "Net"),
        "{err}"
    );
    let err = weight_norm(&mut model, "fc.weight", Some(2)).unwrap_err();
    assert!(err.to_string().contains("fc.weight"), "{err}");
    let options = SpectralNormOptions {
        dim: Some(3),
        ..Default::default()
    };
    let err = spectral_norm(&mut model, "fc.weight", options).unwrap_err();
    assert!(err.to_string().contains("[2, 3]"), "{err}");
    let err = remove_parametrizations(&mut model, "fc.weight", true).unwrap_err();
    assert!(
        matches!(&err, Error::Parametrize(ParametrizeError::NotParametrized { path, .. })
            if path == "fc.weight"),
        "{err}"
    );
    // Weight norm has two originals: nothing to leave unparametrized.
    let err = remove_parametrizations(&mut model, "conv.weight", false).unwrap_err();
    assert!(err.to_string().contains("conv.weight"), "{err}");
    // Weight norm takes two originals: it cannot follow another parametrization.
    let err = weight_norm(&mut model, "conv.weight", None).unwrap_err();
    assert!(err.to_string().contains("conv.weight"), "{err}");
    assert!(weight_norm(&mut model, "nothing.weight", None).is_err());
    assert_eq!(keys(&model), before);
    assert!(is_parametrized(&model, "conv.weight"));
    assert!(!is_parametrized(&model, "fc.weight"));
}

/// A parametrization of one's own that changes the tensor's shape is refused, naming both shapes.
#[test]
fn a_parametrization_must_keep_the_shape() {
    use module_runtime::nn::parametrize::{register_parametrization, Parametrization};
    #[derive(Module, Clone, Debug)]
    struct Transpose;
    impl Parametrization for Transpose {
        fn forward(&self, originals: &[Tensor]) -> Result<Tensor> {
            Ok(originals[0].t()?)
        }
    }
    let mut model = net();
    let err = register_parametrization(&mut model, "fc.weight", Transpose).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("fc.weight") && text.contains("[3, 2]") && text.contains("[2, 3]"),
        "{text}"
    );
    assert!(!is_parametrized(&model, "fc.weight"));
    assert!(model.fc.weight.tensor().is_ok());
}

/// Adapters and quantization refuse a parametrized layer (typed errors, nothing changed).
#[test]
fn adapters_and_quantization_refuse_a_parametrized_layer() {
    use module_runtime::nn::peft::{get_peft_model, LoraConfig, TargetModules};
    let mut model = net();
    weight_norm(&mut model, "fc.weight", Some(0)).unwrap();
    let before = keys_and_shapes(&model.state_dict().unwrap());
    let err = quantize(&model, "fc", GgmlDType::Q8_0).unwrap_err();
    assert!(err.to_string().contains("fc.weight"), "{err}");
    let config = LoraConfig::new(TargetModules::names(["fc"]));
    let err = get_peft_model(&mut model, &config).unwrap_err();
    assert!(err.to_string().contains("parametrized"), "{err}");
    assert_eq!(keys_and_shapes(&model.state_dict().unwrap()), before);
    assert!(model.fc.lora().is_none());
}
