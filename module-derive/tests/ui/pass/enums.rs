//! Enums: newtype variants are transparent, struct variants list their fields, unit variants are
//! empty.
use module_runtime::candle_core::{DType, Device, Tensor};
use module_runtime::nn::Linear;
use module_runtime::{Module, ModuleExt, Param};

#[derive(Module)]
enum Head {
    Linear(Linear),
    Scaled { proj: Linear, scale: Param },
    Pair(Linear, Linear),
    Identity,
}

#[derive(Module)]
struct Net {
    head: Head,
}

fn names(net: &Net) -> Vec<String> {
    net.named_parameters().into_iter().map(|(n, _)| n).collect()
}

#[test]
fn compiles_and_runs() {
    let dev = Device::Cpu;
    let lin = || Linear::no_bias(2, 2, &dev).unwrap();
    let net = Net {
        head: Head::Linear(lin()),
    };
    assert_eq!(names(&net), ["head.weight"]);
    let scale = Param::new(Tensor::ones(2, DType::F32, &dev).unwrap()).unwrap();
    let net = Net {
        head: Head::Scaled { proj: lin(), scale },
    };
    // PyTorch's order: own parameters before submodules'.
    assert_eq!(names(&net), ["head.scale", "head.proj.weight"]);
    let net = Net {
        head: Head::Pair(lin(), lin()),
    };
    assert_eq!(names(&net), ["head.0.weight", "head.1.weight"]);
    let net = Net {
        head: Head::Identity,
    };
    assert!(names(&net).is_empty());
}
