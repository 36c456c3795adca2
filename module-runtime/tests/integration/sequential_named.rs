//! `Sequential` with PyTorch's named entries: `add_module("4", layer)` and
//! `Sequential(OrderedDict(...))`, as torchvision-style feature slices use them.

use module_runtime::nn::{Functional, Sequential, SequentialLayer};
use module_runtime::prelude::*;

fn relu() -> Functional {
    Functional::named("ReLU", |x: &Tensor| x.relu())
}

fn names<T>(items: Vec<(String, T)>) -> Vec<String> {
    items.into_iter().map(|(n, _)| n).collect()
}

/// PyTorch: `for i in range(4, 10): slice2.add_module(str(i), features[i])` keeps the original
/// indices in the state dict (`slice2.4.weight`, `slice2.8.bias`); `Module.add_module` in
/// `torch/nn/modules/module.py` stores the name as given and `Sequential.forward` runs
/// `self._modules.values()` in insertion order.
#[test]
fn add_module_keeps_pytorch_offset_names_and_runs_in_insertion_order() -> Result<()> {
    let dev = Device::Cpu;
    let mut slice = Sequential::new();
    slice.add_module("4", Linear::new(3, 5, &dev)?)?;
    slice.add_module("6", relu())?;
    slice.add_module("8", Linear::new(5, 2, &dev)?)?;
    slice.add_module("9", relu())?;
    assert_eq!(slice.len(), 4);
    assert_eq!(
        names(slice.named_parameters()),
        ["4.weight", "4.bias", "8.weight", "8.bias"]
    );
    let keys: Vec<String> = slice.state_dict()?.keys().map(|k| k.to_string()).collect();
    assert_eq!(keys, ["4.weight", "4.bias", "8.weight", "8.bias"]);
    assert_eq!(names(slice.named_modules()), ["", "4", "6", "8", "9"]);
    let names: Vec<String> = slice.names().map(|n| n.to_string()).collect();
    assert_eq!(names, ["4", "6", "8", "9"]);

    // Positional access stays positional; access by name goes through the name.
    assert!(slice.get(2).unwrap().is::<Linear>());
    assert!(slice.get(1).unwrap().is::<Functional>());
    assert!(slice.get(4).is_none());
    assert!(slice.get_named("8").unwrap().is::<Linear>());
    assert!(slice.get_named("2").is_none());
    let l8: &Linear = slice.get_submodule("8")?;
    let l4: &Linear = slice.get_submodule("4")?;

    let x = Tensor::randn(0f32, 1., (7, 3), &dev)?;
    let y = slice.call(&x)?;
    let expected = l8.call(&l4.call(&x)?.relu()?)?.relu()?;
    assert_eq!(y.to_vec2::<f32>()?, expected.to_vec2::<f32>()?);
    Ok(())
}

/// PyTorch's `nn.Sequential(OrderedDict([...]))`: the dict's keys are the children's names.
#[test]
fn sequential_from_ordered_dict_pairs_names_children_by_key() -> Result<()> {
    let dev = Device::Cpu;
    let seq = Sequential::from_named([
        (
            "conv",
            Box::new(Linear::new(2, 4, &dev)?) as Box<dyn SequentialLayer>,
        ),
        ("act", Box::new(relu())),
        ("0", Box::new(Linear::new(4, 1, &dev)?)),
    ])?;
    assert_eq!(
        names(seq.named_parameters()),
        ["conv.weight", "conv.bias", "0.weight", "0.bias"]
    );
    // A checkpoint saved from the PyTorch model loads by these names.
    let copy = Sequential::from_named([
        (
            "conv",
            Box::new(Linear::new(2, 4, &dev)?) as Box<dyn SequentialLayer>,
        ),
        ("act", Box::new(relu())),
        ("0", Box::new(Linear::new(4, 1, &dev)?)),
    ])?;
    copy.load_state_dict(&seq.state_dict()?, &LoadOptions::default())?;
    let x = Tensor::randn(0f32, 1., (3, 2), &dev)?;
    assert_eq!(
        seq.call(&x)?.to_vec2::<f32>()?,
        copy.call(&x)?.to_vec2::<f32>()?
    );
    Ok(())
}

fn config_error(result: Result<()>) -> String {
    match result {
        Err(Error::InvalidConfig { layer, message }) => format!("{layer}: {message}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

/// Names are path segments: PyTorch's `add_module` raises `KeyError` for an empty name or one
/// containing `.` (and `*` is a pattern's wildcard); a duplicate would silently replace the entry there, and is an error here.
#[test]
fn add_module_rejects_empty_dotted_and_duplicate_names() -> Result<()> {
    let mut seq = Sequential::new();
    seq.add_module("4", relu())?;
    for bad in ["", "a.b", "*", "layer*"] {
        match seq.add_module(bad, relu()) {
            Err(Error::InvalidKey {
                container: "Sequential",
                key,
                ..
            }) => assert_eq!(key, bad),
            other => panic!("expected InvalidKey for {bad:?}, got {other:?}"),
        }
    }
    let duplicate = config_error(seq.add_module("4", relu()));
    assert!(duplicate.contains("`4`"), "{duplicate}");
    // Nothing was added by the failed calls.
    assert_eq!(seq.len(), 1);

    let pairs = [
        ("a", Box::new(relu()) as Box<dyn SequentialLayer>),
        ("a", Box::new(relu())),
    ];
    assert!(matches!(
        Sequential::from_named(pairs),
        Err(Error::InvalidConfig { .. })
    ));
    // A position already used as a name is taken by a positional entry, too.
    let mut positional = Sequential::new().add(relu());
    assert!(positional.add_module("0", relu()).is_err());
    Ok(())
}

/// `push` after named entries never replaces one (PyTorch's `append` uses `str(len(self))` and
/// would): it takes the next free number.
#[test]
fn push_after_named_entries_takes_the_next_free_number() -> Result<()> {
    let mut seq = Sequential::new();
    seq.add_module("1", relu())?;
    seq.push(relu());
    seq.push(relu());
    let names: Vec<String> = seq.names().map(|n| n.to_string()).collect();
    assert_eq!(names, ["1", "2", "3"]);
    assert_eq!(format!("{seq:?}").matches("ReLU").count(), 3);
    Ok(())
}
